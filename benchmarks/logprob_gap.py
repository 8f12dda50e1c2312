"""Sampled-token log-probs of the rollout engine vs the training forward (issue #5), on the
embedded SmolLM2-135M-Instruct, bf16 and NVFP4 (+ LoRA rank 16), for each engine mode: CUDA
graphs with the fused decode step, CUDA graphs unfused, eager (exact-length attention).

Per (format, mode): the engine samples `--new` tokens for `--prompts` chat prompts at T=1.0; the
training forward (qerl.logprobs.sequence_logprobs, what the loss uses) scores the same tokens; the
row holds mean and max |engine log-prob - forward log-prob| over the completion tokens. It also
runs every mode twice with the same seed (`repeat_token_agreement`: run-to-run determinism) and
compares each mode's tokens with the eager engine's (`agreement_vs_eager`, `first_divergence`:
the mean position where a sequence first differs). Sampling is keyed (seed, sequence, step), so
two modes pick different tokens only where their logits differ enough to flip a Gumbel-max.

Writes <out>/<gpu>.json (gpu, git_sha, date, env, rows); default out results/rollout/logprob_gap.

Run:  python -m benchmarks.logprob_gap          (GPU, ~1 min on an H100)
      python -m benchmarks.logprob_gap --device cpu --modes eager     (CPU, a few minutes)
"""

from __future__ import annotations

import argparse
import copy
import json
from pathlib import Path

import torch

from benchmarks import speed_common as sc  # noqa: E402

QUESTIONS = ["Write a haiku about the sea.", "What is 12 + 7?", "Name three prime numbers.",
             "Explain what a prime number is.", "What is the capital of France?", "Count from 1 to 10.",
             "Give me a short story about a cat.", "What is 3 times 14?"]
MODES = {"graph_fused": dict(cuda_graphs=True, fused=True), "graph": dict(cuda_graphs=True, fused=False),
         "eager": dict(cuda_graphs=False, fused=False)}


def first_divergence(a: torch.Tensor, b: torch.Tensor) -> float:
    """Mean over sequences of the first position where the token rows differ (length if never)."""
    diff = (a != b)
    pos = torch.where(diff.any(1), diff.float().argmax(1), torch.full_like(diff[:, 0], a.size(1), dtype=torch.long))
    return float(pos.float().mean())


def main():
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--formats", nargs="+", default=["bf16", "nvfp4"])
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    ap.add_argument("--prompts", type=int, default=16, help="chat prompts (the questions, repeated)")
    ap.add_argument("--new", type=int, default=128, help="sampled tokens per prompt")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="results/rollout/logprob_gap")
    ap.add_argument("--git-sha", default=None)
    args = ap.parse_args()

    from qerl import formats
    from qerl.logprobs import sequence_logprobs
    from qerl.models import DEFAULT_MODEL, load_model
    from qerl.noise import keep_norms_fp32
    from qerl.quantize import QuantizeConfig, quantize_
    from qerl.rollout import FastEngine

    dev = torch.device(args.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda but no CUDA GPU is visible (use --device cpu)")
    base, tok = load_model(DEFAULT_MODEL, dtype=torch.bfloat16)
    prompts = []
    for i in range(args.prompts):
        p = tok.apply_chat_template([{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}],
                                    add_generation_prompt=True)
        prompts.append(p if isinstance(p, list) else p["input_ids"])
    rows = []
    for fmt in args.formats:
        model = copy.deepcopy(base).to(dev)
        if not formats.is_dense(fmt):
            quantize_(model, QuantizeConfig(fmt=fmt, lora_rank=16))
        keep_norms_fp32(model)
        model.eval()
        outs = {}
        for mode in args.modes:
            kw = MODES[mode]
            if dev.type != "cuda" and (kw["cuda_graphs"] or kw["fused"]):
                print(f"skip {fmt}/{mode}: needs CUDA")
                continue
            eng = FastEngine(model, tok, max_seq_len=512, **kw)
            runs = [eng.generate(prompts, args.new, temperature=1.0, seed=args.seed) for _ in range(2)]
            o = runs[0]
            with torch.no_grad():
                ref, _ = sequence_logprobs(model, o.prompt_ids, o.prompt_mask, o.completion_ids, o.completion_mask, 1.0)
            m = o.completion_mask.bool()
            gap = (o.logprobs - ref).abs()[m]
            row = dict(model=DEFAULT_MODEL, fmt=fmt, mode=mode, prompts=len(prompts), new_tokens=args.new,
                       tokens=int(m.sum()), logprob_gap_mean=float(gap.mean()), logprob_gap_max=float(gap.max()),
                       logprob_gap_p99=float(gap.float().quantile(0.99)),
                       repeat_token_agreement=float((runs[0].completion_ids == runs[1].completion_ids).float().mean()),
                       repeat_logprob_max_diff=float((runs[0].logprobs - runs[1].logprobs).abs()[m].max())
                       if torch.equal(runs[0].completion_ids, runs[1].completion_ids) else None)
            outs[mode] = o
            rows.append(row)
            print(json.dumps(row), flush=True)
        if "eager" in outs:
            for row in rows:
                if row["fmt"] == fmt and row["mode"] in outs:
                    a, b = outs[row["mode"]].completion_ids, outs["eager"].completion_ids
                    row["agreement_vs_eager"] = float((a == b).float().mean())
                    row["first_divergence_vs_eager"] = first_divergence(a, b)
        del model
    res = dict(sc.provenance(args.git_sha), rows=rows,
               note="engine log-probs of its own sampled tokens vs the training forward on the same tokens")
    out = Path(args.out) / f"{res['gpu'] if dev.type == 'cuda' else 'cpu'}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1))
    print(f"wrote {out}")
    for r in rows:
        print(f"{r['fmt']:6s} {r['mode']:12s} gap mean {r['logprob_gap_mean']:.4f} max {r['logprob_gap_max']:.3f} "
              f"repeat {r['repeat_token_agreement']:.3f} vs eager {r.get('agreement_vs_eager', float('nan')):.3f} "
              f"first div {r.get('first_divergence_vs_eager', float('nan')):.1f}")


if __name__ == "__main__":
    main()
