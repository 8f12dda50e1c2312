"""Run logging: config.json, metrics.jsonl, summary.json, and Weights & Biases (offline by default).

No code elsewhere branches on whether W&B is on: with wandb_mode="disabled" (or wandb not
installed) a DummyWandb takes the calls. Nothing here needs a W&B account; an offline run lives in
<output_dir>/wandb (or $WANDB_DIR) and can be synced later with `wandb sync <output_dir>/wandb/offline-run-*`.

W&B settings come from the config's wandb_* fields, else W&B's own environment variables
(WANDB_MODE, WANDB_PROJECT, WANDB_ENTITY, WANDB_RUN_GROUP, WANDB_TAGS, WANDB_DIR), else qerl's
defaults (offline, project "qerl"); see ``wandb_settings``.

Metric names: metrics.jsonl keeps qerl's keys (``reward``, ``entropy``, ``sampling/logprob_gap``,
...), which the experiments, plots and notebooks read. W&B gets the names TRL's GRPOTrainer logs,
under the ``train/`` prefix the HF Trainer gives training metrics (``train/reward``,
``train/rewards/<fn>/mean``, ``train/sampling/sampling_logp_difference/mean``, ...: ``wandb_key``);
evaluations stay under ``eval/``.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
import platform
import secrets
import subprocess
import time
from pathlib import Path

import torch

from qerl.config import env


def git_info() -> dict:
    """The git sha and dirty flag of the qerl checkout (None outside a checkout)."""
    if env("QERL_GIT_SHA"):  # a copy of the tree without .git (e.g. a remote GPU box)
        return {"git_sha": env("QERL_GIT_SHA"), "git_dirty": env("QERL_GIT_DIRTY") == "1"}
    root = Path(__file__).resolve().parent.parent
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=5).stdout.strip()
        dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                                    capture_output=True, text=True, timeout=5).stdout.strip())
        if len(sha) != 40:  # not a git checkout: never record a ref name as a sha
            return {"git_sha": None, "git_dirty": None}
        return {"git_sha": sha, "git_dirty": dirty}
    except (OSError, subprocess.SubprocessError):
        return {"git_sha": None, "git_dirty": None}


def environment() -> dict:
    """Versions and hardware: the provenance every results file carries."""
    import transformers

    env = {"date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"), "python": platform.python_version(),
           "torch": torch.__version__, "transformers": transformers.__version__, "host": platform.node()}
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    env["device"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else f"cpu ({os.cpu_count()} cores)"
    return {**env, **git_info()}


# qerl's metrics.jsonl key -> TRL's name, where the two differ (W&B logs TRL's names).
TRL_NAMES = {"sampling/logprob_gap": "sampling/sampling_logp_difference/mean",
             "sampling/logprob_gap_max": "sampling/sampling_logp_difference/max"}


def wandb_key(key: str) -> str:
    """The W&B name of a metrics.jsonl key: evaluations as they are, the rest TRL's name under train/."""
    return key if key.startswith(("eval/", "eval_before/")) else "train/" + TRL_NAMES.get(key, key)


_MODES = {"offline": "offline", "dryrun": "offline", "online": "online", "run": "online", "disabled": "disabled"}


def wandb_settings(cfg) -> dict:
    """RunLogger's W&B keywords for a TrainConfig: its wandb_* fields where set, else W&B's environment
    variables, else offline in project "qerl"; tags: $WANDB_TAGS, cfg.wandb_tags, and the run's method,
    format, profile and seed (so runs group and compare in the W&B UI); the name: wandb_name, else
    <run root>/<run folder>, which differs between run roots."""
    env = os.environ
    mode = cfg.wandb_mode or env.get("WANDB_MODE", "").strip().lower() or "offline"
    if env.get("WANDB_DISABLED", "").lower() in ("1", "true", "yes") and not cfg.wandb_mode:
        mode = "disabled"
    if mode not in _MODES:
        raise ValueError(f"WANDB_MODE={mode!r}: expected offline, online or disabled")
    out = Path(cfg.output_dir).resolve()
    tags = [t.strip() for t in env.get("WANDB_TAGS", "").split(",") if t.strip()] + list(cfg.wandb_tags)
    tags += [f"method:{cfg.method}", f"format:{cfg.fmt}", f"profile:{cfg.profile}", f"seed:{cfg.seed}"]
    return {"wandb_mode": _MODES[mode], "project": cfg.wandb_project or env.get("WANDB_PROJECT") or "qerl",
            "entity": cfg.wandb_entity or env.get("WANDB_ENTITY") or None,
            "group": cfg.wandb_group or env.get("WANDB_RUN_GROUP") or None,
            "name": cfg.wandb_name or f"{out.parent.name}/{out.name}", "tags": list(dict.fromkeys(tags)),
            "wandb_dir": env.get("WANDB_DIR") or None}


