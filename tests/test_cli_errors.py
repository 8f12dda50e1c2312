"""Bad input at the command line: one clear line on stderr, a non-zero exit, no traceback (unless
--debug). Fast: tiny models, in-process CLI calls, one real Ctrl-C on a subprocess (CI runs this file).
"""

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from qerl.cli import build_parser, join_negative_values, main

ROOT = Path(__file__).resolve().parent.parent


def run_cli(capsys, *argv):
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def assert_one_line_error(rc, err, *needles):
    assert rc != 0
    assert "Traceback" not in err
    lines = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1, err
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]


@pytest.mark.parametrize("flag,value,field", [
    ("--learning-rate", "-1e-4", "learning_rate"), ("--learning-rate", "0", "learning_rate"),
    ("--top-p", "1.5", "top_p"), ("--temperature", "-0.5", "temperature"), ("--seed", "-3", "seed"),
    ("--num-generations", "1", "num_generations"), ("--warmup-ratio", "2", "warmup_ratio"),
    ("--max-steps", "0", "max_steps"), ("--lora-dropout", "1.0", "lora_dropout"), ("--eval-limit", "-1", "eval_limit"),
])
def test_values_out_of_range(capsys, tmp_path, flag, value, field):
    rc, _, err = run_cli(capsys, "train", "--profile", "smoke", flag, value, "--output-dir", tmp_path / "r")
    line = assert_one_line_error(rc, err, field, flag, "must be")
    assert rc == 2 and float(line.rsplit("got ", 1)[1]) == float(value)
    assert not (tmp_path / "r").exists()  # nothing written


@pytest.mark.parametrize("flag,value", [("--limit", "-1"), ("--samples", "0"), ("--temperature", "-1e-3"),
                                        ("--top-p", "1.5"), ("--max-new-tokens", "0")])
def test_eval_values_out_of_range(capsys, flag, value):
    rc, _, err = run_cli(capsys, "eval", flag, value)
    assert_one_line_error(rc, err, flag, "must be")


def test_negative_numbers_are_values_not_flags():
    assert join_negative_values(["--learning-rate", "-1e-4", "--seed", "-3", "--top-k", "5"]) == [
        "--learning-rate=-1e-4", "--seed=-3", "--top-k", "5"]
    assert join_negative_values(["--x", "-.5", "--y", "-inf", "-h"]) == ["--x=-.5", "--y=-inf", "-h"]


def test_debug_shows_the_traceback(tmp_path):
    with pytest.raises(ValueError, match="learning_rate"):
        main(["train", "--learning-rate", "-1", "--debug", "--output-dir", str(tmp_path / "r")])


def test_every_train_flag_has_help_with_default():
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    train = sub.choices["train"]
    flags = [a for a in train._actions if a.option_strings and a.dest not in ("help", "debug")]
    assert len(flags) > 40
    missing = [a.option_strings[0] for a in flags if not a.help or "default" not in a.help]
    assert not missing, missing
    lr = next(a for a in flags if a.dest == "learning_rate")
    assert "learning rate" in lr.help and "smoke" in lr.help  # the profiles' values too
    train.format_help()  # every help string formats (no stray %)


def _corrupt_copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    f = dst / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])  # truncated mid-tensor
    return dst


@pytest.mark.parametrize("command", ["train", "eval"])
def test_truncated_safetensors(capsys, tmp_path, tiny_llama_dir, command):
    bad = _corrupt_copy(tiny_llama_dir, tmp_path / "bad")
    extra = ["--output-dir", tmp_path / "r", "--fmt", "bf16"] if command == "train" else ["--method", "bf16_lora"]
    rc, _, err = run_cli(capsys, command, "--model", bad, *extra)
    assert_one_line_error(rc, err, str(bad), "truncated or corrupt")


