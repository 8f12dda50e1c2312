"""Evaluation: pass@1 over k samples with its standard error, the one place evaluation settings come
from, and `python -m qerl eval` on a checkpoint whose LoRA rank is not the profile's.

Run: python -m pytest tests/test_evaluate.py -q      (tiny random models, CPU, ~1 min)
"""

import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from qerl import cli
from qerl import rewards as qrewards
from qerl.checkpoint import load_trainable, read_checkpoint_config
from qerl.cli_train import eval_flags, eval_settings_of
from qerl.config import PROFILES, eval_settings, make_config
from qerl.evaluate import evaluate, pass_at_1
from qerl.policy import build_policy
from qerl.train import train

_spec = importlib.util.spec_from_file_location("_qerl_tests_conftest", Path(__file__).with_name("conftest.py"))
_conftest = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_conftest)
make_tiny_model, make_tiny_tokenizer = _conftest.make_tiny_model, _conftest.make_tiny_tokenizer




def test_pass_at_1_and_its_standard_error_over_problems():
    # 3 problems x 4 samples: per-problem means 1.0, 0.5, 0.0
    scores = [1, 1, 1, 1, 1, 0, 1, 0, 0, 0, 0, 0]
    mean, se = pass_at_1([float(x) for x in scores], 4)
    assert mean == pytest.approx(0.5)
    assert se == pytest.approx(math.sqrt(0.25 / 3))  # sample variance of (1, .5, 0) is 0.25
    # the same scores read as 12 one-sample problems give a different (larger) error
    assert pass_at_1([float(x) for x in scores], 1)[1] == pytest.approx(math.sqrt((0.5 * 0.5 * 12 / 11) / 12))
    assert pass_at_1([1.0, 0.0], 2) == (0.5, None)  # one problem: no error bar
    with pytest.raises(ValueError, match="do not split"):
        pass_at_1([1.0, 0.0, 1.0], 2)


def test_profiles_evaluate_with_at_least_8_samples():
    for profile in ("small", "paper"):
        assert make_config(profile).eval_samples >= 8, profile
        assert eval_settings(make_config(profile))["samples"] >= 8
    assert PROFILES["smoke"].get("eval_samples", 1) >= 1
    with pytest.raises(ValueError, match="eval_samples"):
        make_config("smoke", eval_samples=0)


@pytest.mark.parametrize("kw", [
    dict(eval_samples=5, eval_datasets=("arith", "gsm8k"), data_dir="DATA", eval_greedy=True),
    dict(eval_samples=3, eval_datasets=("tasks.jsonl",), prompt_column="q", answer_column="a", prompt_suffix="",
         chat_template=False),
])
def test_eval_flags_round_trip_through_the_eval_cli(kw):
    """The experiment scripts turn eval_settings into `eval` flags; the CLI reads them back unchanged."""
    settings = eval_settings(make_config("small", **kw))
    args = cli.build_parser().parse_args(["eval", *eval_flags(settings)])
    _, got = eval_settings_of(args)
    assert got == settings
    # the default prompt settings are not spelled out: the experiments' eval commands stay as they were
    assert "--prompt-suffix" not in eval_flags(eval_settings(make_config("small")))


def test_greedy_evaluation_records_one_sample():
    """--greedy over a profile of 8 samples: the settings (and the eval JSON) say 1; --samples 8 --greedy is refused."""
    args = cli.build_parser().parse_args(["eval", "--profile", "small", "--greedy"])
    assert eval_settings_of(args)[1]["samples"] == 1
    assert eval_settings(make_config("small", eval_greedy=True))["samples"] == 1
    args = cli.build_parser().parse_args(["eval", "--greedy", "--samples", "8"])
    with pytest.raises(ValueError, match="--samples 8 with --greedy"):
        eval_settings_of(args)


def test_evaluate_reports_problems_samples_and_stderr(monkeypatch):
    model, tok = make_tiny_model("llama"), make_tiny_tokenizer()
    seen = []

    def fake(completions, golds, **kw):  # every sample of problems 0, 2, 4 is right, of 1 and 3 wrong
        r = [float(int(g) % 2 == 0) for g in golds]
        seen.extend(golds)
        return qrewards.RewardResult(rewards=r, format=[0.0] * len(r), unparsed=0, sources=["none"] * len(r))

    monkeypatch.setattr(qrewards, "score_batch", fake)
    recs = [{"question": f"w{i} w{i + 1}", "answer": str(i)} for i in range(5)]
    res = evaluate(model, tok, recs, samples=3, max_new_tokens=3, batch_size=4, engine="hf")
    assert res["num_problems"] == 5 and res["samples"] == 3 and res["accuracy"] == pytest.approx(0.6)
    assert res["accuracy_stderr"] == pytest.approx(math.sqrt(0.3 / 5))
    assert seen == [str(i) for i in range(5) for _ in range(3)]  # samples of a problem are consecutive
    assert evaluate(model, tok, recs, samples=3, greedy=True, max_new_tokens=2, engine="hf")["samples"] == 1


