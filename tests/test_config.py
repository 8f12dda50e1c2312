"""Methods are explicit TrainConfig fields (fmt, lora, aqn); method names are only their shorthand.
QuantizeConfig and AQNConfig come from TrainConfig by one function each."""

import argparse
import dataclasses

import pytest

from qerl import formats
from qerl.cli_train import add_train_args, config_from_args
from qerl.config import METHODS, make_config, method_name, methods, parse_method, table_bases


def test_every_method_shorthand_round_trips_through_the_fields():
    assert set(METHODS) <= set(methods())
    for m in methods():
        fields = parse_method(m)
        cfg = make_config("smoke", **fields)
        assert (cfg.fmt, cfg.lora, cfg.aqn) == (fields["fmt"], fields["lora"], fields["aqn"])
        assert cfg.method == m == make_config("smoke", method=m).method
        assert cfg.to_dict()["method"] == m
    assert parse_method("nvfp4_lora_aqn") == {"fmt": "nvfp4", "lora": True, "aqn": True}
    assert parse_method("bf16_full") == {"fmt": "bf16", "lora": False, "aqn": False}
    # Every registered format is a base, with and without AQN.
    assert set(table_bases()) == {"bf16", *formats.names()}
    assert {method_name(f, aqn=a) for f in formats.names() for a in (False, True)} <= set(methods())


def test_fields_are_validated_and_a_contradicting_shorthand_is_refused():
    assert make_config("smoke", fmt="mxfp4", aqn=False).method == "mxfp4_lora"
    with pytest.raises(ValueError, match="contradicts"):
        make_config("smoke", method="nvfp4_lora", fmt="nf4")
    with pytest.raises(ValueError, match="full fine-tuning"):
        make_config("smoke", fmt="nvfp4", lora=False, aqn=False)
    with pytest.raises(ValueError, match="AQN"):
        make_config("smoke", fmt="bf16", lora=False, aqn=True)
    with pytest.raises(ValueError, match="fmt must be one of"):
        make_config("smoke", fmt="int8")


def test_quantize_and_aqn_configs_are_built_from_the_train_config():
    cfg = make_config("smoke", method="nf4_lora_aqn", lora_rank=4, lora_alpha=12.0, lora_dropout=0.1,
                      backend="reference", sigma_start=2e-2, sigma_end=1e-3, num_stages=4,
                      noise_schedule="cosine", seed=5)
    qc = cfg.quantize_config()
    assert (qc.fmt, qc.lora_rank, qc.lora_alpha, qc.lora_dropout, qc.backend) == ("nf4", 4, 12.0, 0.1, "reference")
    assert cfg.quantize_config(lora=False).lora_rank == 0
    aqn = cfg.aqn_config()
    assert dataclasses.asdict(aqn) == dict(enabled=True, sigma_start=2e-2, sigma_end=1e-3, num_stages=4,
                                           schedule="cosine", seed=5, mode="restored")
    assert make_config("smoke", method="nf4_lora").aqn_config().enabled is False


def test_cli_method_is_shorthand_for_the_fields():
    p = argparse.ArgumentParser()
    add_train_args(p)
    cfg = config_from_args(p.parse_args(["--profile", "smoke", "--method", "bf16_full"]))
    assert (cfg.fmt, cfg.lora, cfg.aqn) == ("bf16", False, False)
    cfg = config_from_args(p.parse_args(["--profile", "smoke", "--fmt", "nf4", "--aqn", "false"]))
    assert cfg.method == "nf4_lora"
    with pytest.raises(SystemExit):
        p.parse_args(["--fmt", "int8"])


def test_a_registered_format_is_a_method_base_even_with_an_underscore_in_its_name():
    formats.register(dataclasses.replace(formats.get("nf4"), name="nf4_copy"))
    try:
        assert {"nf4_copy_lora", "nf4_copy_lora_aqn"} <= set(methods())
        assert parse_method("nf4_copy_lora_aqn") == {"fmt": "nf4_copy", "lora": True, "aqn": True}
        cfg = make_config("smoke", method="nf4_copy_lora")
        assert (cfg.fmt, cfg.method, cfg.quantize_config().fmt) == ("nf4_copy", "nf4_copy_lora", "nf4_copy")
    finally:
        formats.unregister("nf4_copy")
    with pytest.raises(ValueError, match="unknown method"):
        parse_method("nf4_copy_lora")


# ---------------------------------------------------------------------------------------------
# config files, snake_case and TRL's flag names


def _args(*argv):
    p = argparse.ArgumentParser()
    add_train_args(p)
    return config_from_args(p.parse_args(list(argv)))


def test_snake_case_and_trl_flag_names():
    a = _args("--profile", "smoke", "--num_generations", "6", "--max-completion-length", "9", "--save_steps", "3",
              "--per_device_train_batch_size", "5", "--lora_r", "4", "--learning_rate", "2e-4", "--report_to", "none",
              "--reward_funcs", "math_verify", "--eval_datasets", "none")
    assert (a.num_generations, a.max_completion_length, a.save_every, a.micro_batch_size, a.lora_rank) == (6, 9, 3, 5, 4)
    assert a.learning_rate == 2e-4 and a.wandb_mode == "disabled" and a.reward == ("math_verify",)
    assert a.eval_datasets == () and a.profile == "smoke"


def test_config_file_then_flags(tmp_path):
    from qerl.config import read_config_file

    f = tmp_path / "c.yaml"
    f.write_text("profile: smoke\nmethod: bf16_lora\nlearning_rate: 1e-5\nnum_generations: 6\nlora_r: 8\n"
                 "arith_levels: [0, 2]\nreport_to: wandb\nper-device-train-batch-size: 4\n")
    assert read_config_file(f)["learning_rate"] == 1e-5  # YAML reads 1e-5 as a string; qerl as the float
    c = _args("--config", str(f), "--num-generations", "4")
    assert (c.profile, c.method, c.learning_rate, c.num_generations, c.lora_rank, c.arith_levels,
            c.micro_batch_size) == ("smoke", "bf16_lora", 1e-5, 4, 8, (0, 2), 4)
    assert _args("--config", str(f), "--method", "nvfp4_lora").method == "nvfp4_lora"  # the flag's method wins
    assert _args("--config", str(f), "--profile", "small").max_steps == make_config("small").max_steps
    j = tmp_path / "c.json"
    j.write_text('{"num_generations": 3, "seed": 4}')
    assert (_args("--config", str(j)).num_generations, _args("--config", str(j)).seed) == (3, 4)


@pytest.mark.parametrize("text, match", [
    ("num_generation: 4\n", r"unknown setting 'num_generation' \(did you mean 'num_generations'\?\)"),
    ("learning_rate: fast\n", "learning_rate must be float"),
    ("max_steps: 2.5\n", "max_steps must be int"),
    ("- a\n- b\n", "expected a mapping"),
    ("a: [1,\n", r"c\.yaml:\d+: not valid YAML"),
    ("report_to: tensorboard\n", "W&B"),
])
def test_bad_config_files_name_the_file(tmp_path, text, match):
    f = tmp_path / "c.yaml"
    f.write_text(text)
    with pytest.raises(ValueError, match=match):
        _args("--config", str(f))
