"""Data-parallel RL across GPUs: a 2-GPU step equals a 1-GPU step, and how the step time scales.

Artefact: results/dist/<gpu>.json with gpu, git_sha, date, rows and a summary:
  step1_loss_rel_diff      |loss_2 - loss_1| / |loss_1| of the first RL step (target <= 1e-3)
  step1_gradnorm_rel_diff  the same for the LoRA gradient norm before clipping (target <= 1e-3)
  step_time_speedup_2gpu   median step time at 1 GPU / at 2 GPUs, same global batch (target >= 1.8)

Two checks, each run by ``qerl.train.train`` (the real loop) once in one process and once under
torchrun with --nproc-per-node GPUs (``--worker``, launched by this script as subprocesses):
  (a) equivalence: one step of the embedded SmolLM2-135M-Instruct on the built-in arith task, fp32
      (bf16 matmul results depend on the batch shape, fp32 ones only by rounding), nvfp4_lora on the
      reference matmul (dequantize + fp32 matmul); same global batch, seed, prompts, sampling keys.
  (b) scaling: a larger batch in bf16 (nvfp4_lora, the default Triton path), 1 warm-up step plus
      timed steps; the median of ``step_time`` (the slowest rank's) over the timed steps, with the
      rollout and update times beside it.

Command (one node with 2 GPUs; keep NVLink multicast off):
    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \\
        python -m benchmarks.dist_check --out results/dist/h200.json
Expected (an estimate, not yet measured): about 4-6 minutes on 2 H200s (model load and compilation in 2 launches, then
~1 min of steps). The last stdout line is the result as one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
TARGETS = {"step1_loss_rel_diff": ("<=", 1e-3), "step1_gradnorm_rel_diff": ("<=", 1e-3),
           "step_time_speedup_2gpu": (">=", 1.8)}
COMMON = dict(dataset="arith", arith_levels=(0,), eval_datasets=(), save_every=0,
              wandb_mode="disabled", num_iterations=1, mini_batch_size=0, learning_rate=2e-4, lora_rank=32,
              lora_alpha=64, loss_type="bnpo", seed=0)


def phase_configs(a) -> dict[str, dict]:
    """The TrainConfig overrides of each check (profile "small" underneath)."""
    return {
        "equivalence": dict(COMMON, model=a.model, method=a.eq_method, dtype="float32", backend=a.eq_backend, engine=a.eq_engine,
                            max_steps=1,
                            prompts_per_step=a.eq_prompts, num_generations=8, max_completion_length=a.eq_len,
                            micro_batch_size=a.eq_micro),
        "scaling": dict(COMMON, model=a.time_model or a.model, method=a.time_method, dtype="bfloat16", engine=a.time_engine, max_steps=1 + a.time_steps,
                        prompts_per_step=a.time_prompts, num_generations=8, max_completion_length=a.time_len,
                        micro_batch_size=a.time_micro),
    }


# ----------------------------------------------------------------------------- worker (under torchrun)
def reward_kind(requested: str) -> str:
    """"math-verify" (qerl.rewards, the trainer's reward) when importable, else "last-number"."""
    if requested != "auto":
        return requested
    try:
        import math_verify  # noqa: F401
    except ImportError:
        return "last-number"
    return "math-verify"


def last_number_score_batch(completions, golds, **kw):
    """Exact match of the completion's answer (qerl's extraction, else its last number) with the
    integer gold of the arith task: a stand-in reward where math-verify is not installed (without
    it qerl.rewards scores every completion 0, and a step with no advantage proves nothing)."""
    import re

    from qerl import rewards as qrewards

    rewards, sources, unparsed = [], [], 0
    for c, g in zip(completions, golds):
        cand, src = qrewards.extract_answer(c, fallback=True)
        nums = re.findall(r"-?\d+(?:\.\d+)?", cand if cand is not None else c)
        rewards.append(float(bool(nums) and float(nums[-1]) == float(g)))
        unparsed += not nums
        sources.append(src if cand is not None else "none")
    return qrewards.RewardResult(rewards=rewards, format=[qrewards.format_reward(c) for c in completions],
                                 unparsed=unparsed, sources=sources)


def worker(a) -> None:
    import torch

    from qerl import distributed as qdist
    from qerl.config import make_config
    from qerl.logging import read_metrics
    from qerl.train import train

    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 means fp32 in the equivalence check
    torch.backends.cudnn.allow_tf32 = False
    if reward_kind(a.reward) == "last-number":
        from qerl import rewards as qrewards

        qrewards.score_batch = last_number_score_batch
    qdist.init()
    rank, world = qdist.world()
    out: dict = {"world_size": world, "phases": {}}
    for phase, over in phase_configs(a).items():
        run_dir = Path(a.work_dir) / f"{phase}-w{world}"
        t0 = time.perf_counter()
        train(make_config("small", output_dir=str(run_dir), **over))
        rows = read_metrics(run_dir) if rank == 0 else []
        out["phases"][phase] = {"wall_s": time.perf_counter() - t0, "rows": rows}
        torch.cuda.empty_cache()
    if rank == 0:
        Path(a.part).write_text(json.dumps(out))
    qdist.barrier()
    qdist.cleanup()


# ----------------------------------------------------------------------------- driver
def launch(a, nproc: int, part: Path) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           "-m", "benchmarks.dist_check", "--worker", "--part", str(part), "--work-dir", a.work_dir]
    for k, v in vars(a).items():
        if (k.startswith(("eq_", "time_")) or k in ("reward", "model")) and v is not None:
            cmd += [f"--{k.replace('_', '-')}", str(v)]
    env = {**os.environ, **{k: os.environ.get(k, v) for k, v in MULTICAST_OFF.items()}}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env.setdefault("OMP_NUM_THREADS", "4")  # the same for both launches (torchrun would set 1 for nproc > 1)
    print(f"[dist_check] {' '.join(cmd[2:6])} {nproc} ...", flush=True)
    t0 = time.perf_counter()
    subprocess.run(cmd, env=env, check=True, cwd=ROOT)
    print(f"[dist_check] nproc {nproc} done in {time.perf_counter() - t0:.0f} s", flush=True)


