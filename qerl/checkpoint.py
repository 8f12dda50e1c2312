"""Checkpoints that a crash cannot break: written whole or not at all, found by their manifest.

A checkpoint ``<run>/checkpoints/step-N`` is written into a hidden sibling ``.step-N.partial``;
every file is flushed and fsynced, ``manifest.json`` (each file's name, size and sha256) is written
last, and only then is the folder renamed to ``step-N`` (a rename within one file system is atomic,
and the parent folder is fsynced after it). So a process killed mid-save (kill -9, power loss, a
full disk) leaves at most a ``.partial`` folder that nothing reads, and every ``step-N`` holding a
manifest is complete. A ``step-N`` without a manifest predates manifests or was cut off by another
writer: ``--resume-from auto`` skips it and says so.

Before writing, the free space of the file system is checked against an estimate of the
checkpoint's size (the tensors to be written, or the last checkpoint's size if larger); a save that
does not fit, or that hits ENOSPC mid-write anyway, raises ``CheckpointSpaceError`` (an OSError: one
``error:`` line, exit 2 at the CLI) naming the path and the bytes needed, and removes its partial
folder, so the previous checkpoint stays the newest complete one.

The trainer's checkpoints are saved, loaded and resumed here too (``save_checkpoint``,
``load_checkpoint``, ``resume_point``, ``cut_metrics``), and evaluation, export and
``qerl.load_trained`` read them here (``read_checkpoint_config``, ``load_trainable``): a checkpoint
``step-N`` holds ``trainable.safetensors`` (LoRA, trained norms, or every weight for bf16_full),
``state.pt`` (optimizer, scheduler, RNG states), ``config.json`` (the resolved TrainConfig) and, for
LoRA, ``adapter/`` (a PEFT copy).

Each checkpoint also carries ``resume.json``: what the run had recorded when it was saved (the
metrics.jsonl row count, the cumulative token count, the summary so far with its ``eval_before/*``),
so that a resumed run cuts metrics.jsonl back to that row and ends with the same files as a run that
was never interrupted.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import random
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import torch

MANIFEST = "manifest.json"
RUN_STATE = "resume.json"
_STEP = re.compile(r"^step-(\d+)$")
_SLACK = 1 << 20  # bytes added to the estimate: JSON files, pickle framing, file-system blocks


class CheckpointSpaceError(OSError):
    """A checkpoint does not fit on its file system; the previous checkpoint is intact."""


# ----------------------------------------------------------------------------- finding checkpoints
def step_of(path: Path) -> int | None:
    m = _STEP.match(Path(path).name)
    return int(m.group(1)) if m else None


def all_checkpoints(ckpt_dir: Path) -> list[Path]:
    """Every ``step-N`` folder of a checkpoints folder, by step (complete or not)."""
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.is_dir():
        return []
    found = [p for p in ckpt_dir.iterdir() if p.is_dir() and step_of(p) is not None]
    return sorted(found, key=step_of)


def is_complete(path: Path) -> bool:
    """A checkpoint folder whose manifest was written (the last thing a save writes before its rename)."""
    try:
        m = json.loads((Path(path) / MANIFEST).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(m, dict) and isinstance(m.get("files"), dict)


def partial_saves(ckpt_dir: Path) -> list[Path]:
    """The ``.step-N.partial`` folders that saves cut off by a crash left behind."""
    ckpt_dir = Path(ckpt_dir)
    return sorted(ckpt_dir.glob(".step-*.partial")) if ckpt_dir.is_dir() else []


def latest_complete(ckpt_dir: Path) -> tuple[Path | None, list[Path]]:
    """(the newest complete checkpoint or None, the incomplete ones newer than it, partial saves included)."""
    cks = all_checkpoints(ckpt_dir)
    best = next((p for p in reversed(cks) if is_complete(p)), None)
    floor = step_of(best) if best is not None else -1
    skipped = [p for p in cks if step_of(p) > floor and not is_complete(p)]
    skipped += [p for p in partial_saves(ckpt_dir) if int(p.name.split("-")[1].split(".")[0]) > floor]
    return best, skipped


# ----------------------------------------------------------------------------- writing
def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file())


def checkpoint_bytes(path: Path) -> int:
    """The total size a complete checkpoint's manifest records (0 if it has none)."""
    try:
        m = json.loads((Path(path) / MANIFEST).read_text())
        return sum(int(f["bytes"]) for f in m["files"].values())
    except (OSError, ValueError, KeyError, TypeError):
        return 0


