"""A run's folder (``output_dir``): what makes a folder a run, refusing to overwrite one, whether its
run finished, and what a run records about how it was started (its command line, where its data came
from). The checkpoints inside it are ``qerl.checkpoint``'s; its files are written by
``qerl.logging.RunLogger``.
"""

from __future__ import annotations

import json
import shlex
import shutil
import sys
import time
from pathlib import Path

from qerl import data as qdata
from qerl.config import TrainConfig
from qerl.paths import check_writable

RUN_FILES = ("config.json", "metrics.jsonl", "summary.json", "checkpoints", "wandb", "wandb_run_id", "reward.png")


def check_output_dir(cfg: TrainConfig, clear: bool = True) -> None:
    """Refuse an output_dir that already holds a run, unless cfg.overwrite (its run files are deleted
    when ``clear``) or cfg.resume_from (the run is continued). Other files in the folder are left alone."""
    out = Path(cfg.output_dir)
    check_writable(out, "--output-dir")  # /proc/x, a read-only mount: before anything loads
    found = [n for n in RUN_FILES if (out / n).exists()]
    if not found or cfg.resume_from:
        return
    if not cfg.overwrite:
        status = "a"
        if (out / "summary.json").is_file():
            try:
                status = "a finished" if json.loads((out / "summary.json").read_text()).get("status") == "ok" else "an unfinished"
            except ValueError:
                pass
        raise FileExistsError(f"{out} already holds {status} run ({', '.join(found)}): pass --overwrite to replace it, "
                              f"--resume-from auto to continue it, or another --output-dir")
    if clear:
        for n in found:
            p = out / n
            shutil.rmtree(p) if p.is_dir() else p.unlink()


def remove_unstarted(out: Path, remove_folder: bool) -> None:
    """Remove the run files of a run that failed before its first step (no metrics row, no checkpoint), so the
    corrected command runs without --overwrite; ``remove_folder``: the folder too, when it is then empty (it
    was new). A run that logged a step is kept (--resume-from auto continues it)."""
    out = Path(out)
    metrics = out / "metrics.jsonl"
    if (metrics.is_file() and metrics.read_text().strip()) or any((out / "checkpoints").glob("step-*")):
        return
    wandb = sys.modules.get("wandb")
    if wandb is not None and getattr(wandb, "run", None) is not None:  # its files are about to go: close it first
        try:
            wandb.finish(exit_code=1, quiet=True)
        except Exception:  # noqa: BLE001 - cleaning up after an error must not raise another
            pass
    for n in RUN_FILES:
        p = out / n
        for _ in range(20):  # W&B's service may still be writing into its folder for a moment after finish()
            if p.is_dir():
                shutil.rmtree(p, ignore_errors=True)
            elif p.exists():
                p.unlink(missing_ok=True)
            if not p.exists():
                break
            time.sleep(0.1)
    if remove_folder and out.is_dir() and not any(out.iterdir()):
        out.rmdir()


def finished_summary(out: Path) -> dict | None:
    """summary.json of a run folder whose run finished (status ok), else None."""
    try:
        summary = json.loads((out / "summary.json").read_text())
    except (OSError, ValueError):
        return None
    return summary if summary.get("status") == "ok" else None


def data_sources(cfg: TrainConfig) -> dict[str, str]:
    """Where each dataset of the run is read from: "built-in" (arith, generated), a local folder (the
    data_dir flag, else $QERL_DATA_DIR, resolved), or "hub". What the run read, whatever flags it got."""
    root = qdata._resolve_data_dir(cfg.data_dir)

    def source(name: str) -> str:
        if name not in qdata.DATASETS:  # your own data: the file or folder, else a hub dataset
            return str(Path(name).expanduser().resolve()) if Path(name).expanduser().exists() else "hub"
        return "built-in" if name == "arith" else str(root.resolve()) if root is not None else "hub"

    return {name: source(name) for name in dict.fromkeys((cfg.dataset, *cfg.eval_datasets))}


def command_line() -> str:
    """The command line of this process (python -m qerl train ...), as it ran."""
    argv = list(sys.argv)
    if argv and argv[0].endswith(("qerl/__main__.py", "qerl\\__main__.py")):
        argv = ["-m", "qerl"] + argv[1:]
    return shlex.join([sys.executable, *argv])
