"""The experiments' one launcher (experiments/launch.py) with stand-in commands: runs spread over
GPUs with several per GPU, resume by run-folder completeness, time budget and stop, run.json.

Run: python -m pytest tests/test_launch.py -q   (about 10 s)
"""

import json
import sys

import pytest

from experiments import launch as L

# a stand-in run: records its GPU and wall interval, sleeps, then finishes (exit 0, summary ok) unless told
RUN = """
import json, os, sys, time
from pathlib import Path
out, sleep, code = Path(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3])
t0 = time.time()
time.sleep(sleep)
(out / "interval.json").write_text(json.dumps([os.environ.get("CUDA_VISIBLE_DEVICES"), t0, time.time()]))
if code == 0:
    (out / "summary.json").write_text(json.dumps({"status": "ok"}))
sys.exit(code)
"""


@pytest.fixture
def script(tmp_path, monkeypatch):
    monkeypatch.setattr(L, "POLL_S", 0.05)
    f = tmp_path / "run.py"
    f.write_text(RUN)
    return f


def _tasks(script, root, n, sleep=0.6, code=0):
    return [L.Task(f"r{i}", [sys.executable, str(script), str(root / f"r{i}"), str(sleep), str(code)], root / f"r{i}")
            for i in range(n)]


def test_runs_spread_over_gpus_with_several_per_gpu(script, tmp_path):
    tasks = _tasks(script, tmp_path / "runs", 6)
    codes = L.run_tasks(tasks, gpus=["0", "1"], per_gpu=2, git={"git_sha": "a" * 40, "git_dirty": False})
    assert codes == {f"r{i}": 0 for i in range(6)}
    spans = [json.loads((t.folder / "interval.json").read_text()) for t in tasks]
    assert {g for g, _, _ in spans} == {"0", "1"}
    for gpu in ("0", "1"):  # never more than per_gpu runs on one GPU at once
        mine = [(a, b) for g, a, b in spans if g == gpu]
        assert max(sum(1 for a, b in mine if a <= t < b) for t, _ in mine) <= 2
    assert max(sum(1 for _, a, b in spans if a <= t < b) for _, t, _ in spans) >= 3  # runs overlapped
    rec = json.loads((tasks[0].folder / "run.json").read_text())
    assert rec["exit_code"] == 0 and rec["gpu"] in ("0", "1") and rec["git_sha"] == "a" * 40 and rec["wall_s"] > 0
    assert str(script) in rec["command"] and rec["started"]


def test_a_second_call_resumes_where_the_first_stopped(script, tmp_path):
    tasks = _tasks(script, tmp_path / "runs", 3, sleep=0.05)
    assert L.run_tasks(tasks[:2], parallel=2) == {"r0": 0, "r1": 0}
    (tasks[1].folder / "summary.json").write_text(json.dumps({"status": "partial"}))  # cut off: not complete
    assert [t.name for t in L.resumable(tasks)] == ["r1", "r2"]
    assert L.run_tasks(tasks, parallel=2) == {"r1": 0, "r2": 0}
    assert L.run_tasks(tasks, parallel=2) == {}


def test_failed_runs_are_recorded_and_not_complete(script, tmp_path, capsys):
    tasks = _tasks(script, tmp_path / "runs", 1, sleep=0.0, code=3)
    assert L.run_tasks(tasks) == {"r0": 3}
    assert json.loads((tasks[0].folder / "run.json").read_text())["exit_code"] == 3
    assert not L.run_complete(tasks[0].folder) and "FAILED (exit 3" in capsys.readouterr().out


def test_time_budget_and_stop_at(script, tmp_path):
    long = _tasks(script, tmp_path / "a", 3, sleep=30)
    codes = L.run_tasks(long, parallel=1, time_budget=0.01, stop_at=0.5)
    assert list(codes) == ["r0"] and codes["r0"] != 0  # one started, stopped; the others never started
    assert not (long[1].folder / "log.txt").exists() and L.resumable(long) == long


def test_bad_launch_flags_are_refused():
    import argparse

    ap = argparse.ArgumentParser()
    L.add_launch_args(ap)
    for argv, msg in ((["--parallel", "0"], "--parallel must be >= 1"), (["--per-gpu", "2"], "needs --gpus"),
                      (["--gpus", "0", "--per-gpu", "0"], "--per-gpu must be >= 1")):
        with pytest.raises(ValueError, match=msg):
            L.launch_kwargs(ap.parse_args(argv))
    assert L.concurrency(**L.launch_kwargs(ap.parse_args(["--gpus", "0", "1", "2", "--per-gpu", "4"]))) == 12


def test_pinned_tasks_run_on_their_gpu_and_let_others_pass(script, tmp_path):
    """A task pinned to a full GPU waits there; the next task that can start goes first."""
    tasks = _tasks(script, tmp_path / "runs", 4, sleep=0.4)
    for t in tasks[:3]:
        t.gpu = "1"
    codes = L.run_tasks(tasks, gpus=["0", "1"], per_gpu=1)
    assert codes == {f"r{i}": 0 for i in range(4)}
    spans = {t.name: json.loads((t.folder / "interval.json").read_text()) for t in tasks}
    assert [spans[f"r{i}"][0] for i in range(4)] == ["1", "1", "1", "0"]
    pinned = sorted((a, b) for g, a, b in spans.values() if g == "1")
    assert all(b1 <= a2 for (_, b1), (a2, _) in zip(pinned, pinned[1:]))  # one at a time on GPU 1
    assert spans["r3"][1] < spans["r1"][1]  # r3 (GPU 0) did not wait behind r1, pinned to the busy GPU 1
    tasks[0].gpu = "7"
    with pytest.raises(ValueError, match="pinned to GPUs 7"):
        L.run_tasks(tasks, gpus=["0", "1"], per_gpu=1)
