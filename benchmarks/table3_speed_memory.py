"""Table 3 (speed and memory; issue #6): the wall time of one full GRPO step (rollout, log-prob
computation, policy update) and peak GPU memory for bf16 LoRA, QLoRA (bitsandbytes NF4) and qerl
NVFP4 (MXFP4 optional) on the Qwen2.5-7B/14B/32B architectures with random weights, batch 2/4/8,
prompt 256, completion 2048 at fixed length, with and without gradient checkpointing; model
sizes; the rollout share of the step. Also the paper's headline: the 32B model on one 80 GB GPU
(`--memory-cap-gib 80` caps this process with torch.cuda.set_per_process_memory_fraction on a
larger GPU), NVFP4 at batch 2 and 8, and bf16 LoRA under the same cap (an OOM is caught, reported
with the phase it happened in, and the run goes on).

One step, from qerl's public pieces (what qerl.train.rl_step does, minus rewards: random weights
give meaningless text, so the advantages are random normal; the timing is what matters):
  rollout  engine.generate(B random prompts, C tokens, T=1.0, ignore_eos=True): the fast engine
           (static KV cache, CUDA graphs) on the training model's own weights
  logprob  old log-probs: qerl.rollout.sequence_logprobs under no_grad, in micro-batches
  update   one optimizer step: per micro-batch sequence_logprobs (with entropy, as rl_step) ->
           qerl.loss.policy_loss (grpo, epsilon 0.2) -> backward; clip_grad_norm_ 1.0; AdamW-8bit
           (bitsandbytes, the paper's Table 4) when importable, else torch AdamW
The GPU is synchronized between phases. Before the timed step, a warm-up captures the engine's CUDA
graphs with short calls and runs one micro-batch of each training phase at full length (Triton
autotuning keys on the GEMM shapes), so the timed step measures steady state.

Writes <out>/<gpu>.json with gpu, git_sha, date, env, rows (one per model x method x batch x
gradient checkpointing; oom/oom_phase/error when it failed), the paper's values as a labelled
reference, and `summary` with exactly the keys of issue #6; prints a table; the last stdout line
is the summary as one JSON object. notebooks/table3.ipynb plots where the step time goes.

Run (GPU; expected minutes on an H200 in brackets; must-have rows first):
  python -m benchmarks.table3_speed_memory --models qwen2.5-7b qwen2.5-14b --batch 8          [~8]
  python -m benchmarks.table3_speed_memory --models qwen2.5-32b --methods nvfp4 bf16 \\
      --batch 2 8 --memory-cap-gib 80                                                          [~5]
  python -m benchmarks.table3_speed_memory --models qwen2.5-7b --batch 2 4 8 --grad-ckpt on off \\
      --completion 512                                                                         (optional)
  python -m benchmarks.table3_speed_memory --merge a/h200.json b/h200.json --out results/table3   (CPU)
"""

from __future__ import annotations

import argparse
import json
import time
import traceback
from pathlib import Path

import torch

from benchmarks import speed_common as sc  # noqa: E402
from qerl import loss as qloss  # noqa: E402
from qerl.config import QERL_FORMAT, QLORA_FORMAT, table_bases  # noqa: E402
from qerl.quantize import lora_parameters  # noqa: E402
from qerl.rollout import RolloutOutput, sequence_logprobs  # noqa: E402

