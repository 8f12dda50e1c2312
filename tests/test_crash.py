"""Nothing lost: a run interrupted anywhere (SIGINT, SIGKILL, a full disk; between steps, mid-save,
mid-row, before the final evaluation) and resumed with --resume-from auto ends with the same
metrics.jsonl, summary.json, final weights and final line as the same run never interrupted
(bitwise, on the CPU). Plus the checkpoint folder itself: manifests, incomplete ones skipped,
--save-total-limit, the free-space check.

Each interrupted run is a fork of the test process running the CLI's main (so the test's patches,
which make the interruption land at an exact point, are in it), with its own SIGINT disposition
(a background job inherits an ignored SIGINT). The resume runs in the test process.

Run: python -m pytest tests/test_crash.py -q      (~1-2 min on 2 cores)
"""

import contextlib
import errno
import importlib.util
import io
import json
import os
import shutil
import signal
import sys
import time
import warnings
import zlib
from pathlib import Path

import pytest
import torch

from qerl import checkpoint as qckpt
from qerl import evaluate as qeval
from qerl import rewards as qrewards
from qerl.cli import main
from qerl.logging import RunLogger, read_metrics

# tests/conftest.py's builders (a plain `import conftest` can pick up tests/kernels/conftest.py)
_spec = importlib.util.spec_from_file_location("_qerl_tests_conftest", Path(__file__).with_name("conftest.py"))
_conftest = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_conftest)

STEPS = 3
VOLATILE = ("time/", "throughput/", "step_time", "memory/", "perf/")  # wall-clock and RSS: differ between any two runs


def _fake_rewards(completions, golds, **kw):
    """A hash of the text: a random tiny model never solves arithmetic, and the update must move."""
    r = [float(zlib.crc32(c.encode()) % 2) for c in completions]
    return qrewards.RewardResult(rewards=r, format=[0.0] * len(r), unparsed=0, sources=["none"] * len(r))


def argv(model_dir, out, *extra):
    """A 3-step run of a tiny model on a tiny GSM8K-format set, a checkpoint every step, evaluated before and after."""
    data = Path(model_dir).parent / "data"
    return ["train", "--profile", "smoke", "--model", str(model_dir), "--method", "nvfp4_lora_aqn",
            "--dataset", "gsm8k", "--data-dir", str(data),
            "--max-steps", str(STEPS), "--save-every", "1", "--max-completion-length", "6", "--prompts-per-step", "2",
            "--num-generations", "2", "--micro-batch-size", "4", "--lora-rank", "4", "--lora-alpha", "8",
            "--num-stages", "3", "--sigma-start", "0.05", "--sigma-end", "0.01", "--max-prompt-length", "512",
            "--wandb-mode", "disabled", "--eval-datasets", "gsm8k", "--eval-limit", "2",
            "--eval-max-completion-length", "4", "--output-dir", str(out), *extra]


def run_main(args) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main([str(a) for a in args])
    return rc, out.getvalue(), err.getvalue()