class _NoBar:
    def update(self, n=1):
        pass

    def set_postfix_str(self, *a, **k):
        pass

    def close(self):
        pass


def progress(total: int, desc: str, unit: str = "it", unit_scale=False):
    """A transient progress bar inside a long phase (the rollout's tokens, the update's micro-batches).

    Shown only on an interactive terminal: not when stderr is not a TTY (logs, CI, `make reproduce`'s
    job logs) nor under pytest; QERL_PROGRESS=1 forces it on, QERL_PROGRESS=0 off. ``unit_scale``:
    a factor for the counts (the batch size, so decode steps show as tokens and tokens/s).
    """
    import sys

    flag = env("QERL_PROGRESS")
    show = flag == "1" or (flag != "0" and "PYTEST_CURRENT_TEST" not in os.environ
                           and hasattr(sys.stderr, "isatty") and sys.stderr.isatty())
    if not show or total <= 0:
        return _NoBar()
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit=unit, unit_scale=unit_scale, leave=False, dynamic_ncols=True)


def _clean(v):
    """JSON-safe scalar: tensors to floats, NaN/inf to None (never a fake number)."""
    if isinstance(v, torch.Tensor):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


class DummyWandb:
    """Stands in for a wandb run when logging to W&B is off."""

    def log(self, *a, **k):
        pass

    def finish(self, *a, **k):
        pass

    summary: dict = {}


