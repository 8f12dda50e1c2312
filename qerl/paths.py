"""Checks of the folders a command writes, made before any model loads: a path that cannot be written
(under a file, a read-only file system, no permission, a virtual file system such as /proc) and a folder
that `quantize` / `export` would write into although it holds files. Each is one error naming the option.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def check_writable(path, option: str, file: bool = False) -> None:
    """A ValueError naming ``option`` when ``path`` (a folder to create or fill; ``file``: a file to write)
    cannot be written: under a file, on a read-only or virtual file system, or without permission. The
    nearest existing folder is tried for real (a folder made and removed there): os.access says yes to
    root on /proc and on read-only mounts."""
    p = Path(path).expanduser().absolute()
    q = p.parent if file else p
    while not q.exists() and q != q.parent:  # a path under a file does not "exist" either
        q = q.parent
    if not q.is_dir():
        raise ValueError(f"{option} {path}: {q} is a file, not a folder")
    if not os.access(q, os.W_OK | os.X_OK):
        raise ValueError(f"{option} {path}: cannot write in {q} (a read-only file system, or no permission)")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".qerl-write-check-", dir=q))
    except OSError as exc:
        raise ValueError(f"{option} {path}: cannot write in {q} ({exc.strerror or exc}; a read-only or virtual "
                         f"file system, or no permission)") from None


def check_new_or_empty(out_dir, option: str = "--out") -> None:
    """FileExistsError unless ``out_dir`` is a new or empty folder: a training run, a checkpoint or any
    other file in it is refused and nothing is changed; a ValueError naming ``option`` when it cannot be
    written."""
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise ValueError(f"{option} {out_dir}: a file, not a folder; choose a new or empty folder")
    if out_dir.is_dir():
        held = sorted(p.name for p in out_dir.iterdir())
        if held:
            shown = ", ".join(held[:4]) + (f", ... ({len(held)} entries)" if len(held) > 4 else "")
            raise FileExistsError(f"{option} {out_dir} is not empty ({shown}): choose a new or empty folder "
                                  f"(qerl never writes into a folder that holds files)")
    check_writable(out_dir, option)
