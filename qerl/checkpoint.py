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
import re
import shutil
from collections.abc import Callable
from pathlib import Path

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
    import torch

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