def disk_full(exc: BaseException) -> bool:
    """Did this write fail for lack of space? torch.save and safetensors wrap the OS error in their own."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        text = str(exc)
        if "No space left" in text or "os error 28" in text or "Disk quota exceeded" in text:
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def _space_error(path: Path, needed: int, free: int | None, previous: Path | None) -> CheckpointSpaceError:
    kept = (f"the last complete checkpoint {previous} is intact" if previous is not None
            else "no earlier checkpoint exists")
    have = f", {free} bytes free" if free is not None else ""
    return CheckpointSpaceError(f"not enough free space to write checkpoint {path}: {needed} bytes needed{have} on "
                                f"its file system; {kept}. Free some space (or lower --save-total-limit) and resume "
                                f"with --resume-from auto")


def write(path: Path, writers: dict[str, Callable[[Path], None]], estimate_bytes: int = 0,
          meta: dict | None = None) -> Path:
    """Write checkpoint ``path`` atomically: ``writers[name](file_path)`` writes each file (or folder)
    ``name`` inside a partial folder; then the manifest, fsyncs and the rename. Returns ``path``.

    A failure of any writer removes the partial folder and re-raises (CheckpointSpaceError if the
    disk filled up); an existing ``path`` is replaced only after the new one is complete.
    """
    path = Path(path)
    parent = path.parent
    parent.mkdir(parents=True, exist_ok=True)
    previous, _ = latest_complete(parent)
    needed = max(int(estimate_bytes), checkpoint_bytes(previous) if previous is not None else 0) + _SLACK
    free = shutil.disk_usage(parent).free
    if free < needed:
        raise _space_error(path, needed, free, previous)
    for stale in partial_saves(parent):  # saves cut off by a crash: never read, only in the way
        shutil.rmtree(stale, ignore_errors=True)
    tmp = parent / f".{path.name}.partial"
    tmp.mkdir()
    try:
        for name, writer in writers.items():
            writer(tmp / name)
        files = _files(tmp)
        for f in files:
            _fsync_path(f)
        manifest = {"format": 1, **(meta or {}),
                    "files": {str(f.relative_to(tmp)): {"bytes": f.stat().st_size, "sha256": _sha256(f)}
                              for f in files}}
        with open(tmp / MANIFEST, "w") as fh:
            fh.write(json.dumps(manifest, indent=1))
            fh.flush()
            os.fsync(fh.fileno())
        for d in sorted({f.parent for f in files} | {tmp}, key=lambda p: -len(p.parts)):
            _fsync_path(d)
    except BaseException as exc:  # a KeyboardInterrupt mid-save too: no partial folder stays behind
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(exc, Exception) and disk_full(exc):
            raise _space_error(path, needed, None, previous) from exc
        raise
    old = parent / f".{path.name}.old"
    if path.exists():  # the same step written again (a resumed run): swap, then drop the old one
        if old.exists():
            shutil.rmtree(old)
        path.rename(old)
    tmp.rename(path)
    _fsync_path(parent)
    shutil.rmtree(old, ignore_errors=True)
    return path


class RecordingFile:
    """A binary file whose write errors are remembered: torch.save turns the OSError of a full disk
    into a RuntimeError without its errno, so the writer keeps it to report the cause."""

    def __init__(self, path: Path):
        self.f = open(path, "wb")  # noqa: SIM115 - closed in __exit__
        self.error: OSError | None = None

    def write(self, b) -> int:
        try:
            return self.f.write(b)
        except OSError as exc:
            self.error = exc
            raise

    def flush(self):
        self.f.flush()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        try:
            self.f.close()
        except OSError:  # the write error was recorded; closing a file on a full disk can fail again
            pass


def torch_save(obj, path: Path) -> None:
    """torch.save that raises the OS error (ENOSPC, ...) itself when the file system refuses a write."""
    with RecordingFile(path) as f:
        try:
            torch.save(obj, f)
        except Exception as exc:
            if f.error is not None:
                raise f.error from exc
            raise


def prune(ckpt_dir: Path, keep: int) -> list[Path]:
    """Delete all but the newest ``keep`` complete checkpoints (keep >= 1: the last complete one always
    stays) and every partial save; incomplete ``step-N`` folders older than the newest complete one go
    too. Returns what was deleted."""
    if keep < 1:
        return []
    cks = all_checkpoints(ckpt_dir)
    complete = [p for p in cks if is_complete(p)]
    if not complete:
        return []
    newest = step_of(complete[-1])
    doomed = complete[:-keep] + [p for p in cks if not is_complete(p) and step_of(p) < newest]
    doomed += partial_saves(ckpt_dir)
    for p in doomed:
        shutil.rmtree(p, ignore_errors=True)
    return doomed


# ----------------------------------------------------------------------------- reading
def verify(path: Path, names: tuple[str, ...] | None = None) -> None:
    """Check ``path``'s files against its manifest (sizes, and sha256 of ``names`` or of every file);
    a mismatch is a ValueError naming the file. A checkpoint without a manifest is not checked."""
    path = Path(path)
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except FileNotFoundError:
        return
    except ValueError as exc:
        raise ValueError(f"cannot read {path / MANIFEST} ({exc}): the file is truncated or corrupt") from None
    for name, rec in manifest.get("files", {}).items():
        f = path / name
        if not f.is_file():
            raise ValueError(f"{f} is missing but listed in {path / MANIFEST}: the checkpoint was changed after it "
                             f"was written; use another checkpoint (--resume-from {path.parent}/step-N)")
        size = f.stat().st_size
        if size != rec["bytes"] or ((names is None or name in names) and _sha256(f) != rec["sha256"]):
            what = f"{size} bytes, the manifest says {rec['bytes']}" if size != rec["bytes"] else "sha256 differs"
            raise ValueError(f"cannot read {f} ({what}): the file is truncated or corrupt; use another checkpoint "
                             f"(--resume-from {path.parent}/step-N)")


def read_run_state(path: Path) -> dict:
    """The run's record at the checkpoint (resume.json), {} for checkpoints that predate it."""
    try:
        return json.loads((Path(path) / RUN_STATE).read_text())
    except FileNotFoundError:
        return {}
    except ValueError as exc:
        raise ValueError(f"cannot read {Path(path) / RUN_STATE} ({exc}): the file is truncated or corrupt") from None