METHODS = table_bases()  # bf16 and every registered format
SUMMARY_KEYS = (
    "qwen2.5-14b/bs8/e2e_nvfp4_over_bf16",
    "qwen2.5-7b/bs8/e2e_nvfp4_over_bf16",
    "qwen2.5-14b/bs8/e2e_nvfp4_over_nf4",
    "qwen2.5-32b/bs2/peak_gib",
    "qwen2.5-32b/bs8/peak_gib",
    "qwen2.5-32b/bs2/s_per_step",
    "qwen2.5-32b/bs8/s_per_step",
    "qwen2.5-32b/memory_cap_gib",
    "qwen2.5-32b/bf16_lora_oom",
)
TARGETS = {
    "qwen2.5-14b/bs8/e2e_nvfp4_over_bf16": ">= 1.7",
    "qwen2.5-7b/bs8/e2e_nvfp4_over_bf16": ">= 1.5 (paper x1.2 to x1.5)",
    "qwen2.5-14b/bs8/e2e_nvfp4_over_nf4": ">= 2.0",
    "qwen2.5-32b/bs2/peak_gib": "<= 70",
    "qwen2.5-32b/bs8/peak_gib": "<= 70",
    "qwen2.5-32b/bs2/s_per_step": "measured (completion length in summary_notes)",
    "qwen2.5-32b/bs8/s_per_step": "measured (completion length in summary_notes)",
    "qwen2.5-32b/memory_cap_gib": "80",
    "qwen2.5-32b/bf16_lora_oom": "true",
}
# The paper's values (one H100 80GB, vLLM rollouts, its own training stack), as transcribed in
# ../shared/DESIGN.md: a labelled reference only.
PAPER = {
    "model_size_gb": {"qwen2.5-7b/bf16": 15.2, "qwen2.5-7b/nvfp4": 5.9, "qwen2.5-14b/bf16": 29.6,
                      "qwen2.5-14b/nvfp4": 10.6, "qwen2.5-32b/bf16": 62.3, "qwen2.5-32b/nvfp4": 20.7},
    "s_per_step": {"qwen2.5-32b/nvfp4/bs2": 10.6, "qwen2.5-32b/nvfp4/bs8": 12.2},
    "e2e_speedup_over_bf16": {QERL_FORMAT: "x1.2 to x1.5", QLORA_FORMAT: "x0.7 to x0.8"},
    "source": "QeRL paper Table 3 (H100 80GB, gradient checkpointing), via ../shared/DESIGN.md; reference only",
}


# ----------------------------------------------------------------------------------------------
# one GRPO step


def make_optimizer(params, lr: float = 1e-5):
    """AdamW-8bit (bitsandbytes, the paper's Table 4) on CUDA when importable, else torch AdamW."""
    if params and params[0].is_cuda:
        try:
            import bitsandbytes as bnb

            return bnb.optim.AdamW8bit(params, lr=lr), "adamw_8bit"
        except Exception:  # noqa: BLE001 - fall back, and say so in the row
            pass
    return torch.optim.AdamW(params, lr=lr), "adamw"


def synthetic_rollout(batch: int, prompt_len: int, completion_len: int, vocab: int, device, seed: int = 0) -> RolloutOutput:
    """A RolloutOutput of random tokens (for warming up the training phases without generating)."""
    ids = torch.tensor(sc.random_prompts(batch, prompt_len + completion_len, vocab, seed), device=device)
    ones = torch.ones_like(ids)
    z = torch.zeros((batch, completion_len), dtype=torch.float32, device=device)
    return RolloutOutput(ids[:, :prompt_len], ones[:, :prompt_len], ids[:, prompt_len:], ones[:, prompt_len:], z, z.clone(),
                         torch.ones(batch, dtype=torch.bool, device=device))


def rollout_phase(engine, batch: int, prompt_len: int, completion_len: int, vocab: int, seed: int) -> RolloutOutput:
    ro = engine.generate(sc.random_prompts(batch, prompt_len, vocab, seed), completion_len, seed=seed, **sc.SAMPLING)
    if ro.completion_ids.shape[1] != completion_len:
        raise RuntimeError(f"rollout returned {ro.completion_ids.shape[1]} tokens, expected {completion_len}")
    return ro


def logprob_phase(model, ro: RolloutOutput, micro_batch: int) -> torch.Tensor:
    """Old log-probs of the sampled completions (no grad), micro-batched as rl_step does."""
    old = torch.zeros_like(ro.logprobs)
    with torch.no_grad():
        for s in range(0, ro.completion_ids.size(0), micro_batch):
            sl = slice(s, s + micro_batch)
            old[sl], _ = sequence_logprobs(model, ro.prompt_ids[sl], ro.prompt_mask[sl], ro.completion_ids[sl],
                                           ro.completion_mask[sl], 1.0)
    return old