class RunLogger:
    """Writes a run folder: config.json, metrics.jsonl (one flat line per step), summary.json, wandb/."""

    def __init__(self, output_dir: str | os.PathLike, config: dict, wandb_mode: str = "offline",
                 project: str = "qerl", group: str | None = None, name: str | None = None, resume: bool = False,
                 entity: str | None = None, tags=(), wandb_dir: str | None = None):
        self.dir = Path(output_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.config = {**config, "provenance": environment()}
        (self.dir / "config.json").write_text(json.dumps(self.config, indent=2, default=str))
        self.metrics_path = self.dir / "metrics.jsonl"
        if not resume and self.metrics_path.exists():
            self.metrics_path.unlink()
        self.resume = resume
        self.wandb = DummyWandb()
        if wandb_mode != "disabled":
            try:
                import wandb
            except ImportError:
                print("[qerl] wandb is not installed: W&B logging off (metrics.jsonl is still written)")
            else:
                os.environ.setdefault("WANDB_SILENT", "true")
                # One W&B run per run folder: its id is kept in wandb_run_id, and a resumed run continues it.
                id_file = self.dir / "wandb_run_id"
                run_id = id_file.read_text().strip() if resume and id_file.is_file() else None
                if run_id is None:
                    run_id = secrets.token_hex(4)  # W&B's own ids are 8 characters of [a-z0-9]
                    id_file.write_text(run_id + "\n")
                wdir = Path(wandb_dir) if wandb_dir else self.dir
                wdir.mkdir(parents=True, exist_ok=True)
                self.wandb = wandb.init(project=project, entity=entity, group=group, name=name or self.dir.name,
                                        tags=list(tags) or None, dir=str(wdir), mode=wandb_mode, config=self.config,
                                        reinit="finish_previous", id=run_id, resume="allow" if resume else None)
                if resume:
                    self._relog_missing(wdir / "wandb", run_id)

    def _relog_missing(self, wandb_root: Path, run_id: str) -> None:
        """A resumed run: log again into this W&B segment the metrics.jsonl rows (already cut back to the
        checkpoint) that the earlier segments' W&B files lack. A killed process loses the steps W&B had not
        yet written; without this the W&B history of the run would have a gap there. W&B takes steps in
        increasing order only, so rows at or below the last step W&B holds cannot be logged again: one line
        names them (their values stay in metrics.jsonl)."""
        try:
            current = Path(self.wandb.dir).resolve().parent
        except (AttributeError, TypeError):
            current = None
        logged = wandb_logged_steps(wandb_root, run_id, exclude=current)
        rows = read_metrics(self.metrics_path) if self.metrics_path.is_file() else []
        last = max(logged, default=-1)
        again = [r for r in rows if r["step"] > last]
        lost = sorted({r["step"] for r in rows if r["step"] <= last and r["step"] not in logged})
        for r in again:
            self.wandb.log({wandb_key(k): v for k, v in r.items() if v is not None and k != "step"}, step=r["step"])
        if again:
            steps = sorted({r["step"] for r in again})
            print(f"[qerl] W&B: steps {_ranges(steps)} were in metrics.jsonl but not in the W&B files of the stopped "
                  f"run; logged them again")
        if lost:
            print(f"[qerl] W&B: steps {_ranges(lost)} are in metrics.jsonl but not in the W&B history (W&B takes "
                  f"steps in order only)")

    def log(self, metrics: dict, step: int):
        row = {"step": step, **{k: _clean(v) for k, v in metrics.items()}}
        with self.metrics_path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        self.wandb.log({wandb_key(k): v for k, v in row.items() if v is not None and k != "step"}, step=step)

    def finish(self, summary: dict):
        summary = {k: _clean(v) for k, v in summary.items()}
        path = self.dir / "summary.json"
        if self.resume and path.is_file():  # a resumed run keeps what its first part recorded (eval_before, ...)
            summary = {**json.loads(path.read_text()), **summary}
        path.write_text(json.dumps(summary, indent=2, default=str))
        if self.metrics_path.is_file():
            try:
                plot_run_reward(self.dir)
            except Exception as exc:  # noqa: BLE001 - a figure must not fail a finished run; say so
                print(f"[qerl] warning: could not draw {self.dir / 'reward.png'}: {exc}")
        for k, v in summary.items():
            if isinstance(v, (int, float)) and v is not None:
                self.wandb.summary[k] = v  # summary.json's keys: eval/..., eval_before/..., steps
        self.wandb.finish()


def plot_run_reward(run_dir: str | os.PathLike) -> Path:
    """<run_dir>/reward.png: the reward of every step (and its 3-step mean), with the evaluations."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    rows = read_metrics(run_dir)
    steps = [r for r in rows if r.get("reward") is not None]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    if steps:
        x, y = [r["step"] for r in steps], [r["reward"] for r in steps]
        ax.plot(x, y, "o-", ms=3, lw=1, alpha=0.5, label="reward (per step)")
        k = 3
        if len(y) >= k:
            ax.plot(x[k - 1:], [sum(y[i - k + 1:i + 1]) / k for i in range(k - 1, len(y))], lw=2,
                    label=f"reward ({k}-step mean)")
    for key in sorted({k for r in rows for k in r if k.startswith("eval/") and k.endswith("/accuracy")}):
        pts = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
        # markers only: evaluations are points in time, a line between them would read as data in between
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "s", ms=7, ls="none",
                label=f"evaluation: {key.removeprefix('eval/')}")
    ax.set_xlabel("step")
    ax.set_ylabel("reward / accuracy")
    ax.set_title(run_dir.name)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    out = run_dir / "reward.png"
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def run_report(run_dir: str | os.PathLike) -> str:
    """One line: accuracy before -> after per eval dataset and reward first -> last, from the run folder."""
    run_dir = Path(run_dir)
    summary = json.loads((run_dir / "summary.json").read_text()) if (run_dir / "summary.json").is_file() else {}
    parts = []
    for key in sorted(k for k in summary if k.startswith("eval/") and k.endswith("/accuracy")):
        d = key.removeprefix("eval/").removesuffix("/accuracy")  # your own files may have "/" in their names
        before = summary.get(f"eval_before/{d}/accuracy")
        n = summary.get(f"eval/{d}/num_problems")
        parts.append(f"{d} accuracy {before:.3f} -> {summary[key]:.3f}" if before is not None
                     else f"{d} accuracy after {summary[key]:.3f}")
        parts[-1] += f" ({n} problems)" if n else ""
    rewards = [r["reward"] for r in read_metrics(run_dir) if r.get("reward") is not None] \
        if (run_dir / "metrics.jsonl").is_file() else []
    if rewards:
        k = min(3, len(rewards) // 2)  # two windows that do not overlap; one step each adds nothing
        window = (f"; mean of the first {k} steps {sum(rewards[:k]) / k:.3f} -> last {k} {sum(rewards[-k:]) / k:.3f}"
                  if k >= 2 else "")
        parts.append(f"reward {rewards[0]:.3f} -> {rewards[-1]:.3f} (step 1 -> {len(rewards)}{window})")
    if (run_dir / "reward.png").is_file():
        parts.append(f"plot {run_dir / 'reward.png'}")
    return "; ".join(parts) if parts else f"{run_dir}: no evaluation or reward recorded"


def read_metrics(path: str | os.PathLike) -> list[dict]:
    """Rows of a metrics.jsonl (or of <run>/metrics.jsonl when given a folder)."""
    p = Path(path)
    p = p / "metrics.jsonl" if p.is_dir() else p
    return [json.loads(line) for line in p.read_text().splitlines() if line.strip()]


def _wandb_records(path: Path) -> list[bytes]:
    """The raw record payloads of a W&B run file (see read_wandb_offline)."""
    import struct

    data = path.read_bytes()
    if data[:4] != b":W&B":
        raise ValueError(f"{path} is not a W&B run file")
    block, pos, payloads, buf = 32768, 7, [], b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # block trailer padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk = data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind == 0 and length == 0:
            continue
        buf = chunk if kind in (1, 2) else buf + chunk
        if kind in (1, 4):  # FULL or LAST
            payloads.append(buf)
            buf = b""
    return payloads


def _ranges(steps: list[int]) -> str:
    """[1, 2, 3, 5] -> "1-3, 5"."""
    out, start = [], None
    for i, s in enumerate(steps):
        if start is None:
            start = s
        if i + 1 == len(steps) or steps[i + 1] != s + 1:
            out.append(f"{start}-{s}" if s != start else f"{s}")
            start = None
    return ", ".join(out)


def wandb_logged_steps(wandb_root: str | os.PathLike, run_id: str, exclude: Path | None = None) -> set[int]:
    """The steps of W&B run ``run_id`` in its run files under ``wandb_root`` (<dir>/wandb: one folder per
    segment, offline-run-* or run-*), read as they are: a file cut off by a killed process gives the
    records it holds."""
    from wandb.proto import wandb_internal_pb2 as pb

    steps: set[int] = set()
    for f in Path(wandb_root).glob(f"*-{run_id}/run-{run_id}.wandb"):
        if exclude is not None and f.parent.resolve() == exclude:
            continue
        try:
            payloads = _wandb_records(f)
        except (OSError, ValueError):
            continue
        for raw in payloads:
            try:
                rec = pb.Record.FromString(raw)
            except Exception:  # noqa: BLE001 - the record a kill cut in half
                continue
            if rec.WhichOneof("record_type") == "history":
                items = {i.key: i.value_json for i in rec.history.item}
                steps.add(int(json.loads(items["_step"])) if "_step" in items else rec.history.step.num)
    return steps


def read_wandb_history(run_dir: str | os.PathLike) -> list[dict]:
    """The W&B history of a run folder over all its segments (a resumed run writes one W&B run file per
    process, all with the id in <run_dir>/wandb_run_id), in step order; each step's entries merged."""
    from wandb.proto import wandb_internal_pb2 as pb

    run_dir = Path(run_dir)
    run_id = (run_dir / "wandb_run_id").read_text().strip()
    by_step: dict[int, dict] = {}
    for f in sorted((run_dir / "wandb").glob(f"*-{run_id}/run-{run_id}.wandb")):
        for raw in _wandb_records(f):
            try:
                rec = pb.Record.FromString(raw)
            except Exception:  # noqa: BLE001 - the record a kill cut in half
                continue
            if rec.WhichOneof("record_type") == "history":
                row = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item}
                step = int(row.get("_step", rec.history.step.num))
                by_step.setdefault(step, {}).update(row)
    return [by_step[k] for k in sorted(by_step)]


