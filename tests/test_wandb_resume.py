"""A resumed run's W&B history has every step: what metrics.jsonl holds and the stopped run's W&B files lack
(a kill -9 loses the steps W&B had not written yet) is logged again into the resumed segment.

Run: python -m pytest tests/test_wandb_resume.py -q      (tiny random model, CPU, ~1 minute)
"""

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from qerl.logging import read_metrics, read_wandb_history, read_wandb_offline

ROOT = Path(__file__).resolve().parent.parent


def _train_rows(out: Path) -> dict[int, float]:
    return {r["step"]: r["reward"] for r in read_metrics(out) if r.get("reward") is not None}


def _wandb_rows(out: Path) -> dict[int, float]:
    read_wandb_offline(out)  # waits until the newest segment's file is complete
    return {h["_step"]: h["train/reward"] for h in read_wandb_history(out) if "train/reward" in h}


def test_steps_the_wandb_files_lack_are_logged_again(tmp_path, tiny_llama_dir, monkeypatch, capsys):
    from qerl.config import make_config
    from qerl.train import train

    monkeypatch.delenv("WANDB_DIR", raising=False)
    out = tmp_path / "run"
    cfg = dict(model=str(tiny_llama_dir), method="bf16_lora", output_dir=str(out), eval_datasets=(), max_steps=3,
               save_every=1, max_completion_length=4, max_prompt_length=512, wandb_mode="offline")
    train(make_config("smoke", **cfg), stop_after=2)
    segments = list((out / "wandb").glob("offline-run-*"))
    assert len(segments) == 1
    shutil.rmtree(segments[0])  # what the stopped process's W&B had not written: here, all of it
    capsys.readouterr()
    train(make_config("smoke", **cfg, resume_from="auto"))
    said = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("[qerl] W&B:")]
    assert said == ["[qerl] W&B: steps 1-2 were in metrics.jsonl but not in the W&B files of the stopped run; "
                    "logged them again"]
    assert _wandb_rows(out) == _train_rows(out) and sorted(_train_rows(out)) == [1, 2, 3]


def test_kill_9_then_resume_leaves_no_gap_in_wandb(tmp_path, tiny_llama_dir):
    """The issue's case: kill -9 after the third checkpoint, resume: W&B holds steps 1..5, as metrics.jsonl."""
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "qerl", "train", "--profile", "smoke", "--model", str(tiny_llama_dir), "--method",
           "bf16_lora", "--save-every", "1", "--wandb-mode", "offline", "--max-prompt-length", "512",
           "--max-completion-length", "4", "--eval-datasets", "none", "--output-dir", str(out)]
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}, "PYTHONPATH": str(ROOT),
           "OMP_NUM_THREADS": "1"}
    p = subprocess.Popen([*cmd, "--max-steps", "100000"], cwd=tmp_path, env=env, stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 240
        while not (out / "checkpoints" / "step-3" / "manifest.json").exists():
            assert p.poll() is None, p.communicate()[1][-2000:]
            assert time.time() < deadline, "no third checkpoint within 240 s"
            time.sleep(0.1)
        p.send_signal(signal.SIGKILL)
        p.wait(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
    r = subprocess.run([*cmd, "--max-steps", "5", "--resume-from", "auto"], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = _train_rows(out)
    assert sorted(rows) == [1, 2, 3, 4, 5]
    assert _wandb_rows(out) == rows