def count_rows(metrics: Path) -> int:
    """Lines of a metrics.jsonl (0 if there is none)."""
    try:
        with open(metrics, "rb") as f:
            return sum(1 for line in f if line.strip())
    except FileNotFoundError:
        return 0


def cut_rows(metrics: Path, rows: int) -> int:
    """Keep the first ``rows`` rows of metrics.jsonl (what the run had logged at the resumed checkpoint),
    so that no step appears twice after a resume; returns how many rows were dropped. The file is
    replaced atomically."""
    metrics = Path(metrics)
    if not metrics.is_file():
        return 0
    lines = [ln for ln in metrics.read_text().splitlines() if ln.strip()]
    if len(lines) <= rows:
        return 0
    tmp = metrics.with_name(metrics.name + ".tmp")
    with open(tmp, "w") as f:
        f.write("".join(ln + "\n" for ln in lines[:rows]))
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(metrics)
    return len(lines) - rows


# ----------------------------------------------------------------------------- the trainer's checkpoints
def save_checkpoint(path: Path, step: int, model, trainable_names, opt, sched, cfg,
                    run_state: dict | None = None) -> Path:
    """Write checkpoint ``path`` (checkpoints/step-N) atomically (``write``): the trainable weights,
    optimizer / scheduler / RNG states, the config, the run's record ``run_state`` (resume.json) and a
    PEFT copy of the adapter, then the manifest."""
    from safetensors.torch import save_file

    params = dict(model.named_parameters())
    master = getattr(opt, "qerl_master", None)  # bf16_full: the fp32 masters are the trained weights
    tensors = {n: master.master_of(params[n]) if master is not None else params[n] for n in trainable_names}
    tensors = {n: t.detach().contiguous().cpu() for n, t in tensors.items()}
    state = {"optimizer": opt.state_dict(), "scheduler": sched.state_dict(), "step": step,
             "rng": {"torch": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
                     "python": random.getstate()}}
    opt_bytes = sum(v.numel() * v.element_size() for s in state["optimizer"]["state"].values() for v in s.values()
                    if isinstance(v, torch.Tensor))
    tensor_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
    estimate = tensor_bytes * (2 if cfg.lora else 1) + opt_bytes  # LoRA: the PEFT copy holds the adapter again

    def adapter(dst: Path):
        from qerl.export import export_run_adapter

        try:
            export_run_adapter(model, dst, cfg)
        except Exception as e:  # the adapter is a convenience copy; trainable.safetensors is the checkpoint
            if disk_full(e):
                raise
            shutil.rmtree(dst, ignore_errors=True)
            print(f"[qerl] PEFT adapter export skipped: {e}")

    writers = {
        "trainable.safetensors": lambda f: save_file(tensors, str(f)),
        "state.pt": lambda f: torch_save(state, f),
        "config.json": lambda f: f.write_text(json.dumps(cfg.to_dict(), indent=2, default=str)),  # read by `eval`
        RUN_STATE: lambda f: f.write_text(json.dumps({"step": step, **(run_state or {})}, indent=1, default=str)),
    }
    if cfg.lora:
        writers["adapter"] = adapter
    return write(path, writers, estimate_bytes=estimate, meta={"step": step, "method": cfg.method})


