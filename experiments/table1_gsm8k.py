"""Paper Table 1 (GSM8K, GRPO): every row, at a chosen profile.

Rows: the untrained base in bf16 / nf4 / mxfp4 / nvfp4; BF16 full fine-tuning; BF16 LoRA,
NF4 LoRA, MXFP4 LoRA, NVFP4 LoRA and NVFP4 LoRA + AQN over several seeds. Each training row is a
`qerl.train.train` run in its own process (several at once with --parallel; the 135M model leaves
a GPU mostly idle), writing runs/<profile>/<run>/ and a copy of its config / metrics / summary
into results/table1/<profile>/runs/<run>/. Rows with a finished summary are skipped, so a rerun
resumes. At the end, results/table1/<profile>/table.csv (long form: model, method, dataset,
metric, value, seed, run, git_sha) is rebuilt from the run folders.

    python experiments/table1_gsm8k.py --profile small --parallel 16   # one GPU, ~10 min (H200)
    python experiments/table1_gsm8k.py --profile smoke --methods nvfp4_lora --seeds 0   # CPU, minutes
    python experiments/table1_gsm8k.py --profile paper --model Qwen/Qwen2.5-7B-Instruct  # the user's GPUs

small = the embedded SmolLM2-135M-Instruct on the built-in arith task (levels 0-1), where the
model starts at ~15% and can learn; paper = Qwen2.5-3B/7B-Instruct on GSM8K with Table 4 settings.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from qerl.config import METHODS, make_config  # noqa: E402
from qerl.logging import git_info  # noqa: E402

BASE_ROWS = ("bf16", "nf4", "mxfp4", "nvfp4")  # untrained rows
SEEDED = ("bf16_lora", "nf4_lora", "mxfp4_lora", "nvfp4_lora", "nvfp4_lora_aqn")
FULL_FT_LR = 1e-5  # full fine-tuning moves every weight: a LoRA learning rate would wreck it
PAPER_TABLE1 = {  # reference only: GSM8K accuracy (%), Qwen2.5-7B-Instruct, paper Table 1
    "bf16": 76.3, "bf16_full": 91.2, "bf16_lora": 88.1, "nf4_lora": 85.0, "nvfp4_lora": 88.5, "nvfp4_lora_aqn": 90.8}


def run_cmd(kind: str, name: str, args, run_dir: Path) -> list[str]:
    py = [sys.executable, "-m", "qerl"]
    if kind == "train":
        return py + ["train", "--profile", args.profile, "--output-dir", str(run_dir), *name_args(name, args)]
    fmt = name.removeprefix("base-")
    cfg = make_config(args.profile, **({"model": args.model} if args.model else {}))
    return py + ["eval", "--model", cfg.model, "--method", fmt, "--datasets", *cfg.eval_datasets,
                 "--limit", str(cfg.eval_limit), "--samples", str(cfg.eval_samples), "--temperature",
                 str(cfg.eval_temperature), "--top-p", str(cfg.eval_top_p), "--max-new-tokens",
                 str(cfg.eval_max_completion_length or cfg.max_completion_length), "--batch-size",
                 str(max(cfg.micro_batch_size, 8)), "--out", str(run_dir / "eval.json"),
                 "--arith-levels", *map(str, cfg.arith_levels), "--seed", str(args.seeds[0]),
                 *(["--data-dir", args.data_dir] if args.data_dir else [])]


def name_args(name: str, args) -> list[str]:
    method, seed = name.rsplit("-s", 1)
    out = ["--method", method, "--seed", seed, "--wandb-group", f"table1-{args.profile}"]
    if method == "bf16_full":
        out += ["--learning-rate", str(FULL_FT_LR)]
    if args.model:
        out += ["--model", args.model]
    if args.data_dir:
        out += ["--data-dir", args.data_dir]
    if args.max_steps:
        out += ["--max-steps", str(args.max_steps)]
    return out


def is_done(kind: str, res_dir: Path) -> bool:
    f = res_dir / ("summary.json" if kind == "train" else "eval.json")
    if not f.exists():
        return False
    return kind == "eval" or json.loads(f.read_text()).get("status") == "ok"


def collect(res_root: Path, profile: str, model: str) -> list[dict]:
    rows, sha = [], git_info()["git_sha"]
    for d in sorted((res_root / "runs").glob("*")):
        if (d / "eval.json").exists():  # an untrained row
            ev = json.loads((d / "eval.json").read_text())
            for ds, r in ev["results"].items():
                rows.append(dict(model=model, method=d.name.removeprefix("base-"), dataset=ds, metric="accuracy",
                                 value=r["accuracy"], seed="", run=d.name,
                                 git_sha=(ev.get("provenance") or {}).get("git_sha") or sha))
        elif (d / "summary.json").exists():
            s = json.loads((d / "summary.json").read_text())
            cfg = json.loads((d / "config.json").read_text())
            for k, v in s.items():
                if k.startswith(("eval/", "eval_before/")) and v is not None:
                    _, ds, metric = k.split("/")
                    metric = metric if k.startswith("eval/") else f"{metric}_before"
                    rows.append(dict(model=model, method=cfg["method"], dataset=ds, metric=metric, value=v,
                                     seed=cfg["seed"], run=d.name, git_sha=cfg["provenance"]["git_sha"]))
    with (res_root / "table.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["model", "method", "dataset", "metric", "value", "seed", "run", "git_sha"])
        w.writeheader()
        w.writerows(rows)
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", default="small", choices=("smoke", "small", "paper"))
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    ap.add_argument("--base-rows", nargs="*", default=list(BASE_ROWS), choices=BASE_ROWS)
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    ap.add_argument("--parallel", type=int, default=1, help="runs at once (processes)")
    ap.add_argument("--model", default=None, help="override the profile's model")
    ap.add_argument("--data-dir", default=os.environ.get("QERL_DATA_DIR"))
    ap.add_argument("--max-steps", type=int, default=0, help="override the profile's max_steps (0 = keep)")
    ap.add_argument("--runs-dir", default="runs", help="where full run folders (checkpoints, wandb) go")
    ap.add_argument("--results", default="results/table1")
    args = ap.parse_args(argv)
    res_root = Path(args.results) / args.profile
    model = args.model or make_config(args.profile).model
    jobs = [("eval", f"base-{f}") for f in args.base_rows]
    for m in args.methods:
        seeds = args.seeds if m in SEEDED else args.seeds[:1]
        jobs += [("train", f"{m}-s{s}") for s in seeds]
    todo = [(k, n) for k, n in jobs if not is_done(k, res_root / "runs" / n)]
    print(f"table1[{args.profile}]: {len(jobs)} rows, {len(jobs) - len(todo)} done, running {len(todo)} "
          f"({args.parallel} at a time)", flush=True)
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "WANDB_SILENT": "true"}
    running: list = []
    t0 = time.time()
    while todo or running:
        while todo and len(running) < args.parallel:
            kind, name = todo.pop(0)
            run_dir = Path(args.runs_dir) / args.profile / name
            run_dir.mkdir(parents=True, exist_ok=True)
            log = open(run_dir / "log.txt", "w")
            p = subprocess.Popen(run_cmd(kind, name, args, run_dir), stdout=log, stderr=subprocess.STDOUT, env=env)
            running.append((p, kind, name, run_dir, log))
        time.sleep(2)
        for item in list(running):
            p, kind, name, run_dir, log = item
            if p.poll() is None:
                continue
            running.remove(item)
            log.close()
            dest = res_root / "runs" / name
            dest.mkdir(parents=True, exist_ok=True)
            for f in ("config.json", "metrics.jsonl", "summary.json", "eval.json"):
                if (run_dir / f).exists():
                    shutil.copy(run_dir / f, dest / f)
            status = "ok" if p.returncode == 0 else f"FAILED (exit {p.returncode}; see {run_dir / 'log.txt'})"
            print(f"[{time.time() - t0:6.0f}s] {name}: {status}", flush=True)
            if p.returncode != 0:
                print("".join((run_dir / "log.txt").read_text().splitlines(True)[-15:]), flush=True)
    rows = collect(res_root, args.profile, model)
    print(f"wrote {res_root / 'table.csv'} ({len(rows)} rows)")


if __name__ == "__main__":
    main()
