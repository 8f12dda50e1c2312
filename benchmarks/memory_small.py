"""GPU memory of one small-profile run, phase by phase: what lets 8-12 of them share one GPU.

Runs ``--steps`` RL steps of ``qerl train --profile small --method nvfp4_lora_aqn`` (64 completions x
64 tokens, LoRA r 32, AQN on) through the trainer's own phases (qerl.step) and optimizer, then
evaluation batches at the profile's evaluation settings, and prints per phase the peak memory
allocated and reserved by PyTorch's caching allocator (reset before each phase), what stays
allocated after it, and the device memory in use (CUDA context included), plus the parts that are
sized up front: weights, LoRA + AdamW state, the rollout engine's KV cache, the 4-bit kernels'
decode scratch and split-K workspaces.

The model is SmolLM2-135M-shaped (hidden 576, 30 layers, 9 / 3 heads, intermediate 1536, vocab
49152) with random weights, built from a hand-written LlamaConfig: no weights, tokenizer or data
files are needed. Prompts are random token ids of ``--prompt-len`` (98: the small profile's mean
arith prompt with the chat template) and completions run to full length (EOS ignored), the worst
case of a step. ``--settings before`` measures the settings of the 13.3 GiB peak (no gradient
checkpointing, a KV cache for max_prompt_length + completion, evaluation in batches of 64) for the
comparison.

    python -m benchmarks.memory_small                      # lean settings (the small profile now)
    python -m benchmarks.memory_small --settings before    # as measured at 13.3 GiB

Writes <out>/<gpu>-<settings>.json; the last stdout line is its summary as one JSON object.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path

import torch

SMOLLM2_135M = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                    num_key_value_heads=3, vocab_size=49152, max_position_embeddings=8192, rms_norm_eps=1e-5,
                    rope_theta=100000.0, tie_word_embeddings=True, hidden_act="silu", bos_token_id=1,
                    eos_token_id=2, pad_token_id=2)
GIB = 2**30


def smollm2_config(layers: int = SMOLLM2_135M["num_hidden_layers"]):
    from transformers import LlamaConfig

    cfg = LlamaConfig(**{**SMOLLM2_135M, "num_hidden_layers": layers})
    cfg._attn_implementation = "sdpa"
    return cfg


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def kernel_buffers() -> dict:
    """Bytes of the 4-bit kernels' module-level buffers: decode scratch, split-K workspaces (live and retired)."""
    from qerl import kernels

    return kernels.buffer_bytes()


class Probe:
    """Peak allocated / reserved per phase (the allocator's peak is reset before each)."""

    def __init__(self, cuda: bool = True):
        self.rows: list[dict] = []
        self.cuda = cuda

    @contextlib.contextmanager
    def __call__(self, name: str):
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        yield
        row = {"phase": name, "seconds": 0.0, "peak_allocated_gib": 0.0, "peak_reserved_gib": 0.0,
               "allocated_after_gib": 0.0, "device_used_gib": 0.0}
        if self.cuda:  # (on the CPU, the pipeline check of the tests: times only)
            torch.cuda.synchronize()
            free, total = torch.cuda.mem_get_info()
            row.update(peak_allocated_gib=torch.cuda.max_memory_allocated() / GIB,
                       peak_reserved_gib=torch.cuda.max_memory_reserved() / GIB,
                       allocated_after_gib=torch.cuda.memory_allocated() / GIB, device_used_gib=(total - free) / GIB)
        row["seconds"] = round(time.perf_counter() - t0, 3)
        self.rows.append(row)


