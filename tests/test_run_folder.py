"""A run folder is never silently replaced: refused unless --overwrite, continued with --resume-from;
a resumed run continues its W&B run and keeps every summary key; reward.png and the final report line."""

import importlib.util
import json
from pathlib import Path

import pytest

from qerl.logging import read_wandb_offline, run_report
from qerl.train import train

_spec = importlib.util.spec_from_file_location("_qerl_test_train", Path(__file__).with_name("test_train.py"))
_tt = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_tt)
tiny_cfg, text_rewards = _tt.tiny_cfg, _tt.text_rewards  # noqa: F811 - text_rewards is a fixture
make_tiny_model, make_tiny_tokenizer = _tt.make_tiny_model, _tt.make_tiny_tokenizer


def test_finished_run_is_refused_unless_overwrite(tmp_path, text_rewards):
    out = tmp_path / "run"
    train(tiny_cfg(out, wandb_mode="disabled"), model=make_tiny_model("llama"), tokenizer=make_tiny_tokenizer())
    before = (out / "metrics.jsonl").read_text()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="finished run.*--overwrite.*--resume-from auto"):
        train(tiny_cfg(out, wandb_mode="disabled"), model=make_tiny_model("llama"), tokenizer=make_tiny_tokenizer())
    assert (out / "metrics.jsonl").read_text() == before  # untouched
    train(tiny_cfg(out, wandb_mode="disabled", overwrite=True, max_steps=2), model=make_tiny_model("llama"),
          tokenizer=make_tiny_tokenizer())
    assert [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-1", "step-2"]  # the old step-3 is gone
    assert (out / "notes.txt").read_text() == "mine"  # files that are not the run's stay


def test_resume_continues_wandb_run_and_keeps_summary(tmp_path, text_rewards):
    out = tmp_path / "cut"
    tok = make_tiny_tokenizer()
    train(tiny_cfg(out), model=make_tiny_model("llama"), tokenizer=tok, stop_after=2)
    s1 = json.loads((out / "summary.json").read_text())
    s1_extra = {**s1, "eval_before/arith/accuracy": 0.25}  # as a run with evaluation would have recorded
    (out / "summary.json").write_text(json.dumps(s1_extra))
    run_id = (out / "wandb_run_id").read_text().strip()
    assert read_wandb_offline(out)["run_id"] == run_id
    train(tiny_cfg(out, resume_from="auto"), model=make_tiny_model("llama"), tokenizer=tok)
    s2 = json.loads((out / "summary.json").read_text())
    assert s2["status"] == "ok" and s2["steps"] == 3
    assert s2["eval_before/arith/accuracy"] == 0.25, "resume dropped a key of the first part's summary"
    assert set(s1) <= set(s2)
    assert (out / "wandb_run_id").read_text().strip() == run_id
    assert read_wandb_offline(out)["run_id"] == run_id  # the resumed part logged into the same W&B run
    assert (out / "reward.png").stat().st_size > 1000
    line = run_report(out)
    assert "reward" in line and "step 1 -> 3" in line and "reward.png" in line


def test_resuming_a_finished_run_does_nothing(tmp_path, text_rewards):
    out = tmp_path / "done"
    first = train(tiny_cfg(out), model=make_tiny_model("llama"), tokenizer=make_tiny_tokenizer())
    metrics = (out / "metrics.jsonl").read_text()
    again = train(tiny_cfg(out, resume_from="auto"), model=make_tiny_model("llama"), tokenizer=make_tiny_tokenizer())
    assert again["status"] == "ok" and again["steps"] == first["steps"] == 3
    assert (out / "metrics.jsonl").read_text() == metrics  # no duplicate rows, no second evaluation


@pytest.mark.parametrize("wandb_mode", ["disabled", "offline"])
def test_a_run_that_fails_before_its_first_step_leaves_nothing_behind(tmp_path, monkeypatch, wandb_mode):
    """An error in the first step (after the run files were started): the run files go, so the corrected
    command runs without --overwrite; a folder that existed keeps its other files."""
    import qerl.step

    def broken(*a, **k):
        raise RuntimeError("broken first step")

    monkeypatch.setattr(qerl.step, "step", broken)
    new, old = tmp_path / "new" / "run", tmp_path / "old"
    old.mkdir()
    (old / "notes.txt").write_text("mine")
    for out in (new, old):
        with pytest.raises(RuntimeError, match="broken first step"):
            train(tiny_cfg(out, wandb_mode=wandb_mode), model=make_tiny_model("llama"), tokenizer=make_tiny_tokenizer())
    assert not new.exists() and (tmp_path / "new").is_dir()  # what it made, not the folder above
    assert sorted(p.name for p in old.iterdir()) == ["notes.txt"]


@pytest.mark.parametrize("n,window", [(2, None), (3, None), (4, 2), (12, 3)])
def test_the_report_compares_windows_that_do_not_overlap(tmp_path, n, window):
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "reward": s / 10}) + "\n"
                                                    for s in range(1, n + 1)))
    line = run_report(tmp_path)
    assert f"(step 1 -> {n}" in line
    assert ("mean of the first" in line) == (window is not None)
    if window:
        assert f"first {window} steps" in line and f"last {window} " in line