def run_forked(args, patch) -> int:
    """main(args) in a forked child after ``patch()``; returns its wait status."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "fork() of a multi-threaded process": the child only computes and exits
        pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 99
        try:
            torch.set_num_threads(1)  # the parent's OpenMP threads do not exist here
            signal.signal(signal.SIGINT, signal.default_int_handler)  # whatever the parent's disposition
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, 1)
            os.dup2(devnull, 2)
            sys.stdout, sys.stderr = open(1, "w", closefd=False), open(2, "w", closefd=False)  # noqa: SIM115
            patch()
            code = main([str(a) for a in args])
        finally:
            os._exit(code)
    deadline = time.monotonic() + 300
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return status
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            raise AssertionError("the interrupted run did not end within 300 s")
        time.sleep(0.05)


def final_state(out: Path, done_line: str | None = None) -> dict:
    rows = [{k: v for k, v in r.items() if not k.startswith(VOLATILE)} for r in read_metrics(out)]
    manifest = json.loads((out / "checkpoints" / f"step-{STEPS}" / qckpt.MANIFEST).read_text())
    summary = {k: v for k, v in json.loads((out / "summary.json").read_text()).items() if not k.startswith(VOLATILE)}
    return {"rows": rows, "summary": summary,
            "weights": manifest["files"]["trainable.safetensors"]["sha256"],
            "optimizer": manifest["files"]["state.pt"]["bytes"],
            "checkpoints": sorted(p.name for p in (out / "checkpoints").iterdir()),
            "done": done_line.replace(str(out), "<run>") if done_line else None}


def done_line(stdout: str) -> str:
    return next(ln for ln in stdout.splitlines() if ln.startswith("done:"))


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """The tiny model's folder, and beside it data/gsm8k/{train,test}.jsonl (8 and 2 problems). One
    intra-op thread for the module: a forked child cannot use the parent's OpenMP threads, and the
    interrupted, resumed and reference runs must round alike to be compared bitwise."""
    root = tmp_path_factory.mktemp("crash")
    _conftest.make_tiny_model("llama").save_pretrained(root / "model")
    _conftest.make_tiny_tokenizer().save_pretrained(root / "model")
    (root / "data" / "gsm8k").mkdir(parents=True)
    rows = [json.dumps({"question": f"What is {a} + {a + 1}?", "answer": f"{a} + {a + 1} = {2 * a + 1}\n#### {2 * a + 1}"})
            for a in range(10)]
    (root / "data" / "gsm8k" / "train.jsonl").write_text("\n".join(rows[:8]) + "\n")
    (root / "data" / "gsm8k" / "test.jsonl").write_text("\n".join(rows[8:]) + "\n")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield root / "model"
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def fake_rewards():
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(qrewards, "score_batch", _fake_rewards)
        yield


@pytest.fixture(scope="module")
def reference(tiny_dir, fake_rewards, tmp_path_factory):
    out = tmp_path_factory.mktemp("reference") / "run"
    rc, stdout, err = run_main(argv(tiny_dir, out))
    assert rc == 0, err[-3000:]
    state = final_state(out, done_line(stdout))
    assert [r["step"] for r in state["rows"]] == [0, 1, 2, 3, 3]  # eval before, 3 steps, eval after
    assert "eval_before/gsm8k/accuracy" in state["summary"] and state["summary"]["status"] == "ok"
    return state


# ---------------------------------------------------------------------------------- interruption points
def _on_log(at: int, action):
    """Patch RunLogger.log: after the training row of step ``at`` is written, ``action()``."""
    real = RunLogger.log

    def log(self, metrics, step):
        real(self, metrics, step)
        if step == at and not any(k.startswith("eval/") for k in metrics):
            action()

    RunLogger.log = log


def _kill(sig):
    return lambda: os.kill(os.getpid(), sig)


def sigint_between_steps():  # step 2 logged, its checkpoint not yet written
    _on_log(2, _kill(signal.SIGINT))


def _mid_state_write(step: int, action):
    """Patch torch_save: the state.pt of checkpoint ``step`` is half written when ``action()`` runs."""
    real = qckpt.torch_save

    def save(obj, path):
        real(obj, path)
        if obj.get("step") == step:
            path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
            action()

    qckpt.torch_save = save


def sigkill_mid_save():
    _mid_state_write(2, _kill(signal.SIGKILL))


def sigint_mid_save():
    _mid_state_write(2, _kill(signal.SIGINT))


def sigkill_before_rename():  # manifest written and fsynced, the folder not yet renamed
    real = qckpt._fsync_path

    def fsync(path):
        real(path)
        if Path(path).name == f".step-{STEPS}.partial":
            os.kill(os.getpid(), signal.SIGKILL)

    qckpt._fsync_path = fsync


def sigkill_mid_row_before_final_eval():  # the final checkpoint complete; the final evaluation's row half written
    real = qeval.evaluate_datasets
    calls = []

    def ev(*a, **k):
        calls.append(1)
        res = real(*a, **k)
        if len(calls) == 2:
            with open(Path(qckpt_out[0]) / "metrics.jsonl", "a") as f:
                f.write('{"step": 3, "eval/gsm8k/acc')
            os.kill(os.getpid(), signal.SIGKILL)
        return res

    qeval.evaluate_datasets = ev


def disk_full_mid_save():  # ENOSPC half-way through state.pt of step 2: the save fails, the run stops (exit 2)
    real_write = qckpt.RecordingFile.write

    def write(self, b):
        if self.f.name.endswith("state.pt") and ".step-2." in self.f.name and self.f.tell() > 2000:
            self.error = OSError(errno.ENOSPC, "No space left on device")
            raise self.error
        return real_write(self, b)

    qckpt.RecordingFile.write = write


qckpt_out: list = []  # the run folder, for patches that write into it

SCENARIOS = {
    # name: (patch, expected wait status of the interrupted run)
    "sigint_between_steps": (sigint_between_steps, 130 << 8),
    "sigkill_mid_save": (sigkill_mid_save, signal.SIGKILL),
    "sigint_mid_save": (sigint_mid_save, 130 << 8),
    "sigkill_before_rename": (sigkill_before_rename, signal.SIGKILL),
    "sigkill_mid_row_before_final_eval": (sigkill_mid_row_before_final_eval, signal.SIGKILL),
    "disk_full_mid_save": (disk_full_mid_save, 2 << 8),
}


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_interrupted_and_resumed_equals_uninterrupted(tmp_path, tiny_dir, reference, scenario):
    out = tmp_path / "run"
    qckpt_out[:] = [out]
    patch, expected = SCENARIOS[scenario]
    status = run_forked(argv(tiny_dir, out), patch)
    assert status == expected, f"interrupted run: wait status {status}, expected {expected}"
    assert not (out / "summary.json").is_file() or json.loads((out / "summary.json").read_text())["status"] != "ok"
    before = {p.name: qckpt.is_complete(p) for p in qckpt.all_checkpoints(out / "checkpoints")}
    assert before and all(before.values()), before  # only complete step-N folders (partial saves are hidden)
    rc, stdout, err = run_main(argv(tiny_dir, out, "--resume-from", "auto"))
    assert rc == 0, err[-3000:]
    got = final_state(out, done_line(stdout))
    assert got == reference, _differences(got, reference)
    assert not qckpt.partial_saves(out / "checkpoints")


def _differences(got: dict, ref: dict) -> str:
    """Where a resumed run's outcome differs from the uninterrupted one: the keys, row by row."""
    out = [f"{k}: {got[k]!r} != {ref[k]!r}" for k in ref if k not in ("rows", "summary") and got.get(k) != ref[k]]
    for i, (a, b) in enumerate(zip(got["rows"], ref["rows"])):
        out += [f"row {i} {k}: {a.get(k)!r} != {b.get(k)!r}" for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
    if len(got["rows"]) != len(ref["rows"]):
        out.append(f"{len(got['rows'])} rows != {len(ref['rows'])}")
    s, r = got["summary"], ref["summary"]
    out += [f"summary {k}: {s.get(k)!r} != {r.get(k)!r}" for k in sorted(set(s) | set(r)) if s.get(k) != r.get(k)]
    return "; ".join(out[:20])


# ---------------------------------------------------------------------------------- the checkpoint folder
def test_resume_auto_skips_incomplete_checkpoints(tmp_path, tiny_dir, fake_rewards, capsys):
    out = tmp_path / "run"
    rc, _, err = run_main(argv(tiny_dir, out, "--max-steps", "2", "--eval-datasets", "none"))
    assert rc == 0, err[-3000:]
    cks = out / "checkpoints"
    m = json.loads((cks / "step-2" / qckpt.MANIFEST).read_text())
    assert set(m["files"]) >= {"trainable.safetensors", "state.pt", "config.json", "resume.json",
                               "adapter/adapter_model.safetensors"}
    assert all(len(f["sha256"]) == 64 and f["bytes"] > 0 for f in m["files"].values())
    # what an older writer or a foreign copy leaves: step-3 without a manifest (state.pt empty), a partial save
    shutil.copytree(cks / "step-2", cks / "step-3")
    (cks / "step-3" / qckpt.MANIFEST).unlink()
    (cks / "step-3" / "state.pt").write_bytes(b"")
    shutil.copytree(cks / "step-2", cks / ".step-4.partial")
    assert qckpt.latest_complete(cks) == (cks / "step-2", [cks / "step-3", cks / ".step-4.partial"])
    rc, stdout, err = run_main(argv(tiny_dir, out, "--max-steps", "4", "--eval-datasets", "none", "--resume-from", "auto",
                                    "--save-total-limit", "2"))
    assert rc == 0, err[-3000:]
    assert f"skipped incomplete checkpoints (saves cut off before their manifest): {cks / 'step-3'}, " \
           f"{cks / '.step-4.partial'}" in stdout
    assert f"resumed from {cks / 'step-2'} at step 2" in stdout
    assert [r["step"] for r in read_metrics(out)] == [1, 2, 3, 4]
    assert sorted(p.name for p in cks.iterdir()) == ["step-3", "step-4"]  # --save-total-limit 2
    assert all(qckpt.is_complete(p) for p in cks.iterdir())


def test_save_total_limit_never_deletes_the_last_complete(tmp_path):
    cks = tmp_path / "checkpoints"
    for s in (1, 2, 3):
        qckpt.write(cks / f"step-{s}", {"x.bin": lambda f, s=s: f.write_bytes(bytes([s]) * 10)}, meta={"step": s})
    (cks / "step-4").mkdir()  # incomplete, newer than every complete one: kept (resume skips it, a save replaces it)
    assert qckpt.prune(cks, 1) == [cks / "step-1", cks / "step-2"]
    assert sorted(p.name for p in cks.iterdir()) == ["step-3", "step-4"]
    assert qckpt.prune(cks, 1) == [] and qckpt.is_complete(cks / "step-3")


def test_free_space_is_checked_before_writing(tmp_path, monkeypatch):
    cks = tmp_path / "checkpoints"
    qckpt.write(cks / "step-1", {"x.bin": lambda f: f.write_bytes(b"a" * 5000)})
    monkeypatch.setattr(qckpt.shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10**9, 10**9 - 1000, 1000))
    wrote = []
    with pytest.raises(qckpt.CheckpointSpaceError) as e:
        qckpt.write(cks / "step-2", {"x.bin": lambda f: wrote.append(f)}, estimate_bytes=8000)
    msg = str(e.value)
    assert f"checkpoint {cks / 'step-2'}" in msg and f"{8000 + (1 << 20)} bytes needed, 1000 bytes free" in msg
    assert f"{cks / 'step-1'} is intact" in msg and not wrote
    assert sorted(p.name for p in cks.iterdir()) == ["step-1"]


def test_disk_full_is_one_error_line_and_keeps_the_last_checkpoint(tmp_path, tiny_dir, fake_rewards, monkeypatch):
    out = tmp_path / "run"
    real = qckpt.shutil.disk_usage
    free = {"bytes": None}
    monkeypatch.setattr(qckpt.shutil, "disk_usage",
                        lambda p: real(p) if free["bytes"] is None else shutil._ntuple_diskusage(10**12, 0, free["bytes"]))
    real_save = qckpt.write

    def write(path, *a, **k):  # the disk fills up after step 1's checkpoint
        if path.name == "step-2":
            free["bytes"] = 4096
        return real_save(path, *a, **k)

    monkeypatch.setattr(qckpt, "write", write)
    rc, _, err = run_main(argv(tiny_dir, out, "--eval-datasets", "none"))
    lines = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert rc == 2 and len(lines) == 1 and "Traceback" not in err, err[-2000:]
    assert f"checkpoint {out / 'checkpoints' / 'step-2'}" in lines[0] and "bytes needed, 4096 bytes free" in lines[0]
    assert f"{out / 'checkpoints' / 'step-1'} is intact" in lines[0]
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step-1"]
    qckpt.verify(out / "checkpoints" / "step-1")  # every file matches its manifest