def rel(a: float, b: float) -> float | None:
    """|a - b| / |b|; None where b is 0 (a step without signal proves nothing)."""
    return abs(a - b) / abs(b) if b else None


def gpu_name() -> tuple[str, str]:
    import torch

    full = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    for short in ("h200", "h100", "a100", "l40s", "b200"):
        if short in full.lower():
            return short, full
    return full.lower().replace("nvidia ", "").replace(" ", "-"), full


def summarize(a, parts: dict[int, dict]) -> dict:
    from qerl.logging import environment

    n = a.nproc
    rows = []
    eq = {w: parts[w]["phases"]["equivalence"]["rows"][0] for w in (1, n)}
    for w in (1, n):
        r = eq[w]
        rows.append({"check": "step1_equivalence", "world_size": w, "loss": r["loss"], "grad_norm": r["grad_norm"],
                     "reward": r["reward"], "num_tokens": r["num_tokens"], "entropy": r["entropy"],
                     "completions/mean_length": r["completions/mean_length"]})
    timing = {}
    for w in (1, n):
        steps = [r for r in parts[w]["phases"]["scaling"]["rows"] if "step_time" in r][1:]  # drop the warm-up
        med = {k: statistics.median(r[k] for r in steps) for k in ("step_time", "time/rollout_s", "time/train_s")}
        timing[w] = med
        first = parts[w]["phases"]["scaling"]["rows"][0]
        rows.append({"check": "step_time", "world_size": w, "timed_steps": len(steps),
                     "step_time_median_s": med["step_time"], "rollout_s_median": med["time/rollout_s"],
                     "train_s_median": med["time/train_s"], "rollout_share": med["time/rollout_s"] / med["step_time"],
                     "step_times_s": [r["step_time"] for r in steps],
                     "completion_tokens_per_step": [r["throughput/rollout_tokens_per_s"] * r["time/rollout_s"]
                                                    for r in steps],
                     "memory_peak_gib": max(r["memory/peak_gib"] for r in steps),
                     "bf16_step1_loss": first["loss"], "bf16_step1_grad_norm": first["grad_norm"]})
    rows.append({"check": "speedup", "world_size": n,
                 "step_time": timing[1]["step_time"] / timing[n]["step_time"],
                 "rollout": timing[1]["time/rollout_s"] / timing[n]["time/rollout_s"],
                 "train": timing[1]["time/train_s"] / timing[n]["time/train_s"]})
    if not eq[1]["grad_norm"] or not eq[1]["loss"]:  # all advantages 0: nothing to compare
        print("[dist_check] WARNING: the equivalence step had no learning signal (loss or gradient 0); "
              "raise --eq-prompts / --eq-len")
    summary = {"step1_loss_rel_diff": rel(eq[n]["loss"], eq[1]["loss"]),
               "step1_gradnorm_rel_diff": rel(eq[n]["grad_norm"], eq[1]["grad_norm"]),
               f"step_time_speedup_{n}gpu": timing[1]["step_time"] / timing[n]["step_time"]}
    env = environment()
    short, full = gpu_name()
    return {"gpu": a.gpu or short, "git_sha": env["git_sha"], "date": env["date"], "device": full,
            "nproc": n, "reward": reward_kind(a.reward), "torch": env["torch"], "transformers": env["transformers"], "triton": env["triton"],
            "multicast_env": {k: os.environ.get(k) for k in MULTICAST_OFF}, "configs": phase_configs(a),
            "targets": {k: list(v) for k, v in TARGETS.items()}, "rows": rows, "summary": summary}