def read_checkpoint_config(path) -> dict:
    """What a checkpoint says about the policy it was trained as: {model, method, lora_rank, lora_alpha,
    lora_dropout, train_norms} as far as it records them.

    ``path`` is a qerl checkpoint folder (its config.json; older checkpoints: the run folder's
    config.json two levels up) or a PEFT adapter folder (adapter_config.json: r, lora_alpha,
    modules_to_save; the method is not recorded there). LoRA on a subset of the projections cannot be
    rebuilt (qerl puts LoRA on all seven) and is refused.
    """
    from qerl.arch import LINEAR_NAMES, NORM_NAMES

    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"{path}: no such checkpoint or adapter folder")
    peft = path / "adapter_config.json"
    if peft.exists():
        c = json.loads(peft.read_text())
        targets = {t.rsplit(".", 1)[-1] for t in (c.get("target_modules") or [])}
        if targets != set(LINEAR_NAMES) or c.get("rank_pattern") or c.get("alpha_pattern"):
            raise ValueError(f"{peft}: LoRA on {sorted(targets)} (rank/alpha patterns {c.get('rank_pattern')}, "
                             f"{c.get('alpha_pattern')}); qerl rebuilds only one rank and alpha on all of "
                             f"{list(LINEAR_NAMES)}")
        saved = set(c.get("modules_to_save") or [])
        if saved - set(NORM_NAMES):
            raise ValueError(f"{peft}: modules_to_save {sorted(saved)}; qerl trains only {list(NORM_NAMES)}")
        out = {"lora_rank": int(c["r"]), "lora_alpha": float(c["lora_alpha"]),
               "lora_dropout": float(c.get("lora_dropout") or 0.0), "train_norms": bool(saved)}
        from qerl.export import adapter_info  # qerl's adapters record their method and base

        info = {k: v for k, v in adapter_info(path).items() if k in ("model", "method")}
        return {**({"model": c["base_model_name_or_path"]} if c.get("base_model_name_or_path") else {}), **out, **info}
    for cfg_file in (path / "config.json", path.parent.parent / "config.json"):
        if cfg_file.exists() and (path / "trainable.safetensors").exists():
            c = json.loads(cfg_file.read_text())
            keys = ("model", "method", "lora_rank", "lora_alpha", "lora_dropout", "train_norms")
            return {k: c[k] for k in keys if k in c}
    raise FileNotFoundError(f"{path} is neither a qerl checkpoint (trainable.safetensors with config.json here or "
                            f"in its run folder) nor a PEFT adapter folder (adapter_config.json)")


def _read_file(load, f: Path):
    """``load(f)``; a file that exists but cannot be read is a ValueError naming it (not a reader's traceback)."""
    try:
        return load(f)
    except FileNotFoundError:
        raise
    except Exception as exc:  # noqa: BLE001 - safetensors / pickle errors of a truncated or corrupt file
        lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
        raise ValueError(f"cannot read {f} ({type(exc).__name__}: {lines[0] if lines else ''}): the file is truncated "
                         f"or corrupt; use another checkpoint (--resume-from {f.parent.parent}/step-N)") from exc


def load_trainable(path, model) -> dict:
    """Load a checkpoint's trainable tensors (LoRA, trained norms, or all weights for bf16_full) into the
    model (cast to its dtypes) and return them as stored; ``path`` may also be a PEFT adapter folder
    that qerl exported (adapter_model.safetensors)."""
    from safetensors.torch import load_file

    path = Path(path)
    f = path / "trainable.safetensors"
    if f.exists():
        state = _read_file(lambda p: load_file(str(p)), f)
    elif (path / "adapter_model.safetensors").exists():
        prefix = "base_model.model."
        raw = _read_file(lambda p: load_file(str(p)), path / "adapter_model.safetensors")
        state = {k.removeprefix(prefix): v for k, v in raw.items()}
    else:
        raise FileNotFoundError(f"{f} not found: expected a qerl checkpoint folder (checkpoints/step-N) "
                                "or a PEFT adapter folder (adapter_model.safetensors)")
    params = dict(model.named_parameters())
    missing = set(state) - set(params)
    if missing:
        raise ValueError(f"checkpoint {path} has parameters the model lacks: {sorted(missing)[:5]}")
    bad = [(n, tuple(t.shape), tuple(params[n].shape)) for n, t in state.items() if t.shape != params[n].shape]
    if bad:
        raise ValueError(f"checkpoint {path} does not fit the model (LoRA rank?): {bad[0][0]} is {bad[0][1]} "
                         f"in the checkpoint, {bad[0][2]} in the model")
    with torch.no_grad():
        for n, t in state.items():
            params[n].copy_(t.to(params[n].device))
    return state