def test_header_only_safetensors(capsys, tmp_path, tiny_llama_dir):
    bad = tmp_path / "bad"
    shutil.copytree(tiny_llama_dir, bad)
    (bad / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{garbage")
    rc, _, err = run_cli(capsys, "train", "--model", bad, "--fmt", "bf16", "--output-dir", tmp_path / "r")
    assert_one_line_error(rc, err, str(bad), "truncated or corrupt")


def test_corrupt_gguf(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("QERL_CACHE", str(tmp_path / "cache"))
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"GGUF" + os.urandom(200))
    rc, _, err = run_cli(capsys, "train", "--model", bad, "--output-dir", tmp_path / "r")
    assert_one_line_error(rc, err, str(bad), "truncated or corrupt")
    # the embedded model read from QERL_SMOLLM2_GGUF (a GPU machine's copy): the same clear line
    monkeypatch.setenv("QERL_SMOLLM2_GGUF", str(bad))
    rc, _, err = run_cli(capsys, "eval", "--model", "smollm2-135m-instruct")
    assert_one_line_error(rc, err, str(bad), "QERL_SMOLLM2_GGUF")
    monkeypatch.setenv("QERL_SMOLLM2_GGUF", str(tmp_path / "missing.gguf"))
    rc, _, err = run_cli(capsys, "eval", "--model", "smollm2-135m-instruct")
    assert_one_line_error(rc, err, "QERL_SMOLLM2_GGUF", "no such file")


@pytest.mark.parametrize("line,needle", [
    ('{"question": "What is 1 + 1?", "answer": "#### 2"', "not valid JSON"),
    ('["a list"]', "expected a JSON object"),
    ('{"answer": "#### 2"}', "no question"),
    ('{"question": "What is 1 + 1?"}', "no answer field"),
    ('{"question": "What is 1 + 1?", "answer": "2, no marker"}', "####"),
])
def test_malformed_data_row_names_file_and_line(capsys, tmp_path, tiny_llama_dir, line, needle):
    data = tmp_path / "data" / "gsm8k"
    data.mkdir(parents=True)
    good = '{"question": "What is 2 + 3?", "answer": "2 + 3 = 5\\n#### 5"}'
    (data / "train.jsonl").write_text("\n".join([good, good, "", line, good]) + "\n")
    rc, _, err = run_cli(capsys, "train", "--model", tiny_llama_dir, "--fmt", "bf16", "--dataset", "gsm8k",
                         "--data-dir", tmp_path / "data", "--output-dir", tmp_path / "r", "--max-prompt-length", "512")
    assert_one_line_error(rc, err, f"{data / 'train.jsonl'}:4", needle)


def test_finished_run_refused_by_the_cli(capsys, tmp_path):
    out = tmp_path / "r"
    out.mkdir()
    (out / "summary.json").write_text('{"status": "ok"}')
    (out / "metrics.jsonl").write_text("")
    rc, _, err = run_cli(capsys, "train", "--profile", "smoke", "--output-dir", out)
    assert_one_line_error(rc, err, str(out), "finished run", "--overwrite", "--resume-from auto")


def test_unexpected_errors_are_one_line_too(capsys, monkeypatch, tmp_path):
    import qerl.train

    def boom(cfg):
        raise RuntimeError("something deep\nand its second line")

    monkeypatch.setattr(qerl.train, "train", boom)
    rc, _, err = run_cli(capsys, "train", "--profile", "smoke", "--output-dir", tmp_path / "r")
    line = assert_one_line_error(rc, err, "RuntimeError: something deep", "--debug")
    assert rc == 1 and "second line" not in line


def test_ctrl_c_names_the_last_checkpoint_and_the_resume_command(tmp_path, tiny_llama_dir):
    """A real SIGINT to a training process on a tiny model, after its first checkpoint."""
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "qerl", "train", "--profile", "smoke", "--model", str(tiny_llama_dir),
           "--fmt", "bf16", "--max-steps", "100000", "--save-every", "1", "--wandb-mode",
           "disabled", "--max-prompt-length", "512", "--max-completion-length", "4", "--output-dir", str(out)]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    # The child's SIGINT disposition is set here, not inherited: a test run started as a background job
    # (`make test &`, nohup, CI scripts) ignores SIGINT, and Python keeps an ignored SIGINT ignored.
    p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.time() + 240
        while not (out / "checkpoints" / "step-2" / "manifest.json").exists():
            assert p.poll() is None, p.communicate()[1][-2000:]
            assert time.time() < deadline, "no checkpoint within 240 s"
            time.sleep(0.2)
        time.sleep(0.5)
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
    # 130, or killed by SIGINT after the message (-2; a shell shows 130 for both): about 1 run in 10 ends
    # the second way (seen in CI and locally, at this test's code unchanged since it was written; the
    # mechanism inside the interpreter's exit is not pinned down, LOG.md 2026-11-25). Either way the
    # process stopped on the interrupt and printed its one line, which is what the rest checks.
    assert p.returncode in (130, -signal.SIGINT), err[-2000:]
    assert "Traceback" not in err
    line = next(ln for ln in err.splitlines() if ln.startswith("interrupted"))
    assert f"{out / 'checkpoints'}/step-" in line and "--resume-from auto" in line and "python -m qerl train" in line


@pytest.mark.parametrize("name", ["trainable.safetensors", "state.pt"])
def test_truncated_checkpoint_on_resume(capsys, tmp_path, tiny_llama_dir, name):
    out = tmp_path / "r"
    argv = ["train", "--profile", "smoke", "--model", tiny_llama_dir, "--fmt", "bf16", "--max-steps", "2",
            "--save-every", "1", "--wandb-mode", "disabled", "--max-prompt-length", "512",
            "--max-completion-length", "4", "--output-dir", out]
    rc, _, err = run_cli(capsys, *argv, "--max-steps", "1")
    assert rc == 0, err[-2000:]
    f = out / "checkpoints" / "step-1" / name
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 3])
    rc, _, err = run_cli(capsys, *argv, "--resume-from", "auto")
    assert_one_line_error(rc, err, str(f), "truncated or corrupt")