def update_phase(model, ro: RolloutOutput, old_lp: torch.Tensor, adv: torch.Tensor, opt, trainable, micro_batch: int,
                 completion_len: int, loss_type: str = "grpo", max_micro: int | None = None) -> float:
    """One optimizer step over the batch in micro-batches (rl_step's update, one iteration)."""
    model.train()
    B = ro.completion_ids.size(0)
    micro = [slice(s, s + micro_batch) for s in range(0, B, micro_batch)][:max_micro]
    n_tokens = int(ro.completion_mask.sum())
    opt.zero_grad(set_to_none=True)
    total = 0.0
    for sl in micro:
        lp, _ = sequence_logprobs(model, ro.prompt_ids[sl], ro.prompt_mask[sl], ro.completion_ids[sl],
                                  ro.completion_mask[sl], 1.0, with_entropy=True)
        loss, _ = qloss.policy_loss(lp, old_lp[sl], adv[sl], ro.completion_mask[sl], loss_type, epsilon=0.2,
                                    num_items_in_batch=n_tokens, max_completion_length=completion_len,
                                    gradient_accumulation_steps=len(micro))
        loss.backward()
        total += loss.detach()
        del lp, loss
    torch.nn.utils.clip_grad_norm_(trainable, 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    model.eval()
    return float(total)


def grpo_step(model, engine, opt, trainable, batch: int, prompt_len: int, completion_len: int, vocab: int,
              micro_batch: int, seed: int, phases: sc.Phases) -> dict:
    """One timed GRPO step; phases.seconds gets rollout / logprob / update."""
    device = model.get_input_embeddings().weight.device
    model.eval()
    with phases("rollout"):
        ro = rollout_phase(engine, batch, prompt_len, completion_len, vocab, seed)
    with phases("logprob"):
        old = logprob_phase(model, ro, micro_batch)
    adv = torch.randn(batch, generator=torch.Generator().manual_seed(seed)).to(device)
    with phases("update"):
        loss = update_phase(model, ro, old, adv, opt, trainable, micro_batch, completion_len)
    return {"loss": loss, "completion_tokens": int(ro.completion_mask.sum())}


def warm_up(model, engine, opt, trainable, batch, prompt_len, completion_len, vocab, micro_batch) -> float:
    """Engine graphs (short calls) + one full-length micro-batch of each training phase."""
    t0 = time.perf_counter()
    sc.warm_up_engine(engine, batch, prompt_len, completion_len, vocab)
    device = model.get_input_embeddings().weight.device
    ro = synthetic_rollout(micro_batch, prompt_len, completion_len, vocab, device, seed=1)
    old = logprob_phase(model, ro, micro_batch)
    update_phase(model, ro, old, torch.randn(micro_batch, device=device), opt, trainable, micro_batch, completion_len)
    sc.sync()
    return time.perf_counter() - t0


def set_grad_ckpt(model, on: bool) -> None:
    if on:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    elif getattr(model, "is_gradient_checkpointing", False):
        model.gradient_checkpointing_disable()


def measure(model, model_key, method, batch, grad_ckpt, args, vocab, opt, opt_name, trainable, extra) -> dict:
    """One row: warm-up and a timed step; an OOM (or other failure) is recorded with its phase."""
    row = dict(model=model_key, method=method, batch=batch, grad_ckpt=grad_ckpt, micro_batch=args.micro_batch,
               prompt_len=args.prompt, completion_len=args.completion, optimizer=opt_name, oom=False, **extra)
    ph = sc.Phases()
    engine = None
    try:
        set_grad_ckpt(model, grad_ckpt)
        with ph("engine"):
            engine = sc.make_fast_engine(model, batch, args.prompt + args.completion)
        with ph("warmup"):
            warm_up(model, engine, opt, trainable, batch, args.prompt, args.completion, vocab, args.micro_batch)
        sc.reset_peak()
        timed = sc.Phases()
        ph = timed  # so that an OOM in the timed step reports its phase
        t0 = time.perf_counter()
        info = grpo_step(model, engine, opt, trainable, batch, args.prompt, args.completion, vocab,
                         args.micro_batch, args.seed, timed)
        step = time.perf_counter() - t0
        s = timed.seconds
        row.update(rollout_s=s["rollout"], logprob_s=s["logprob"], update_s=s["update"], step_s=step,
                   rollout_share=s["rollout"] / step, peak_gib=sc.peak_gib(),
                   rollout_tokens_per_s=batch * args.completion / s["rollout"], **info)
    except Exception as e:  # noqa: BLE001 - a row must never take the run down
        row["oom"] = sc.is_oom(e)
        row["oom_phase" if row["oom"] else "failed_phase"] = ph.current
        row["error"] = f"{type(e).__name__}: {str(e)[:500]}"
        if not row["oom"]:
            traceback.print_exc()
        print(f"  {'OOM' if row['oom'] else 'FAILED'} in phase {ph.current}: {row['error'][:200]}")
    finally:
        del engine
        opt.zero_grad(set_to_none=True)
        model.eval()
        sc.free()
    return row


# ----------------------------------------------------------------------------------------------
# summary


def _row(rows, model, method, batch, grad_ckpt=True):
    hits = [r for r in rows if r.get("model") == model and r.get("method") == method and r.get("batch") == batch
            and r.get("grad_ckpt") == grad_ckpt and r.get("step_s")]
    return max(hits, key=lambda r: r["completion_len"]) if hits else None


def summarize(rows: list[dict]) -> tuple[dict, dict]:
    """(summary with exactly SUMMARY_KEYS, notes on which rows each value came from)."""
    s, notes = {}, {}

    def ratio(key, model, num, den):
        a, b = _row(rows, model, num, 8), _row(rows, model, den, 8)
        if a and b and a["completion_len"] != b["completion_len"]:
            a = b = None
        s[key] = b["step_s"] / a["step_s"] if a and b else None
        notes[key] = (f"{den} step_s / {num} step_s, bs8, grad ckpt on, C={a['completion_len']}" if a and b else None)

    ratio("qwen2.5-14b/bs8/e2e_nvfp4_over_bf16", "qwen2.5-14b", "nvfp4", "bf16")
    ratio("qwen2.5-7b/bs8/e2e_nvfp4_over_bf16", "qwen2.5-7b", "nvfp4", "bf16")
    ratio("qwen2.5-14b/bs8/e2e_nvfp4_over_nf4", "qwen2.5-14b", "nvfp4", "nf4")
    for b in (2, 8):
        r = _row(rows, "qwen2.5-32b", "nvfp4", b)
        s[f"qwen2.5-32b/bs{b}/peak_gib"] = r["peak_gib"] if r else None
        s[f"qwen2.5-32b/bs{b}/s_per_step"] = r["step_s"] if r else None
        note = (f"nvfp4, grad ckpt on, prompt {r['prompt_len']}, completion {r['completion_len']} tokens, "
                f"micro-batch {r['micro_batch']}, cap {r.get('memory_cap_gib')} GiB") if r else None
        notes[f"qwen2.5-32b/bs{b}/peak_gib"] = notes[f"qwen2.5-32b/bs{b}/s_per_step"] = note
    caps = {r.get("memory_cap_gib") for r in rows if r.get("model") == "qwen2.5-32b"}
    s["qwen2.5-32b/memory_cap_gib"] = caps.pop() if len(caps) == 1 else None
    notes["qwen2.5-32b/memory_cap_gib"] = None if len(caps) == 0 else "rows of several caps: see rows"
    bf = [r for r in rows if r.get("model") == "qwen2.5-32b" and r.get("method") == "bf16"]
    s["qwen2.5-32b/bf16_lora_oom"] = any(r.get("oom") for r in bf) if bf else None
    oomed = [f"bs{r['batch']} in {r.get('oom_phase')}" for r in bf if r.get("oom")]
    notes["qwen2.5-32b/bf16_lora_oom"] = (f"OOM: {', '.join(oomed)}" if oomed else "no OOM") if bf else None
    return {k: s[k] for k in SUMMARY_KEYS}, notes


def assemble(rows, prov, settings) -> dict:
    summary, notes = summarize(rows)
    for r in rows:
        r["paper_model_size_gb"] = PAPER["model_size_gb"].get(f"{r.get('model')}/{r.get('method')}")
        r["paper_s_per_step"] = PAPER["s_per_step"].get(f"{r.get('model')}/{r.get('method')}/bs{r.get('batch')}")
    out = {**prov, "settings": settings, "targets": TARGETS, "paper_reference": PAPER, "summary": summary,
           "summary_notes": notes, "rows": rows}
    if prov.get("gpu") == "h200":
        out["gpu_note"] = ("Measured on an H200 (141 GB); the paper used one H100 80GB. The 32B rows run under a "
                           "per-process cap (memory_cap_gib) to stand for the 80 GB GPU.")
    return out


def merge(paths, out):
    files = [json.loads(Path(p).read_text()) for p in paths]
    if len({f["gpu"] for f in files}) != 1:
        raise SystemExit("refusing to merge results from different GPUs")
    keyed = {}
    for f in files:
        for r in f["rows"]:
            keyed[(r.get("model"), r.get("method"), r.get("batch"), r.get("grad_ckpt"), r.get("completion_len"),
                   r.get("memory_cap_gib"))] = r
    prov = {k: files[-1][k] for k in ("gpu", "git_sha", "date", "env")}
    prov["runs"] = [{"file": str(p), "git_sha": f.get("git_sha"), "date": f.get("date"), "settings": f.get("settings")}
                    for p, f in zip(paths, files)]
    result = assemble(list(keyed.values()), prov, {"merged": list(map(str, paths))})
    print(f"merged {len(paths)} files, {len(keyed)} rows -> {sc.write_json(result, out, prov['gpu'])}")
    return result


# ----------------------------------------------------------------------------------------------
# main


def print_table(rows):
    print(f"\n{'model':12s} {'method':6s} {'B':>2s} {'GC':>3s} {'C':>5s} {'step s':>8s} {'rollout':>8s} {'logprob':>8s} "
          f"{'update':>8s} {'roll %':>6s} {'peak GiB':>8s} {'size GB':>7s}  status")
    for r in rows:
        def f(k, fmt, r=r):
            v = r.get(k)
            return format(v, fmt) if isinstance(v, (int, float)) and not isinstance(v, bool) else "-"
        status = (f"OOM ({r.get('oom_phase')})" if r.get("oom") else ("FAILED" if r.get("error") else "ok"))
        share = r.get("rollout_share")
        print(f"{r['model']:12s} {r['method']:6s} {r['batch']:2d} {'on' if r.get('grad_ckpt') else 'off':>3s} "
              f"{r['completion_len']:5d} {f('step_s', '8.2f')} {f('rollout_s', '8.2f')} {f('logprob_s', '8.2f')} "
              f"{f('update_s', '8.2f')} {format(100 * share, '6.1f') if share else '-':>6s} {f('peak_gib', '8.1f')} "
              f"{f('model_size_gb', '7.2f')}  {status}")


def run(args) -> dict:
    device = torch.device(args.device)
    prov = sc.provenance(args.git_sha)
    print("env:", json.dumps(prov["env"]))
    cap = sc.apply_memory_cap(args.memory_cap_gib)
    if cap is not None:
        print(f"memory cap: {cap:.1f} GiB (of {prov['env'].get('gpu_total_gib', 0):.1f} GiB)")
    rows = []
    t_start = time.time()
    settings = {k: v for k, v in vars(args).items() if k != "merge"}

    def save(complete=False):  # after every row: a run cut off by a time limit keeps what it measured
        result = assemble(rows, prov, settings)
        result["complete"] = complete
        return result, sc.write_json(result, args.out, prov["gpu"])

    for mk in args.models:
        vocab = sc.vocab_size(mk)
        for method in args.methods:
            base = dict(model=mk, method=method, micro_batch=args.micro_batch, prompt_len=args.prompt,
                        completion_len=args.completion, memory_cap_gib=cap)
            t0 = time.time()
            try:
                model = sc.build(mk, method, args.lora_rank, device, seed=args.seed)
                sc.sync()
            except Exception as e:  # noqa: BLE001 - e.g. bf16 32B under the 80 GiB cap
                oom = sc.is_oom(e)
                err = f"{type(e).__name__}: {str(e)[:500]}"
                print(f"{mk} {method}: build {'OOM' if oom else 'FAILED'}: {err[:200]}")
                for b in args.batch:
                    for gc_on in args.grad_ckpt:
                        rows.append({**base, "batch": b, "grad_ckpt": gc_on == "on", "oom": oom,
                                     ("oom_phase" if oom else "failed_phase"): "build", "error": err})
                sc.free()
                save()
                continue
            sizes = sc.model_bytes(model)
            trainable = lora_parameters(model)
            opt, opt_name = make_optimizer(trainable, args.learning_rate)
            extra = dict(memory_cap_gib=cap, build_s=time.time() - t0, model_size_gb=sizes["model_size_bytes"] / 1e9,
                         lora_gb=sizes["lora_bytes"] / 1e9, lora_rank=args.lora_rank,
                         weights_gib=torch.cuda.memory_allocated() / 2**30)
            print(f"{mk} {method}: built in {extra['build_s']:.0f} s, size {extra['model_size_gb']:.2f} GB")
            for b in args.batch:
                for gc_on in args.grad_ckpt:
                    rows.append(measure(model, mk, method, b, gc_on == "on", args, vocab, opt, opt_name, trainable, extra))
                    print_table(rows[-1:])
                    save()
            del model, opt, trainable
            sc.free()
            print(f"  ({time.time() - t_start:.0f} s so far)")
    result, path = save(complete=True)
    print_table(rows)
    print(f"\nwrote {path} ({time.time() - t_start:.0f} s)")
    for k, v in result["summary"].items():
        print(f"{k:40s} {str(v if not isinstance(v, float) else round(v, 3)):>8s}  target {TARGETS[k]}  "
              f"[{result['summary_notes'][k]}]")
    return result


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="+", default=["qwen2.5-7b", "qwen2.5-14b"], choices=list(sc.MODELS))
    ap.add_argument("--methods", nargs="+", default=[QERL_FORMAT, "bf16", QLORA_FORMAT], choices=METHODS,
                    help="base formats (LoRA on top of each), run in this order; nf4 runs bitsandbytes' kernels")
    ap.add_argument("--batch", nargs="+", type=int, default=[8], help="completions per step (paper: 2, 4, 8)")
    ap.add_argument("--grad-ckpt", nargs="+", default=["on"], choices=["on", "off"], help="gradient checkpointing")
    ap.add_argument("--prompt", type=int, default=256, help="prompt length (paper: 256)")
    ap.add_argument("--completion", type=int, default=2048, help="completion length, fixed (paper: 2048)")
    ap.add_argument("--micro-batch", type=int, default=1, help="sequences per training forward/backward")
    ap.add_argument("--lora-rank", type=int, default=32, help="LoRA rank r (alpha = 2 r); paper Table 4: 32")
    ap.add_argument("--learning-rate", type=float, default=1e-5, help="AdamW learning rate (paper: 1e-5)")
    ap.add_argument("--memory-cap-gib", type=float, default=None,
                    help="cap this process's GPU memory (80: the paper's one H100 80GB)")
    sc.add_run_args(ap, out="results/table3")
    return ap.parse_args(argv)


def main(argv=None):
    return sc.main_run_or_merge(parse_args(argv), run, merge, "table3_speed_memory.py")


if __name__ == "__main__":
    main()