def test_evaluate_reports_the_fraction_of_samples_cut_at_the_cap(monkeypatch):
    """``truncated``: the samples that reached max_new_tokens without ending, over all samples of all batches."""
    import qerl.evaluate as qeval

    model, tok = make_tiny_model("llama"), make_tiny_tokenizer()
    cut = []
    real = qeval.make_engine

    def engine(*a, **k):
        e = real(*a, **k)
        gen = e.generate
        e.generate = lambda *ga, **gk: (lambda ro: cut.extend(ro.truncated.tolist()) or ro)(gen(*ga, **gk))
        return e

    monkeypatch.setattr(qeval, "make_engine", engine)
    recs = [{"question": f"w{i} w{i + 1}", "answer": str(i)} for i in range(5)]
    for n in (1, 40):
        cut.clear()
        res = evaluate(model, tok, recs, samples=3, max_new_tokens=n, batch_size=4, engine="hf")
        assert len(cut) == 15 and res["truncated"] == pytest.approx(sum(cut) / 15)
    assert res["truncated"] < 1  # some of the random model's samples end within 40 tokens


def _tiny_run(tmp_path, tiny_dir, **kw):
    base = dict(output_dir=str(tmp_path / "run"), model=str(tiny_dir), method="nvfp4_lora", eval_datasets=(),
                max_steps=1, save_every=0, max_completion_length=6, prompts_per_step=2, num_generations=4,
                micro_batch_size=8, lora_rank=8, lora_alpha=16, max_prompt_length=512, wandb_mode="disabled",
                learning_rate=1e-2)
    train(make_config("smoke", **{**base, **kw}))
    return tmp_path / "run" / "checkpoints" / "step-1"


def test_train_summary_has_the_eval_error_bar(tmp_path, text_rewards, tiny_llama_dir):
    _tiny_run(tmp_path, tiny_llama_dir, eval_datasets=("arith",), eval_limit=3, eval_samples=2,
              eval_max_completion_length=3)
    s = json.loads((tmp_path / "run" / "summary.json").read_text())
    for prefix in ("eval_before", "eval"):
        assert s[f"{prefix}/arith/num_problems"] == 3 and s[f"{prefix}/arith/samples"] == 2
        assert f"{prefix}/arith/accuracy" in s and f"{prefix}/arith/accuracy_stderr" in s
        assert 0 <= s[f"{prefix}/arith/truncated"] <= 1  # the samples cut at the 3-token cap


def test_eval_cli_reads_the_rank_of_a_rank8_checkpoint(tmp_path, text_rewards, tiny_llama_dir, capsys):
    ck = _tiny_run(tmp_path, tiny_llama_dir)
    assert read_checkpoint_config(ck) == {"model": str(tiny_llama_dir), "method": "nvfp4_lora", "lora_rank": 8,
                                          "lora_alpha": 16.0, "lora_dropout": 0.0, "train_norms": False}
    # the PEFT adapter exported next to it says the same
    peft = read_checkpoint_config(ck / "adapter")
    assert (peft["lora_rank"], peft["lora_alpha"], peft["train_norms"]) == (8, 16.0, False)
    # --profile small has rank 32: the checkpoint's rank 8 must win
    out = tmp_path / "eval.json"
    rc = cli.main(["eval", "--profile", "small", "--adapter", str(ck), "--datasets", "arith", "--limit", "2",
                   "--samples", "2", "--max-new-tokens", "3", "--engine", "hf", "--out", str(out)])
    out_err = capsys.readouterr()
    assert rc == 0, out_err.err
    assert f"method nvfp4_lora: the checkpoint's ({ck})" in out_err.out  # it says which method it used
    # a method that contradicts the checkpoint (another base format, or no adapter) is refused, naming both
    for wrong in ("bf16_lora", "nf4_lora_aqn"):
        rc = cli.main(["eval", "--adapter", str(ck), "--method", wrong, "--datasets", "arith", "--limit", "1"])
        err = capsys.readouterr().err
        assert rc == 2 and err.count("error:") == 1, err
        assert f"--method {wrong} contradicts the checkpoint {ck}, trained as nvfp4_lora" in err
    res = json.loads(out.read_text())
    assert res["results"]["arith"]["num_problems"] == 2 and res["results"]["arith"]["samples"] == 2
    assert res["policy"]["method"] == "nvfp4_lora"
    # the weights that eval loads are the checkpoint's, from either folder
    state = load_file(str(ck / "trainable.safetensors"))
    assert any(".lora_B." in n and t.abs().sum() > 0 for n, t in state.items())
    for src in (ck, ck / "adapter"):
        cfg = make_config("smoke", model=str(tiny_llama_dir), method="nvfp4_lora", lora_rank=8, lora_alpha=16)
        model, _, _, _ = build_policy(cfg, device=torch.device("cpu"))
        load_trainable(src, model)
        params = dict(model.named_parameters())
        for n, t in state.items():
            assert torch.equal(params[n].detach(), t), (src, n)


def test_eval_cli_errors_are_one_line(tmp_path, capsys):
    peft = tmp_path / "peft"
    peft.mkdir()
    (peft / "adapter_config.json").write_text(json.dumps({"r": 8, "lora_alpha": 16, "target_modules": [
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]}))
    assert cli.main(["eval", "--adapter", str(peft)]) == 2
    assert "pass --method" in capsys.readouterr().err
    (peft / "adapter_config.json").write_text(json.dumps({"r": 8, "lora_alpha": 16, "target_modules": ["q_proj"]}))
    assert cli.main(["eval", "--adapter", str(peft), "--method", "nvfp4_lora"]) == 2
    assert "qerl rebuilds only" in capsys.readouterr().err
    assert cli.main(["eval", "--adapter", str(tmp_path / "nope")]) == 2
    assert "no such checkpoint" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert cli.main(["eval", "--adapter", str(tmp_path / "empty")]) == 2
    assert "neither a qerl checkpoint" in capsys.readouterr().err