def test_unknown_choice_is_one_line_naming_the_valid_ones(capsys):
    with pytest.raises(SystemExit) as e:
        main(["train", "--method", "int8_lora"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and len(err.strip().splitlines()) == 1, err  # not the 60 flags of the usage
    assert_one_line_error(2, err, "--method", "'int8_lora'", "nvfp4_lora_aqn", "bf16_full")


def test_quantize_a_truncated_model_names_the_file(capsys, tmp_path, tiny_llama_dir):
    bad = _corrupt_copy(tiny_llama_dir, tmp_path / "bad")
    rc, _, err = run_cli(capsys, "quantize", "--model", bad, "--format", "nvfp4", "--out", tmp_path / "q", "--no-progress")
    assert rc == 2
    assert_one_line_error(rc, err, str(bad / "model.safetensors"), "truncated or corrupt")


def test_missing_gguf_package_is_not_a_corrupt_file(capsys, tmp_path, monkeypatch):
    """Without the gguf package a good GGUF file must not be called truncated: name the package and its install."""
    import importlib.util

    monkeypatch.setenv("QERL_CACHE", str(tmp_path / "cache"))
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else real(name, *a))
    f = tmp_path / "model.gguf"
    f.write_bytes(b"GGUF" + bytes(200))
    rc, _, err = run_cli(capsys, "train", "--model", f, "--output-dir", tmp_path / "r")
    line = assert_one_line_error(rc, err, str(f), "'gguf'", "pip install 'gguf>=0.10'")
    assert rc == 2 and "corrupt" not in line and "truncated" not in line


def test_a_missing_package_names_its_install_command(capsys, monkeypatch, tmp_path):
    import qerl.train

    def needs_yaml(cfg):
        raise ModuleNotFoundError("No module named 'yaml'", name="yaml")

    monkeypatch.setattr(qerl.train, "train", needs_yaml)
    rc, _, err = run_cli(capsys, "train", "--profile", "smoke", "--output-dir", tmp_path / "r")
    assert rc == 2
    assert_one_line_error(rc, err, "'pyyaml'", "pip install pyyaml")


# ----------------------------------------------------------------------------- issue 39: every mistake one line
def _parsers():
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    return [parser, *sub.choices.values()]


def test_no_parser_takes_abbreviations():
    assert all(p.allow_abbrev is False for p in _parsers())
    # the experiment and benchmark scripts too: every ArgumentParser(...) call in the repository passes
    # allow_abbrev=False (read from the syntax tree, so a keyword after a nested call counts too)
    import ast

    calls = [(f, n) for d in ("qerl", "experiments", "benchmarks") for f in sorted((ROOT / d).rglob("*.py"))
             for n in ast.walk(ast.parse(f.read_text(), str(f))) if isinstance(n, ast.Call)
             and (n.func.attr if isinstance(n.func, ast.Attribute) else getattr(n.func, "id", None)) == "ArgumentParser"]
    assert len(calls) > 10 and any(f.parent.name == "benchmarks" for f, _ in calls)
    assert not [f"{f.relative_to(ROOT)}:{n.lineno}" for f, n in calls
                if not any(k.arg == "allow_abbrev" and isinstance(k.value, ast.Constant) and k.value.value is False
                           for k in n.keywords)]


@pytest.mark.parametrize("argv,flag,near", [
    (["train", "--max-step", "3"], "--max-step", "--max-steps"),
    (["train", "--num-generation", "4"], "--num-generation", "--num-generations"),
    (["eval", "--adapt", "x"], "--adapt", "--adapter"),
    (["export", "--adapter", "a", "--out", "b", "--merg"], "--merg", "--merge"),
    (["quantize", "--model", "m", "--form", "nvfp4", "--out", "o"], "--form", "--format"),
    (["generate", "--adapter", "a", "--prompt-col", "q"], "--prompt-col", "--prompt-column"),
])
def test_an_abbreviation_is_an_unknown_flag(capsys, argv, flag, near):
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and len(err.strip().splitlines()) == 1, err
    assert_one_line_error(2, err, f"unrecognized arguments: {flag}", f"did you mean {near}?",
                          f"(see: python -m qerl {argv[0]} --help)")


def test_the_installed_command_has_the_working_folder_on_its_path(tmp_path, monkeypatch):
    """What `qerl` (the console script) lacks and `python -m qerl` has: the folder it is run from."""
    from qerl.cli import working_dir_on_path
    from qerl.rewards import import_reward

    (tmp_path / "cwd_rewards_39.py").write_text("def f(prompts, completions, **kw):\n    return [0.0] * len(completions)\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".", str(tmp_path))])
    with pytest.raises(ValueError, match="cannot import module 'cwd_rewards_39'"):
        import_reward("cwd_rewards_39:f")
    working_dir_on_path()
    assert sys.path[-1] == str(tmp_path)
    assert import_reward("cwd_rewards_39:f")([], ["a"]) == [0.0]
    working_dir_on_path()  # once only
    assert sys.path.count(str(tmp_path)) == 1


@pytest.mark.parametrize("text,needle", [
    ("method: nvfp5\n", "unknown method 'nvfp5'"),
    ("profile: tiny\n", "unknown profile 'tiny'"),
    ("learning_rate: -1\n", "learning_rate"),
    ("method: nvfp4_lora\nlora: false\n", "full fine-tuning (lora=False) needs the bf16 base"),
    ("loss_type: ppo\n", "loss_type"),
])
def test_a_yaml_value_error_names_the_file(capsys, tmp_path, text, needle):
    cfg = tmp_path / "task.yaml"
    cfg.write_text(text)
    rc, _, err = run_cli(capsys, "train", "--config", cfg, "--output-dir", tmp_path / "r")
    line = assert_one_line_error(rc, err, needle)
    assert rc == 2 and line.startswith(f"error: {cfg}: "), line


def test_a_flag_value_error_does_not_blame_the_file(capsys, tmp_path):
    cfg = tmp_path / "task.yaml"
    cfg.write_text("learning_rate: 1.0e-5\n")
    rc, _, err = run_cli(capsys, "train", "--config", cfg, "--learning-rate", "-1", "--output-dir", tmp_path / "r")
    line = assert_one_line_error(rc, err, "learning_rate (--learning-rate) must be > 0")
    assert str(cfg) not in line


def test_an_output_dir_under_a_file_names_the_option(capsys, tmp_path):
    (tmp_path / "notes.txt").write_text("x")
    out = tmp_path / "notes.txt" / "run"
    rc, _, err = run_cli(capsys, "train", "--profile", "smoke", "--output-dir", out)
    line = assert_one_line_error(rc, err, f"--output-dir {out}:", "is a file, not a folder")
    assert rc == 2 and "Errno" not in line
    cfg = tmp_path / "task.yaml"  # set in a config file: the same option named
    cfg.write_text(f"output_dir: {out}\n")
    rc, _, err = run_cli(capsys, "train", "--config", cfg)
    assert_one_line_error(rc, err, f"--output-dir {out}:", "is a file")
    rc, _, err = run_cli(capsys, "eval", "--out", tmp_path / "notes.txt" / "eval.json", "--limit", "1")
    assert_one_line_error(rc, err, f"--out {tmp_path / 'notes.txt' / 'eval.json'}:", "is a file")


def test_a_read_only_output_dir_names_the_option(capsys, tmp_path, monkeypatch):
    ro = tmp_path / "ro"
    ro.mkdir()
    real = os.access
    monkeypatch.setattr(os, "access", lambda p, mode, *a, **k: False if Path(p) == ro else real(p, mode, *a, **k))
    rc, _, err = run_cli(capsys, "train", "--profile", "smoke", "--output-dir", ro / "run")
    assert_one_line_error(rc, err, f"--output-dir {ro / 'run'}:", f"cannot write in {ro}", "read-only file system")


def test_an_os_error_later_names_the_option_it_comes_from(capsys, tmp_path, monkeypatch):
    """An OSError the early checks could not foresee (the disk turned read-only mid-run): the option whose
    path it is, then the error as the OS says it."""
    import errno

    import qerl.train

    out = tmp_path / "r"

    def read_only(cfg):
        raise OSError(errno.EROFS, "Read-only file system", str(out / "checkpoints" / "step-2"))

    monkeypatch.setattr(qerl.train, "train", read_only)
    rc, _, err = run_cli(capsys, "train", "--profile", "smoke", "--output-dir", out)
    line = assert_one_line_error(rc, err, f"--output-dir {out}: [Errno 30] Read-only file system")
    assert rc == 2 and line.count("--output-dir") == 1


def test_eval_of_a_truncated_checkpoint_points_at_adapter(capsys, tmp_path, tiny_llama_dir):
    from qerl.config import make_config
    from qerl.train import train

    train(make_config("smoke", model=str(tiny_llama_dir), method="bf16_lora", output_dir=str(tmp_path / "run"),
                      eval_datasets=(), max_steps=1, max_completion_length=4, max_prompt_length=512,
                      wandb_mode="disabled"))
    f = tmp_path / "run" / "checkpoints" / "step-1" / "trainable.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 3])
    rc, _, err = run_cli(capsys, "eval", "--adapter", f.parent, "--limit", "1", "--engine", "hf")
    line = assert_one_line_error(rc, err, str(f), "truncated or corrupt", f"(--adapter {f.parent.parent}/step-N)")
    assert "--resume-from" not in line


def test_a_bad_evaluation_file_fails_before_the_model_loads(capsys, tmp_path):
    bad = tmp_path / "held_out.jsonl"
    bad.write_text('{"question_text": "w1 w2", "vowel_count": 2}\n')
    rc, _, err = run_cli(capsys, "train", "--profile", "smoke", "--model", tmp_path / "no-such-model",
                         "--eval-datasets", bad, "--prompt-column", "question_text", "--output-dir", tmp_path / "r")
    assert_one_line_error(rc, err, f"{bad}:1", "no 'answer' field", "--answer-column")


# ---------------------------------------------------------------------------------------------
# Mistakes caught before the model loads: one `error:` line, exit 2, within seconds, no run folder left behind


def _run_folder_stub(path: Path) -> Path:
    (path / "checkpoints").mkdir(parents=True)
    (path / "config.json").write_text("{}")
    return path


# (name, train flags; "{tmp}" is the test's folder, "{run}" its --output-dir), the error's words
EARLY = [
    ("output-dir-proc", ["--output-dir", "/proc/qerl-x"], ["--output-dir /proc/qerl-x", "cannot write"]),
    ("resume-missing", ["--resume-from", "{tmp}/no-such"], ["--resume-from", "no such checkpoint"]),
    ("resume-a-file", ["--resume-from", "{tmp}/rows.jsonl"], ["--resume-from", "a file, not a checkpoint"]),
    ("resume-a-run-folder", ["--resume-from", "{tmp}/old-run"], ["a run folder, not a checkpoint", "--resume-from auto"]),
    ("backend-triton-on-cpu", ["--method", "nvfp4_lora", "--backend", "triton"], ["--backend triton", "cannot run"]),
    ("overwrite-and-resume", ["--overwrite", "--resume-from", "auto"], ["overwrite", "resume_from=auto", "contradict"]),
    ("report-to-none-wandb-online", ["--report-to", "none", "--wandb-mode", "online"],
     ["--report-to none", "--wandb-mode online", "contradict"]),
]


@pytest.mark.parametrize("flags,words", [pytest.param(f, w, id=n) for n, f, w in EARLY])
def test_mistakes_are_caught_before_the_model_loads(capsys, tmp_path, monkeypatch, flags, words):
    import qerl.models

    if "triton" in flags:
        if torch_cuda():
            pytest.skip("triton runs on this machine")
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the kernel tests' interpreter: a user's CPU has none

    def no_model(*a, **k):
        raise AssertionError("the model was loaded before the mistake was found")

    monkeypatch.setattr(qerl.models, "load_model", no_model)
    (tmp_path / "rows.jsonl").write_text('{"prompt": "w1", "answer": "w2"}\n')
    _run_folder_stub(tmp_path / "old-run")
    run = tmp_path / "run"
    argv = [a.format(tmp=tmp_path) for a in flags]
    argv += [] if "--output-dir" in argv else ["--output-dir", str(run)]
    t0 = time.perf_counter()
    rc, _, err = run_cli(capsys, "train", "--profile", "smoke", "--wandb-mode", "disabled", *argv)
    assert time.perf_counter() - t0 < 20
    assert rc == 2
    assert_one_line_error(rc, err, *words)
    assert not run.exists() and not Path("/proc/qerl-x").exists()  # no run folder left behind


def torch_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


@pytest.mark.parametrize("what", ["--model", "--dataset"])
def test_an_unreachable_hub_fails_fast(tmp_path, what):
    """A hub id without network: one error line in seconds, not a minute of retries (the hub's host is a
    closed local port here, and HF_HUB_OFFLINE is not set)."""
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE",
                                                            "HF_DATASETS_OFFLINE") and "PROXY" not in k.upper()}
    env.update(HF_ENDPOINT="http://127.0.0.1:9", HF_HOME=str(tmp_path / "hf"), WANDB_MODE="disabled",
               PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]))
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "qerl", "train", "--profile", "smoke", what, "nobody/no-such-id",
                        "--output-dir", str(tmp_path / "run")], env=env, capture_output=True, text=True,
                       timeout=120, cwd=tmp_path)
    assert time.perf_counter() - t0 < 30
    assert r.returncode == 2, r.stderr[-2000:]
    assert_one_line_error(r.returncode, r.stderr, "nobody/no-such-id")
    assert "Retry" not in r.stderr and "offline mode" in r.stderr
    assert not (tmp_path / "run").exists()


def test_more_prompts_a_step_than_the_data_holds_is_a_warning(capsys, tmp_path, monkeypatch):
    import qerl.models

    class Stop(Exception):
        pass

    def stop(*a, **k):
        raise Stop

    monkeypatch.setattr(qerl.models, "load_model", stop)
    rows = tmp_path / "six.jsonl"
    rows.write_text("".join(f'{{"prompt": "w{i}", "answer": "w{i}"}}\n' for i in range(6)))
    rc, out, err = run_cli(capsys, "train", "--profile", "smoke", "--dataset", rows, "--prompts-per-step", "100",
                           "--wandb-mode", "disabled", "--output-dir", tmp_path / "run")
    assert "warning: prompts_per_step=100" in out + err and "has 6 prompts" in out + err
    assert not (tmp_path / "run").exists()
