"""The one launcher of experiments/: runs commands (``python -m qerl train ...``) as processes, each
in its run folder, several at once, spread over GPUs, and resumes where a call stopped. Every
artefact runs through it: the paper's tables and figures (``experiments/_common.py`` plans their
runs) and the paired AQN study (``experiments/aqn_paired.py``). No other file under experiments/
starts a process.

Public API:

    Task(name, command, folder, done=run_complete, planned=None, on_exit=None, gpu=None)
        One run: ``command`` (an argv list) runs with ``folder`` as its run folder; its output is
        appended to ``folder/log.txt``. ``done(folder)`` says whether the folder already holds a
        finished run (default ``run_complete``): such a task is skipped, so calling again resumes
        where the last call stopped (``resumable(tasks)`` lists what is left). ``planned`` (a dict)
        is written to ``folder/planned.json`` when the task starts, with the command and the start
        time; ``on_exit(task, exit_code)`` runs when the process ends (e.g. to delete checkpoints).
        ``gpu``: run it on this GPU of run_tasks' ``gpus`` only (a study that keeps the two arms of a
        pair on one GPU); None: on the least busy one.

    run_tasks(tasks, parallel=1, gpus=None, per_gpu=None, time_budget=0, stop_at=0, env=None,
              git=None) -> {task name: exit code}
        Runs the tasks that are not done, in order. Slots: ``per_gpu`` runs on each GPU of
        ``gpus`` (ids as CUDA_VISIBLE_DEVICES names them; each process sees its one GPU), so
        ``len(gpus) * per_gpu`` at once; without ``per_gpu``, ``parallel`` at once, each on the
        least busy GPU of ``gpus``; without ``gpus``, ``parallel`` at once and CUDA_VISIBLE_DEVICES
        left alone. Tasks start in order, except that a task pinned to a full GPU lets the next
        one that can start go first. ``time_budget`` (s): no task starts after it; ``stop_at`` (s):
        tasks still running then are stopped (terminate, then kill after 15 s) and stay unfinished
        for the next call. When a task ends, ``folder/run.json`` records the command, the working
        directory, the exit code, the GPU, the start time, the wall seconds and ``git`` (sha, dirty
        flag); a failed task's last log lines are printed.

    run_complete(folder, kind="train") -> bool
        A finished run folder: ``summary.json`` with status ok (``kind="eval"``: ``eval.json``
        exists), and, if the launcher recorded it, exit code 0 in ``run.json``.

    add_launch_args(parser)
        The flags every experiment takes for this: ``--parallel N``, ``--gpus 0 1 ...``,
        ``--per-gpu N``; ``launch_kwargs(args)`` turns them into run_tasks' keywords.

A large study on one multi-GPU machine, e.g. 256 runs over 8 GPUs, 4 runs per GPU:

    tasks = [Task(f"{arm}-s{seed}", cmd(arm, seed, out / f"{arm}-s{seed}"), out / f"{arm}-s{seed}") ...]
    run_tasks(tasks, gpus=["0", "1", "2", "3", "4", "5", "6", "7"], per_gpu=4, git=git_info())

and the same call again after an interruption runs only the tasks whose folders are not complete
(a training command with ``--resume-from auto`` continues each unfinished run from its last
checkpoint; with ``--overwrite`` it starts it over).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

POLL_S = 2.0  # seconds between polls of the running processes
PROGRESS_S = 60  # seconds between progress lines of the running tasks (a terminal: one line, redrawn each poll)
STOP_WAIT_S = 15  # seconds a stopped process gets to exit before it is killed


def run_complete(folder: Path, kind: str = "train") -> bool:
    """Finished: its summary says ok (eval: eval.json exists) and its process, if recorded, exited 0."""
    folder = Path(folder)
    f = folder / ("summary.json" if kind == "train" else "eval.json")
    if not f.exists():
        return False
    rec = folder / "run.json"
    try:
        if rec.exists() and json.loads(rec.read_text()).get("exit_code") != 0:
            return False
        return kind == "eval" or json.loads(f.read_text()).get("status") == "ok"
    except ValueError:  # a file cut off mid-write: not finished
        return False


@dataclass
class Task:
    """One run of the launcher: a command and its run folder (see the module docstring)."""

    name: str
    command: list[str]
    folder: Path
    done: Callable[[Path], bool] = run_complete
    planned: dict | None = None
    on_exit: Callable[[Task, int], None] | None = None
    record: dict = field(default_factory=dict)  # extra fields for run.json
    gpu: str | None = None  # pinned to this GPU of run_tasks' gpus (None: the least busy one)

    def is_done(self) -> bool:
        return self.folder.exists() and self.done(self.folder)


def resumable(tasks: list[Task]) -> list[Task]:
    """The tasks whose folders do not hold a finished run yet (what run_tasks would start)."""
    return [t for t in tasks if not t.is_done()]


def add_launch_args(ap: argparse.ArgumentParser, parallel: int = 1) -> None:
    ap.add_argument("--parallel", type=int, default=parallel, help="runs at once (processes), when --per-gpu is not set")
    ap.add_argument("--gpus", nargs="*", default=None, help="GPU ids; each run sees one of them")
    ap.add_argument("--per-gpu", type=int, default=None, help="runs at once on each GPU of --gpus (then "
                    "len(gpus) x per-gpu at once, --parallel ignored)")


def add_call_bounds(ap: argparse.ArgumentParser, stopped: str, not_started: str = "") -> None:
    """--time-budget / --stop-at (run_tasks' time_budget / stop_at: bound one call); ``stopped`` says what
    becomes of a run stopped by --stop-at, ``not_started`` of the runs the budget did not start."""
    ap.add_argument("--time-budget", type=float, default=0,
                    help="seconds after which no run starts (0: none)" + (f"; {not_started}" if not_started else ""))
    ap.add_argument("--stop-at", type=float, default=0, help=f"seconds after which running runs are stopped ({stopped})")


def launch_kwargs(args: argparse.Namespace) -> dict:
    """run_tasks' keywords from the flags of add_launch_args; bad values are a ValueError."""
    if args.parallel < 1:
        raise ValueError(f"--parallel must be >= 1, got {args.parallel}")
    if getattr(args, "per_gpu", None) is not None:
        if args.per_gpu < 1:
            raise ValueError(f"--per-gpu must be >= 1, got {args.per_gpu}")
        if not args.gpus:
            raise ValueError("--per-gpu needs --gpus (the GPU ids to spread the runs over)")
    return dict(parallel=args.parallel, gpus=args.gpus, per_gpu=getattr(args, "per_gpu", None))


def concurrency(parallel: int = 1, gpus: list | None = None, per_gpu: int | None = None) -> int:
    """How many tasks run_tasks runs at once with these keywords."""
    return len(gpus or []) * per_gpu if per_gpu is not None else max(parallel, 1)


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def run_progress(folder: Path) -> str:
    """A running training run's progress from its folder: "step k/N reward r" (or "starting")."""
    try:
        total = json.loads((folder / "config.json").read_text()).get("max_steps")
        last = None
        with (folder / "metrics.jsonl").open() as f:
            for line in f:
                if line.strip():
                    row = json.loads(line)
                    last = row if row.get("reward") is not None else last
    except (OSError, ValueError):
        return "starting"
    if last is None:
        return "evaluating" if total else "starting"
    return f"step {last['step']}/{total} reward {last['reward']:.3f}"


@dataclass
class _Running:
    proc: subprocess.Popen
    task: Task
    log: object
    gpu: str | None
    t0: float
    started: str


def _say(msg: str) -> None:
    print(("\r\x1b[K" if sys.stdout.isatty() else "") + msg, flush=True)


def run_tasks(tasks: list[Task], parallel: int = 1, gpus: list | None = None, per_gpu: int | None = None,
              time_budget: float = 0, stop_at: float = 0, env: dict | None = None,
              git: dict | None = None) -> dict[str, int]:
    """Run the tasks that are not done (see the module docstring). -> {task name: exit code}"""
    gpus = [str(g) for g in (gpus or [])]
    if per_gpu is not None and not gpus:
        raise ValueError("per_gpu needs gpus")
    slots = concurrency(parallel, gpus, per_gpu)
    stray = sorted({str(t.gpu) for t in tasks if t.gpu is not None} - set(gpus))
    if stray:
        raise ValueError(f"tasks pinned to GPUs {' '.join(stray)}, not among gpus {' '.join(gpus) or '(none)'}")
    base_env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "WANDB_SILENT": "true",
                "TOKENIZERS_PARALLELISM": "false", **(env or {})}
    todo = resumable(tasks)
    running: list[_Running] = []
    codes: dict[str, int] = {}
    t_start = last_progress = time.time()

    def next_task() -> tuple[int, str | None] | None:
        """The index in todo of the first task that can start now, and its GPU (None: CUDA_VISIBLE_DEVICES
        left alone)."""
        load = {g: sum(1 for r in running if r.gpu == g) for g in gpus}

        def free(g: str) -> bool:
            return per_gpu is None or load[g] < per_gpu

        for i, t in enumerate(todo):
            if t.gpu is not None:
                if free(str(t.gpu)):
                    return i, str(t.gpu)
                continue
            if not gpus:
                return i, None
            g = min(gpus, key=lambda g: load[g])
            return (i, g) if free(g) else None
        return None

    while todo or running:
        if stop_at and running and time.time() - t_start > stop_at:
            _say(f"stop-at {stop_at} s: stopping {len(running)} running runs ({' '.join(r.task.name for r in running)});"
                 " they stay unfinished")
            for r in running:
                r.proc.terminate()
            for r in running:
                try:
                    r.proc.wait(timeout=STOP_WAIT_S)
                except subprocess.TimeoutExpired:
                    r.proc.kill()
                    r.proc.wait()
            todo = []
        while todo and len(running) < slots:
            if time_budget and time.time() - t_start > time_budget:
                _say(f"time budget {time_budget} s spent: not starting {len(todo)} runs "
                     f"({' '.join(t.name for t in todo)})")
                todo = []
                break
            pick = next_task()
            if pick is None:
                break
            task, gpu = todo.pop(pick[0]), pick[1]
            task.folder.mkdir(parents=True, exist_ok=True)
            started = _now()
            if task.planned is not None:
                (task.folder / "planned.json").write_text(json.dumps(
                    {**task.planned, "command": shlex.join(task.command), "started": started}, indent=2, default=str))
            penv = dict(base_env)
            if gpu is not None:
                penv["CUDA_VISIBLE_DEVICES"] = gpu
            log = open(task.folder / "log.txt", "a")
            proc = subprocess.Popen(task.command, stdout=log, stderr=subprocess.STDOUT, env=penv)
            running.append(_Running(proc, task, log, gpu, time.time(), started))
        time.sleep(POLL_S)
        tty = sys.stdout.isatty()
        if running and (tty or time.time() - last_progress >= PROGRESS_S):
            last_progress = time.time()
            line = f"[{time.time() - t_start:6.0f}s] " + "; ".join(f"{r.task.name}: {run_progress(r.task.folder)}"
                                                                  for r in running)
            cols = shutil.get_terminal_size().columns - 1
            print(f"\r\x1b[K{line[:cols]}" if tty else line, end="" if tty else "\n", flush=True)
        for r in list(running):
            code = r.proc.poll()
            if code is None:
                continue
            running.remove(r)
            r.log.close()
            task = r.task
            (task.folder / "run.json").write_text(json.dumps(
                {"command": shlex.join(task.command), "cwd": os.getcwd(), "exit_code": code, "gpu": r.gpu,
                 "started": r.started, "wall_s": round(time.time() - r.t0, 1), **(git or {}), **task.record},
                indent=2, default=str))
            tail = (task.folder / "log.txt").read_text(errors="replace").splitlines()[-15:] if code else []
            if task.on_exit is not None:
                task.on_exit(task, code)
            codes[task.name] = code
            status = "ok" if code == 0 else f"FAILED (exit {code}; see {task.folder / 'log.txt'})"
            _say(f"[{time.time() - t_start:6.0f}s] {task.name}: {status} ({time.time() - r.t0:.0f} s; "
                 f"{len(todo)} to start, {len(running)} running)")
            if tail:
                print("\n".join(tail), flush=True)
    return codes