def load_checkpoint(path: Path, model, opt, sched) -> int:
    verify(path, names=("trainable.safetensors", "state.pt", RUN_STATE))
    state = load_trainable(path, model)
    master = getattr(opt, "qerl_master", None)
    if master is not None:  # bf16_full: the fp32 masters resume from the stored fp32 values
        params = dict(model.named_parameters())
        with torch.no_grad():
            for n, t in state.items():
                master.master_of(params[n]).copy_(t.to(params[n].device))
    st = _read_file(lambda p: torch.load(p, weights_only=False), path / "state.pt")
    opt.load_state_dict(st["optimizer"])
    sched.load_state_dict(st["scheduler"])
    torch.set_rng_state(st["rng"]["torch"])
    if st["rng"]["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(st["rng"]["cuda"])
    random.setstate(st["rng"]["python"])
    return int(st["step"])


def cut_metrics(metrics: Path, record: dict, step: int) -> int:
    """Cut metrics.jsonl back to the rows logged when the checkpoint of ``step`` was saved (its resume.json);
    a checkpoint without that record: to the rows of steps <= ``step``."""
    if "metrics_rows" in record:
        return cut_rows(metrics, int(record["metrics_rows"]))
    if not metrics.is_file():
        return 0
    keep = 0
    for ln in (ln for ln in metrics.read_text().splitlines() if ln.strip()):
        try:
            if json.loads(ln).get("step", 0) > step:
                break
        except ValueError:  # a row cut off by the crash
            break
        keep += 1
    return cut_rows(metrics, keep)


def latest_checkpoint(output_dir: Path) -> Path | None:
    """The newest complete checkpoint of a run folder (one with its manifest)."""
    return latest_complete(Path(output_dir) / "checkpoints")[0]

def check_resume_from(resume_from: str) -> Path:
    """The checkpoint folder an explicit ``--resume-from PATH`` names, or one error saying what PATH is
    instead: missing, a file, a run folder (its checkpoints are named), or a folder with no checkpoint files.
    Checked before the model loads."""
    resume = Path(resume_from).expanduser()
    if not resume.exists():
        raise FileNotFoundError(f"--resume-from {resume_from}: no such checkpoint folder")
    if not resume.is_dir():
        raise ValueError(f"--resume-from {resume_from}: a file, not a checkpoint folder (checkpoints/step-N)")
    if (resume / "trainable.safetensors").is_file() or is_complete(resume):
        return resume
    if (resume / "checkpoints").is_dir() or (resume / "config.json").is_file():
        newest = latest_checkpoint(resume) if (resume / "checkpoints").is_dir() else None
        which = (f"its newest is {newest}" if newest is not None else "it has no complete checkpoint yet")
        raise ValueError(f"--resume-from {resume_from}: a run folder, not a checkpoint ({which}); pass "
                         f"checkpoints/step-N, or --resume-from auto with --output-dir {resume_from}")
    raise ValueError(f"--resume-from {resume_from}: not a checkpoint (no trainable.safetensors or {MANIFEST}); "
                     f"pass a run's checkpoints/step-N, or auto")


def resume_point(output_dir: Path, resume_from: str | None, say=print) -> Path | None:
    """The checkpoint a run resumes from: ``resume_from`` "auto" (the run folder's newest complete
    checkpoint, None if it has none), a checkpoint folder, or None (a fresh run). Skipped incomplete
    checkpoints and an unchecked one (no manifest) are reported through ``say``."""
    if not resume_from:
        return None
    if resume_from == "auto":
        resume, incomplete = latest_complete(Path(output_dir) / "checkpoints")
        if incomplete:
            say(f"[qerl] skipped incomplete checkpoints (saves cut off before their manifest): "
                f"{', '.join(str(p) for p in incomplete)}")
        if resume is None:  # the documented choice: start fresh, and say so (experiments pass auto to new runs)
            say(f"[qerl] --resume-from auto: no checkpoint in {Path(output_dir) / 'checkpoints'}; starting at step 1")
        return resume
    resume = check_resume_from(resume_from)
    if not is_complete(resume):
        say(f"[qerl] warning: {resume} has no {MANIFEST} (saved by an older qerl, or cut off mid-save); its files "
            "are read unchecked")
    return resume