def run(args) -> dict:
    from qerl import step as qstep
    from qerl.config import eval_settings, make_config
    from qerl.logging import environment
    from qerl.models import build_quantized_model
    from qerl.noise import keep_norms_fp32
    from qerl.policy import make_optimizer, optimizer_params
    from qerl.rollout import make_engine

    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    before = args.settings == "before"
    ov = dict(seed=0, loss_type="grpo", beta=0.0, epsilon=0.2, epsilon_high=0.28, eval_samples=16,
              gradient_checkpointing=not before, eval_batch_size=64 if before else 256, wandb_mode="disabled")
    if not cuda:
        ov["backend"] = "reference"
    if args.tiny:
        ov.update(prompts_per_step=1, num_generations=2, max_completion_length=4, eval_batch_size=2, micro_batch_size=2)
    cfg = make_config("small", method=args.method, **ov)
    probe = Probe(cuda)
    torch.manual_seed(0)
    with probe("build"):
        model = build_quantized_model(smollm2_config(args.layers), cfg.quantize_config(), device=dev, seed=0)
    keep_norms_fp32(model)
    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt, sched = make_optimizer(cfg, trainable, cfg.max_steps)
    P, C = args.prompt_len, cfg.max_completion_length
    # the trainer sizes the cache for the longest prompt it has; before: for max_prompt_length
    engine = make_engine(model, None, kind=cfg.engine, eos_token_ids=[2], pad_id=0,
                         max_seq_len=(cfg.max_prompt_length if before else P) + C)
    aqn = cfg.aqn_config()
    n = cfg.rollout_batch_size
    g = torch.Generator().manual_seed(0)
    for step in range(args.steps):
        prompts = torch.randint(3, 49152, (n, P), generator=g).tolist()
        _, sigma = aqn.sigma_at(max(step, cfg.max_steps // cfg.num_stages), cfg.max_steps)  # a noisy stage
        with probe(f"rollout[{step}]"):
            ro, _ = qstep.rollout(cfg, engine, model, prompts, step, sigma, ignore_eos=True)
        batch = qstep.Batch.given(ro, torch.randn(n, generator=g), [n], 0)
        reuse = qstep.reuse_training_logprobs(cfg, n) and not args.old_logprobs
        with probe(f"old_logprobs[{step}]"):
            old, ref = qstep.logprobs(cfg, model, ro, reuse)
        with probe(f"update[{step}]"):
            qstep.update(cfg, model, ro, batch, old, ref, opt, sched, optimizer_params(opt), step, reuse)
        del ro, batch, old, ref
    ev = eval_settings(cfg)
    eval_engine = make_engine(model, None, kind=cfg.engine, eos_token_ids=[2], pad_id=0)
    for i in range(args.eval_batches):
        prompts = torch.randint(3, 49152, (ev["batch_size"], P), generator=g).tolist()
        with probe(f"eval[{i}]"):
            eval_engine.generate(prompts, ev["max_new_tokens"], temperature=ev["temperature"], top_p=ev["top_p"],
                                 seed=0, ignore_eos=True)
    state = [t for s in opt.state.values() for t in s.values() if torch.is_tensor(t)]
    parts = {"weights_gib": (_bytes(model.parameters()) + _bytes(model.buffers())) / GIB,
             "trainable_gib": _bytes(trainable) / GIB,
             "optimizer_state_gib": _bytes(state) / GIB,
             "kv_cache_train_gib": engine.cache_bytes() / GIB,
             "kv_cache_eval_gib": eval_engine.cache_bytes() / GIB,
             **{f"kernel_{k}_gib": v / GIB for k, v in kernel_buffers().items()}}
    steps = [r for r in probe.rows if not r["phase"].startswith(("build", "eval"))]
    evals = [r for r in probe.rows if r["phase"].startswith("eval")]
    summary = {"settings": args.settings, "method": cfg.method, "gradient_checkpointing": cfg.gradient_checkpointing,
               "eval_batch_size": ev["batch_size"], "kv_cache_len": engine.buf.L if engine.buf is not None else None,
               "steps_peak_allocated_gib": max(r["peak_allocated_gib"] for r in steps),
               "steps_peak_reserved_gib": max(r["peak_reserved_gib"] for r in steps),
               "eval_peak_allocated_gib": max((r["peak_allocated_gib"] for r in evals), default=None),
               "process_peak_reserved_gib": torch.cuda.max_memory_reserved() / GIB if cuda else None,
               "device_used_gib": max(r["device_used_gib"] for r in probe.rows),
               "target_gib": 4.0}
    summary["fits_target"] = max(summary["steps_peak_allocated_gib"], summary["eval_peak_allocated_gib"] or 0) <= 4.0
    return {"summary": summary, "parts": parts, "phases": probe.rows,
            "settings": {"prompt_len": P, "completion": C, "batch": n, "micro_batch": cfg.micro_batch_size,
                         "steps": args.steps, "eval_batches": args.eval_batches},
            "provenance": environment()}


def print_table(res: dict) -> None:
    print(f"{'phase':<18}{'s':>7}{'peak alloc':>12}{'peak resv':>11}{'alloc after':>13}{'device used':>13}  (GiB)")
    for r in res["phases"]:
        print(f"{r['phase']:<18}{r['seconds']:7.2f}{r['peak_allocated_gib']:12.3f}{r['peak_reserved_gib']:11.3f}"
              f"{r['allocated_after_gib']:13.3f}{r['device_used_gib']:13.3f}")
    print("parts (GiB): " + ", ".join(f"{k[:-4]} {v:.3f}" for k, v in res["parts"].items()))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.strip().split("\n\n")[0])
    ap.add_argument("--settings", choices=("lean", "before"), default="lean")
    ap.add_argument("--method", default="nvfp4_lora_aqn")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--eval-batches", type=int, default=2)
    ap.add_argument("--prompt-len", type=int, default=98)
    ap.add_argument("--old-logprobs", action="store_true", help="compute old log-probs in their own forward "
                    "(the trainer reuses the update's at the small profile)")
    ap.add_argument("--out", default="results/memory_small")
    ap.add_argument("--layers", type=int, default=SMOLLM2_135M["num_hidden_layers"], help=argparse.SUPPRESS)
    ap.add_argument("--device", default="cuda", help=argparse.SUPPRESS)  # cpu: the tests' pipeline check
    ap.add_argument("--tiny", action="store_true", help=argparse.SUPPRESS)  # 2 completions of 4 tokens (the tests)
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("error: benchmarks.memory_small measures GPU memory: no CUDA device", file=sys.stderr)
        return 2
    if args.steps < 1 or args.eval_batches < 0 or args.prompt_len < 1:
        print("error: --steps and --prompt-len must be >= 1, --eval-batches >= 0", file=sys.stderr)
        return 2
    res = run(args)
    print_table(res)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    gpu = torch.cuda.get_device_name(0).replace(" ", "_") if args.device == "cuda" else "cpu"
    (out / f"{gpu}-{args.settings}.json").write_text(json.dumps(res, indent=1))
    print(json.dumps(res["summary"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