def read_wandb_offline(run_dir: str | os.PathLike, wait_s: float = 30.0) -> dict:
    """Read back a W&B offline run (<dir>/wandb/offline-run-*/run-*.wandb) without a server.

    The file is W&B's own record log (a 7-byte ':W&B' header, then LevelDB-style 32 KiB blocks of
    framed protobuf ``Record`` messages from wandb.proto). Returns {"history": [ {key: value} per
    logged step ], "config": {...}, "summary": {...}, "run_id", "project", "entity", "group", "name",
    "tags"}. Used by the tests to prove
    that what we log is what W&B stores, and handy for notebooks on machines that never sync.
    """
    import glob

    from wandb.proto import wandb_internal_pb2 as pb

    p = Path(run_dir)
    files = sorted(glob.glob(str(p / "**" / "run-*.wandb"), recursive=True))
    if not files:
        raise FileNotFoundError(f"no W&B offline run file (run-*.wandb) under {p}")
    # W&B's service may still be writing the file when wandb.finish() has returned: read until the
    # run's exit record is there (or `wait_s` has passed).
    deadline = time.monotonic() + wait_s
    while True:
        payloads = _wandb_records(Path(files[-1]))
        kinds = [pb.Record.FromString(raw).WhichOneof("record_type") for raw in payloads]
        if "exit" in kinds or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    out = {"history": [], "config": {}, "summary": {}, "run_id": None}
    for raw in payloads:
        rec = pb.Record()
        rec.ParseFromString(raw)
        which = rec.WhichOneof("record_type")
        if which == "history":
            out["history"].append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item})
        elif which == "config":
            out["config"].update({i.key: json.loads(i.value_json) for i in rec.config.update})
        elif which == "summary":
            out["summary"].update({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.summary.update})
        elif which == "run":
            out["run_id"] = rec.run.run_id
            out.update(project=rec.run.project, entity=rec.run.entity, group=rec.run.run_group,
                       name=rec.run.display_name, tags=list(rec.run.tags))
            out["config"].update({i.key: json.loads(i.value_json) for i in rec.run.config.update})
    return out