def print_table(res: dict) -> None:
    print(f"\n{'check':<20}{'world':>6}  values")
    for r in res["rows"]:
        vals = {k: v for k, v in r.items() if k not in ("check", "world_size") and not isinstance(v, list)}
        print(f"{r['check']:<20}{r['world_size']:>6}  " + ", ".join(
            f"{k}={v:.6g}" if isinstance(v, float) else f"{k}={v}" for k, v in vals.items()))
    for k, v in res["summary"].items():
        op, t = TARGETS.get(k, ("", None))
        if v is None:
            print(f"{k:<28}None   target {op} {t}  NOT MEASURED")
            continue
        ok = "" if t is None else ("  ok" if (v <= t if op == "<=" else v >= t) else "  MISSED")
        print(f"{k:<28}{v:.4g}   target {op} {t}{ok}")


def main() -> None:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    p.add_argument("--out", default=None, help="result JSON (default results/dist/<gpu>.json)")
    p.add_argument("--gpu", default=None, help="short GPU name for the file (default from torch, e.g. h200)")
    p.add_argument("--nproc", type=int, default=2, help="GPUs of the data-parallel run")
    p.add_argument("--work-dir", default=None, help="run folders (default: a temporary folder)")
    p.add_argument("--model", default="smollm2-135m-instruct", help="hub id, local folder, .gguf or the embedded default")
    p.add_argument("--eq-method", default="nvfp4_lora")
    p.add_argument("--eq-backend", default="reference", help="4-bit matmul of the fp32 equivalence run")
    p.add_argument("--eq-engine", default="auto", help="rollout engine: auto | fast | hf")
    p.add_argument("--eq-prompts", type=int, default=16, help="prompts of the step (x 8 samples)")
    p.add_argument("--eq-len", type=int, default=128, help="max completion tokens")
    p.add_argument("--eq-micro", type=int, default=32, help="micro-batch (completions per forward/backward)")
    p.add_argument("--time-model", default=None,
                   help="model of the timing run (default --model); e.g. random:qwen2.5-3b-instruct, random weights "
                        "of a larger architecture, so that each GPU's share is throughput-bound")
    p.add_argument("--time-method", default="nvfp4_lora")
    p.add_argument("--time-engine", default="auto", help="rollout engine: auto | fast | hf")
    p.add_argument("--time-prompts", type=int, default=128, help="prompts per step (x 8 samples) of the timing run")
    p.add_argument("--time-len", type=int, default=256, help="max completion tokens of the timing run")
    p.add_argument("--time-micro", type=int, default=64)
    p.add_argument("--time-steps", type=int, default=3, help="timed steps after 1 warm-up step")
    p.add_argument("--reward", default="auto", choices=("auto", "math-verify", "last-number"),
                   help="auto: qerl.rewards (math-verify) if installed, else last-number exact match")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--part", default=None, help=argparse.SUPPRESS)
    p.add_argument("--allow-cpu", action="store_true", help="run on the CPU with gloo (a plumbing check, no timings)")
    a = p.parse_args()
    if a.worker:
        worker(a)
        return
    import torch

    if torch.cuda.device_count() < a.nproc and not a.allow_cpu:
        raise SystemExit(f"dist_check needs {a.nproc} GPUs, found {torch.cuda.device_count()}")
    tmp = tempfile.TemporaryDirectory(prefix="qerl-dist-")
    a.work_dir = a.work_dir or tmp.name
    parts = {}
    for n in (1, a.nproc):
        part = Path(a.work_dir) / f"part-w{n}.json"
        launch(a, n, part)
        parts[n] = json.loads(part.read_text())
    res = summarize(a, parts)
    out = Path(a.out or ROOT / "results" / "dist" / f"{res['gpu']}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2))
    print_table(res)
    print(f"wrote {out}")
    print(json.dumps(res["summary"]))


if __name__ == "__main__":
    main()
