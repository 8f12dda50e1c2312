"""Rollout throughput (paper Tables 5-9 and Figure 11; issue #5): tokens/s of qerl's fast engine on
the Qwen2.5-3B/7B/14B/32B architectures with random weights, bf16 LoRA vs bitsandbytes NF4 (QLoRA)
vs MXFP4 vs NVFP4, plus HF transformers `generate` on the bf16 LoRA model (what a user gets with
no engine). Speed does not depend on weight values, so random weights time what real ones would.

Setting: prompt 256 tokens, completion 2048 at fixed length (EOS ignored), sampling at T=1.0,
batch 1/2/8, LoRA rank 16/32/64 (alpha = 2 r, fp32 adapters). Each model is built straight into
its format, one decoder layer at a time on the GPU (qerl.models.build_quantized_model); one built
base serves every batch size and rank (adapters swapped in place). Every row says what it ran:
`completion_len` (shorter completions for the non-summary configurations are labelled so), the
engine, whether CUDA graphs were used, and `fused`: whether the decode step ran through the fused
Triton kernels (qerl.kernels.fused; the engine's default on CUDA). `--fused both` times every
fast-engine configuration with the fusion off and on, side by side in one run; the summary uses
the fused rows where there are any.

Timing of one fast-engine row: the engine is warmed up with short calls that capture every CUDA
graph the timed call replays (and autotune the prefill GEMMs); then a prefill-only call
(max_new_tokens=1) and the timed call of `completion_len` tokens. tokens_per_s = B * C / total
seconds (prefill included, as a throughput of the whole rollout); decode_tokens_per_s and
ms_per_decode_step exclude the prefill: (total - prefill) / (C - 1). HF generate: a 4-token
warm-up, then `--hf-completion` new tokens (min_new_tokens = max_new_tokens), a per-token rate
including its prefill.

Roofline (bs1, decode): fraction = (bytes_per_step / seconds per decode step) / copy bandwidth,
with bytes_per_step = every decoder-layer tensor (packed base, scales, biases, LoRA, norms) + final
norm + lm_head + the B looked-up embedding rows + KV cache (layers x 2 x B x kv_heads x head_dim x
mean context x 2 bytes, mean context = prompt + completion / 2); copy bandwidth = bytes read +
written by a 1 GiB device-to-device copy, measured in the same run (as bench_kernels.py).

A length mix (``--lengths mix``, or ``lognormal:median=M,p95=Q``; see benchmarks/speed_common.py):
each sequence of a batch is forced to end at a length drawn once per batch size (seeded by --seed,
numpy PCG64) from a clipped log-normal, the default median cap / 4 with the 95th percentile at the
cap (``--completion`` is the cap), EOS ignored. Every method then decodes exactly the same tokens.
Rows: each base format with the engine's default, finished sequences leaving the batch (``compact``:
true), and ``nvfp4_static``: the NVFP4 model again with the static batch (``compact``: false, every
row runs until the longest sequence ends; method "nvfp4" in the row). One engine per row, warmed up
once: its graphs for every attention window at every batch bucket are captured before the timed
call (``captures_during_timing`` must be 0; a call that captured is timed again).
  useful_tokens_per_s = the drawn lengths' sum / seconds of the whole rollout (prefill included):
      pad positions of finished sequences do not count, so the static batch gains nothing from them;
  decode_steps, bucket_steps = the decode steps in all and at each batch size (engine.last_stats;
      the static batch runs every step at B); row_steps = sum of bucket x steps (rows decoded);
  length_stats = the drawn lengths' median, p95, mean, max, total and fraction at the cap.
Summary: ``<model>/bs64_mix/nvfp4_over_bf16`` and ``.../nvfp4_over_static`` (issue 36's keys); every
batch size and spec measured is under ``mix_ratios`` (``<model>/bs<B>_mix/...``).
More sequences than rows (``--rows R``, NVFP4 only, with a mix): the B sequences decode on R rows
(``max_batch``), freed rows taking the waiting prompts (``--refill on``, the engine's default) or in
waves of R (``off``), or both side by side; the rows carry ``max_batch`` and ``refill``, stay out of
the keys above, and ``mix_ratios`` gains ``<model>/bs<B>_<spec>_rows<R>/refill_over_waves``.

Writes <out>/<gpu>.json: gpu, git_sha, date, env, copy_bandwidth_tbps, targets, paper_reference
(the paper's vLLM numbers, H100, as a labelled reference only), rows, and `summary` with exactly
the keys of issue #5; prints a table; the last stdout line is the summary as one JSON object.
Each row carries the ``git_sha`` of the run that measured it; ``--merge`` keeps it, so a merged file's
top-level ``git_sha`` is only its last input's.

Run (GPU; expected minutes on an H200 in brackets):
  python -m experiments.rollout_throughput --models qwen2.5-7b qwen2.5-14b             [~5]
  python -m experiments.rollout_throughput --models qwen2.5-32b                       [~6]
  python -m experiments.rollout_throughput --models qwen2.5-3b qwen2.5-7b --methods bf16 nvfp4 \\
      --batch 2 --ranks 16 32 64 --completion 256                                     [~3]
  python -m experiments.rollout_throughput --models qwen2.5-7b --batch 64 --lengths mix --completion 2048 \\
      --methods bf16 nvfp4 nvfp4_static                                               [~4]
  python -m experiments.rollout_throughput --merge a/h200.json b/h200.json --out results/rollout   (CPU)
"""

from __future__ import annotations

import argparse
import json
import time
import traceback
from pathlib import Path

import torch

from benchmarks import speed_common as sc
from experiments import _common as C  # noqa: E402
from qerl import formats  # noqa: E402
from qerl.config import QERL_FORMAT, QLORA_FORMAT, table_bases  # noqa: E402

# What this artefact writes (results/<out>/artefact.json, read by qerl.plots and notebooks/rollout.ipynb)
ARTEFACT = C.Artefact("rollout", "experiments.rollout_throughput", C.Outputs(
    figure="plot_rollout_throughput", figure_file="rollout_throughput.png", notebook="notebooks/rollout.ipynb",
    columns=("gpu", "model", "method", "batch", "lora_rank", "completion_len", "tokens_per_s", "ms_per_decode_step",
             "roofline_fraction", "peak_gib", "paper_vllm_tokens_per_s")))

STATIC = f"{QERL_FORMAT}_static"  # NVFP4 with the static batch (compact=False), length-mix rows only
METHODS = table_bases() + ("hf_generate_bf16", STATIC)  # bf16, every registered format, HF generate, static
SUMMARY_MODELS = ("qwen2.5-7b", "qwen2.5-14b", "qwen2.5-32b")
SUMMARY_RANK = 32
TARGETS = {}
for _m in SUMMARY_MODELS:
    TARGETS.update({f"{_m}/bs1/nvfp4_over_bf16": 2.5, f"{_m}/bs8/nvfp4_over_bf16": 2.0,
                    f"{_m}/bs64/nvfp4_over_bf16": 1.5,  # issue 14: batch 64, prompt 256, completion 1024
                    # issue 36: batch 64, the `mix` lengths at cap 2048, useful tokens/s
                    f"{_m}/bs64_mix/nvfp4_over_bf16": 1.6, f"{_m}/bs64_mix/nvfp4_over_static": 1.4,
                    f"{_m}/bs1/roofline_fraction": 0.70, f"{_m}/bs1/nvfp4_over_nf4": 3.0,
                    f"{_m}/bs1/nvfp4_over_hf_generate_bf16": 10.0})
SUMMARY_KEYS = tuple(TARGETS)
# The paper's rollout throughput (vLLM, one H100 80GB, prompt 256, completion 2048), tokens/s, as
# listed in docs/design.md. A labelled reference column: a different engine and GPU.
PAPER_TOKENS_PER_S = {
    ("qwen2.5-7b", "bf16", 2): 115.4, ("qwen2.5-7b", "nvfp4", 2): 151.6,
    ("qwen2.5-14b", "bf16", 2): 65.4, ("qwen2.5-14b", "nvfp4", 2): 95.3,
    ("qwen2.5-32b", "bf16", 2): 34.0, ("qwen2.5-32b", "nvfp4", 2): 60.0,
    ("qwen2.5-32b", "bf16", 8): 344.3, ("qwen2.5-32b", "nvfp4", 8): 688.2,
}
PAPER_RATIOS = {"qwen2.5-3b/bs8": 1.0, "qwen2.5-7b/bs2": 1.3, "qwen2.5-14b/bs2": 1.5, "qwen2.5-32b/bs2": 1.8,
                "qwen2.5-32b/bs8": 2.0}


# ----------------------------------------------------------------------------------------------
# measurements


def time_fast_engine(model, model_key: str, method: str, batch: int, rank: int, prompt_len: int,
                     completion_len: int, vocab: int, copy_tbps: float | None, fused: bool | None = None) -> dict:
    """One fast-engine row: warm-up, prefill-only call, timed call; see the module docstring."""
    row = dict(model=model_key, method=method, engine="fast", batch=batch, lora_rank=rank, prompt_len=prompt_len,
               completion_len=completion_len)
    engine = sc.make_fast_engine(model, batch, prompt_len + completion_len, fused=fused)
    try:
        row["warmup_s"] = sc.warm_up_engine(engine, batch, prompt_len, completion_len, vocab)
    except Exception as e:  # noqa: BLE001 - e.g. a kernel that cannot be captured in a CUDA graph
        if sc.is_oom(e) or not getattr(engine, "cuda_graphs", False):
            raise
        print(f"  CUDA-graph warm-up failed ({type(e).__name__}: {str(e)[:120]}); eager decode instead")
        row["graph_error"] = f"{type(e).__name__}: {str(e)[:300]}"
        del engine
        sc.free()
        engine = sc.make_fast_engine(model, batch, prompt_len + completion_len, cuda_graphs=False, fused=fused)
        row["warmup_s"] = sc.warm_up_engine(engine, batch, prompt_len, completion_len, vocab)
    row["cuda_graphs"] = bool(getattr(engine, "cuda_graphs", False))
    row["fused"] = bool(getattr(engine, "fused", False))
    row["attention"] = getattr(engine, "attention", "sdpa")
    prompts = sc.random_prompts(batch, prompt_len, vocab, seed=0)
    sc.sync()
    t0 = time.perf_counter()
    engine.generate(prompts, 1, seed=0, **sc.SAMPLING)
    sc.sync()
    prefill_s = time.perf_counter() - t0
    for _ in range(2):  # a second try only if the first one captured a graph after all
        n0 = sc.captures(engine)
        sc.reset_peak()
        t0 = time.perf_counter()
        out = engine.generate(prompts, completion_len, seed=0, **sc.SAMPLING)
        sc.sync()
        total = time.perf_counter() - t0
        row["captures_during_timing"] = sc.captures(engine) - n0
        if row["captures_during_timing"] == 0:
            break
    got = tuple(out.completion_ids.shape)
    if got != (batch, completion_len):
        raise RuntimeError(f"engine returned completions of shape {got}, expected {(batch, completion_len)}")
    row.update(seconds=total, prefill_s=prefill_s, tokens=batch * completion_len,
               tokens_per_s=batch * completion_len / total, peak_gib=sc.peak_gib(),
               kv_cache_bytes=int(engine.cache_bytes()) if hasattr(engine, "cache_bytes") else None)
    if completion_len > 1:
        step = max(total - prefill_s, 1e-9) / (completion_len - 1)
        row.update(ms_per_decode_step=step * 1e3, decode_tokens_per_s=batch / step)
        row.update(sc.decode_bytes_per_step(model, batch, prompt_len + completion_len / 2))
        row["achieved_tbps"] = row["bytes_per_step"] / step / 1e12
        row["copy_tbps"] = copy_tbps
        row["roofline_fraction"] = row["achieved_tbps"] / copy_tbps if copy_tbps else None
    del engine, out
    return row


def time_mix_row(model, model_key: str, method: str, batch: int, rank: int, prompt_len: int, lengths: list[int],
                 spec: str, cap: int, vocab: int, compact: bool, rows: int | None = None, refill: bool = True) -> dict:
    """One fast-engine row on a length mix: every graph captured in the warm-up (every window at every
    batch bucket with ``compact``), then the timed rollout in which sequence i ends at lengths[i]
    (its cap, EOS ignored). ``rows``: decode the batch on that many rows (max_batch), refilling freed
    rows or in waves. See the module docstring for the columns."""
    if len(lengths) != batch or not all(1 <= x <= cap for x in lengths):
        raise ValueError(f"need {batch} lengths in [1, {cap}], got {len(lengths)} in [{min(lengths)}, {max(lengths)}]")
    if rows is not None and not 1 <= rows < batch:
        raise ValueError(f"rows must be in [1, {batch}) for a batch of {batch}, got {rows}")
    longest = max(lengths)
    row = dict(model=model_key, method=method, engine="fast", batch=batch, lora_rank=rank, prompt_len=prompt_len,
               completion_len=cap, lengths=spec, compact=compact, length_stats=sc.length_summary(lengths, cap))
    seq_len = prompt_len + longest
    if rows is not None:  # the refilling engine's cache: prompt + longest + one host check's steps (FastEngine)
        row.update(max_batch=rows, refill=refill)
        seq_len += 16
    engine = sc.make_fast_engine(model, batch, seq_len, compact=compact, max_batch=rows, refill=refill)
    if bool(getattr(engine, "compact", False)) != compact:
        raise RuntimeError(f"this engine cannot run compact={compact} (FastEngine without finished-row compaction)")
    if rows is not None and (getattr(engine, "max_batch", None) != rows or getattr(engine, "refill", None) != refill):
        raise RuntimeError("this engine cannot run max_batch / refill (FastEngine without them)")
    row["warmup_s"] = sc.warm_up_engine(engine, batch, prompt_len, longest, vocab, lengths, rows=rows)
    row["cuda_graphs"], row["fused"] = bool(getattr(engine, "cuda_graphs", False)), bool(getattr(engine, "fused", False))
    row["attention"] = getattr(engine, "attention", "sdpa")
    prompts = sc.random_prompts(batch, prompt_len, vocab, seed=0)
    for row["timed_calls"] in (1, 2):  # a second call only if the first one captured a graph after all
        n0 = sc.captures(engine)
        sc.reset_peak()
        sc.sync()
        t0 = time.perf_counter()
        out = engine.generate(prompts, list(lengths), seed=0, **sc.SAMPLING)
        sc.sync()
        total = time.perf_counter() - t0
        row["captures_during_timing"] = sc.captures(engine) - n0
        if row["captures_during_timing"] == 0:
            break
    got = out.completion_mask.sum(1).tolist()
    if got != list(lengths):
        raise RuntimeError(f"the engine did not end the sequences at their drawn lengths: {got[:8]}... vs {lengths[:8]}...")
    st = getattr(engine, "last_stats", None) or {}
    if "bucket_steps" not in st:
        raise RuntimeError("the engine keeps no last_stats (decode steps per batch size): FastEngine with compaction needed")
    useful = int(sum(lengths))
    buckets = {int(k): int(v) for k, v in st["bucket_steps"].items()}
    row.update(seconds=total, useful_tokens=useful, useful_tokens_per_s=useful / total, peak_gib=sc.peak_gib(),
               decode_steps=st.get("decode_steps"), compactions=st.get("compactions"),
               compaction_s=st.get("compaction_s"), bucket_steps={str(k): v for k, v in sorted(buckets.items(), reverse=True)},
               refills=st.get("refills"), rebases=st.get("rebases"), waves=st.get("waves"),
               row_steps=sum(k * v for k, v in buckets.items()),
               kv_cache_bytes=int(engine.cache_bytes()) if hasattr(engine, "cache_bytes") else None)
    del engine, out
    return row


def time_hf_generate(model, model_key: str, batch: int, rank: int, prompt_len: int, new_tokens: int,
                     vocab: int) -> dict:
    """HF transformers generate (dynamic cache, eager) on the bf16 LoRA model: a per-token rate."""
    dev = model.get_input_embeddings().weight.device
    ids = torch.tensor(sc.random_prompts(batch, prompt_len, vocab, seed=0), device=dev)
    attn = torch.ones_like(ids)
    kw = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, pad_token_id=0)
    with torch.no_grad():
        model.generate(ids, attention_mask=attn, max_new_tokens=4, min_new_tokens=4, **kw)
        sc.sync()
        sc.reset_peak()
        t0 = time.perf_counter()
        out = model.generate(ids, attention_mask=attn, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **kw)
        sc.sync()
        total = time.perf_counter() - t0
    if out.shape[1] != prompt_len + new_tokens:
        raise RuntimeError(f"generate returned {out.shape[1] - prompt_len} new tokens, expected {new_tokens}")
    return dict(model=model_key, method="hf_generate_bf16", engine="hf_generate", batch=batch, lora_rank=rank,
                prompt_len=prompt_len, completion_len=new_tokens, seconds=total, tokens=batch * new_tokens,
                tokens_per_s=batch * new_tokens / total, peak_gib=sc.peak_gib(),
                note=f"HF generate, {new_tokens} new tokens after a {prompt_len}-token prompt, prefill included; "
                     "a per-token rate compared with the fast engine's 2048-token rows")


def guarded(base: dict, fn, *args) -> dict:
    """Run fn(*args) -> row; an OOM or any other failure becomes a row saying so (the run goes on)."""
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001 - a benchmark row must not take the whole run down
        oom = sc.is_oom(e)
        if not oom:
            traceback.print_exc()
        print(f"  {'OOM' if oom else 'FAILED'}: {base} {type(e).__name__}: {str(e)[:200]}")
        return {**base, "oom": oom, "error": f"{type(e).__name__}: {str(e)[:500]}"}
    finally:
        sc.free()


# ----------------------------------------------------------------------------------------------
# summary


def _pick(rows, model, method, batch, rank=SUMMARY_RANK, completion=None, fused=None):
    """The successful row of (model, method, batch, rank[, fused]): CUDA graphs where measured (a
    row whose graph warm-up failed ran eagerly), then fused decode, then the longest completion
    unless given."""
    hits = [r for r in rows if r.get("model") == model and r.get("method") == method and r.get("batch") == batch
            and r.get("lengths", "fixed") == "fixed" and r.get("lora_rank") == rank and r.get("tokens_per_s")
            and (completion is None or r["completion_len"] == completion)
            and (fused is None or bool(r.get("fused")) == fused)]
    return max(hits, key=lambda r: (bool(r.get("cuda_graphs", True)), bool(r.get("fused")), r["completion_len"],
                                    r.get("date", ""))) if hits else None


def _ratio(rows, model, batch, num, den):
    """tokens/s of num over den at the longest completion length both were measured at; fast-engine
    rows compared at the same `fused` setting (fused where both have it)."""
    if den == "hf_generate_bf16":
        a, b = _pick(rows, model, num, batch), _pick(rows, model, den, batch)
        return (None, None) if a is None or b is None else (
            a["tokens_per_s"] / b["tokens_per_s"], f"{num} C={a['completion_len']} fused={bool(a.get('fused'))} / {den}")
    for fused in (True, False):
        a, b = _pick(rows, model, num, batch, fused=fused), _pick(rows, model, den, batch, fused=fused)
        if a is None or b is None:
            continue
        if a["completion_len"] != b["completion_len"]:
            c = min(a["completion_len"], b["completion_len"])
            a, b = (_pick(rows, model, num, batch, completion=c, fused=fused),
                    _pick(rows, model, den, batch, completion=c, fused=fused))
            if a is None or b is None:
                continue
        if not (a.get("cuda_graphs", True) and b.get("cuda_graphs", True)) and fused:
            continue  # a fused row that fell back to eager: compare the unfused graphs instead
        return (a["tokens_per_s"] / b["tokens_per_s"],
                f"{num} C={a['completion_len']} / {den} C={b['completion_len']}, fused={fused}")
    return None, None


def mix_ratios(rows: list[dict]) -> dict:
    """Every length-mix ratio the rows allow: ``<model>/bs<B>_<lengths>/nvfp4_over_bf16`` and
    ``.../nvfp4_over_static`` (useful tokens/s, the same drawn lengths)."""
    out = {}
    for r in rows:
        if r.get("lengths", "fixed") != "fixed" and r.get("method") == QERL_FORMAT and r.get("compact"):
            if r.get("max_batch") is not None:
                v = _refill_ratio(rows, r["model"], r["batch"], r["max_batch"], r["lengths"])
                out[f"{r['model']}/bs{r['batch']}_{r['lengths']}_rows{r['max_batch']}/refill_over_waves"] = v
                continue
            for den, key in (("bf16", "nvfp4_over_bf16"), ("static", "nvfp4_over_static")):
                v, _ = _mix_ratio(rows, r["model"], r["batch"], QERL_FORMAT, den, r["lengths"])
                out[f"{r['model']}/bs{r['batch']}_{r['lengths']}/{key}"] = v
    return out


def _refill_ratio(rows, model, batch, max_batch, spec):
    """useful tokens/s of the refilling engine over the waves, NVFP4, the batch on max_batch rows."""
    def pick(refill):
        hits = [r for r in rows if r.get("model") == model and r.get("batch") == batch and r.get("method") == QERL_FORMAT
                and r.get("lengths") == spec and r.get("max_batch") == max_batch and r.get("refill") == refill
                and r.get("useful_tokens_per_s")]
        return max(hits, key=lambda r: r.get("date", "")) if hits else None

    a, b = pick(True), pick(False)
    if a is None or b is None or a.get("length_stats") != b.get("length_stats"):
        return None
    return a["useful_tokens_per_s"] / b["useful_tokens_per_s"]


def _mix_ratio(rows, model, batch, num, den, spec="mix"):
    """useful tokens/s of ``num`` (compacting) over ``den`` ("bf16": bf16 compacting; "static": ``num``
    with the static batch) on the same drawn lengths."""
    def pick(method, compact):
        hits = [r for r in rows if r.get("model") == model and r.get("batch") == batch and r.get("method") == method
                and r.get("lengths") == spec and bool(r.get("compact")) == compact and r.get("useful_tokens_per_s")
                and r.get("max_batch") is None]  # every sequence on its own row
        return max(hits, key=lambda r: r.get("date", "")) if hits else None

    a = pick(num, True)
    b = pick(num, False) if den == "static" else pick(den, True)
    if a is None or b is None or a.get("length_stats") != b.get("length_stats"):
        return None, None
    return (a["useful_tokens_per_s"] / b["useful_tokens_per_s"],
            f"{num} compacting / {den}, {spec} lengths (median {a['length_stats']['median']:.0f}, "
            f"max {a['length_stats']['max']}), useful tokens/s")


def summarize(rows: list[dict]) -> tuple[dict, dict]:
    """(summary with exactly SUMMARY_KEYS, notes saying which rows each value came from)."""
    summary, notes = {}, {}
    for m in SUMMARY_MODELS:
        for key, (batch, num, den) in {"bs1/nvfp4_over_bf16": (1, QERL_FORMAT, "bf16"),
                                       "bs8/nvfp4_over_bf16": (8, QERL_FORMAT, "bf16"),
                                       "bs64/nvfp4_over_bf16": (64, QERL_FORMAT, "bf16"),
                                       "bs1/nvfp4_over_nf4": (1, QERL_FORMAT, QLORA_FORMAT),
                                       "bs1/nvfp4_over_hf_generate_bf16": (1, QERL_FORMAT, "hf_generate_bf16")}.items():
            summary[f"{m}/{key}"], notes[f"{m}/{key}"] = _ratio(rows, m, batch, num, den)
        for num, den, key in ((QERL_FORMAT, "bf16", "nvfp4_over_bf16"), (QERL_FORMAT, "static", "nvfp4_over_static")):
            summary[f"{m}/bs64_mix/{key}"], notes[f"{m}/bs64_mix/{key}"] = _mix_ratio(rows, m, 64, num, den)
        r = _pick(rows, m, "nvfp4", 1)
        summary[f"{m}/bs1/roofline_fraction"] = r.get("roofline_fraction") if r else None
        notes[f"{m}/bs1/roofline_fraction"] = f"nvfp4 C={r['completion_len']}" if r else None
    return {k: summary[k] for k in SUMMARY_KEYS}, notes


def assemble(rows: list[dict], prov: dict, copy_tbps: float | None, settings: dict) -> dict:
    summary, notes = summarize(rows)
    for r in rows:
        ref = PAPER_TOKENS_PER_S.get((r.get("model"), r.get("method"), r.get("batch")))
        r["paper_vllm_tokens_per_s"] = ref  # reference only: vLLM, H100, completion 2048
    result = {**prov, "copy_bandwidth_tbps": copy_tbps, "settings": settings, "targets": TARGETS,
              "paper_reference": {"tokens_per_s": {f"{m}/{meth}/bs{b}": v for (m, meth, b), v in PAPER_TOKENS_PER_S.items()},
                                  "nvfp4_over_bf16": PAPER_RATIOS,
                                  "source": "QeRL paper (vLLM, one H100 80GB, prompt 256, completion 2048), "
                                            "as listed in docs/design.md; reference only"},
              "summary": summary, "summary_notes": notes, "mix_ratios": mix_ratios(rows), "rows": rows}
    if prov.get("gpu") == "h200":
        result["gpu_note"] = ("Measured on an H200 (141 GB HBM3e, ~4.8 TB/s), not the paper's H100 80GB: absolute "
                              "tokens/s are higher and the 32B bf16 model fits in memory here.")
    return result


def merge(paths: list[str], out: str) -> dict:
    """Merge several runs' JSON files (rows of later files replace identical configurations)."""
    files = [json.loads(Path(p).read_text()) for p in paths]
    gpus = {f["gpu"] for f in files}
    if len(gpus) != 1:
        raise SystemExit(f"refusing to merge results from different GPUs: {sorted(gpus)}")
    keyed = {}
    for f in files:
        for r in f["rows"]:
            r.setdefault("copy_tbps", f.get("copy_bandwidth_tbps"))
            # a row without its own commit takes its file's, unless that file is a merge itself (then unknown)
            r.setdefault("git_sha", None if f.get("runs") else f.get("git_sha"))
            k = (r.get("model"), r.get("method"), r.get("engine"), r.get("batch"), r.get("lora_rank"),
                 r.get("prompt_len"), r.get("completion_len"), bool(r.get("fused")), r.get("lengths", "fixed"),
                 r.get("compact", True), r.get("max_batch"), r.get("refill"))
            keyed[k] = r
    prov = {k: files[-1][k] for k in ("gpu", "git_sha", "date", "env")}
    prov["runs"] = sc.merged_runs(paths, files, extra=("copy_bandwidth_tbps",))
    result = assemble(list(keyed.values()), prov, files[-1].get("copy_bandwidth_tbps"), {"merged": list(map(str, paths))})
    path = sc.write_json(result, out, prov["gpu"])
    print(f"merged {len(paths)} files, {len(keyed)} rows -> {path}")
    return result


# ----------------------------------------------------------------------------------------------
# main


def _cell(row, key, fmt):
    v = row.get(key)
    return format(v, fmt) if isinstance(v, (int, float)) and not isinstance(v, bool) else "-"


def print_table(rows):
    print(f"\n{'model':12s} {'method':17s} {'fused':5s} {'B':>2s} {'r':>3s} {'C':>5s} {'tok/s':>9s} {'dec tok/s':>9s} "
          f"{'ms/step':>8s} {'roofline':>8s} {'peak GiB':>8s} {'paper':>7s}")
    for r in rows:
        def f(key, fmt, r=r):
            return _cell(r, key, fmt)
        status = " OOM" if r.get("oom") else (" FAILED" if r.get("error") else "")
        if r.get("lengths", "fixed") != "fixed":  # tok/s: useful (non-pad) tokens a second
            r = {**r, "tokens_per_s": r.get("useful_tokens_per_s")}
            status += (f" [{r['lengths']}, {'compacting' if r.get('compact') else 'static'}, useful tok/s; "
                       f"steps per batch size {r.get('bucket_steps')}]")
        print(f"{r['model']:12s} {r['method']:17s} {'yes' if r.get('fused') else 'no':5s} {r['batch']:2d} {r['lora_rank']:3d} {r['completion_len']:5d} "
              f"{f('tokens_per_s', '9.1f')} {f('decode_tokens_per_s', '9.1f')} {f('ms_per_decode_step', '8.2f')} "
              f"{f('roofline_fraction', '8.3f')} {f('peak_gib', '8.1f')} {f('paper_vllm_tokens_per_s', '7.1f')}{status}")


def run(args) -> dict:
    device = torch.device(args.device)
    prov = sc.provenance(args.git_sha)
    print("env:", json.dumps(prov["env"]))
    copy_tbps = sc.copy_bandwidth_tbps() if device.type == "cuda" else None
    print(f"copy bandwidth (read + write): {copy_tbps} TB/s")
    rows = []
    t_start = time.time()
    settings = {k: v for k, v in vars(args).items() if k not in ("merge",)}

    def save(complete=False):  # after every row: a run cut off by a time limit keeps what it measured
        for r in rows:
            r.setdefault("git_sha", prov["git_sha"])
        result = assemble(rows, prov, copy_tbps, settings)
        result["complete"] = complete
        return result, sc.write_json(result, args.out, prov["gpu"])

    for mk in args.models:
        vocab = sc.vocab_size(mk)
        # QeRL's format first, QLoRA's (the slowest) last: a run cut off by the time limit keeps the rows
        # that matter most
        order = sorted(table_bases(), key=lambda f: (f != QERL_FORMAT, f == QLORA_FORMAT))
        fmts = [f for f in order if f in args.methods or (f == "bf16" and "hf_generate_bf16" in args.methods)
                or (f == QERL_FORMAT and STATIC in args.methods)]
        for fmt in fmts:
            t0 = time.time()
            base = dict(model=mk, method=fmt, batch=None, lora_rank=args.ranks[0], prompt_len=args.prompt,
                        completion_len=args.completion, phase="build")
            try:
                model = sc.build(mk, fmt, args.ranks[0], device, seed=args.seed)
            except Exception as e:  # noqa: BLE001
                rows.append({**base, "engine": None, "batch": 0, "oom": sc.is_oom(e),
                             "error": f"{type(e).__name__}: {str(e)[:500]}"})
                print(f"  build {mk} {fmt} failed: {type(e).__name__}: {str(e)[:200]}")
                sc.free()
                save()
                continue
            sc.sync()
            sizes = sc.model_bytes(model)
            build_s = time.time() - t0
            print(f"{mk} {fmt}: built in {build_s:.0f} s, model size {sizes['model_size_bytes'] / 1e9:.2f} GB")
            extra = dict(build_s=build_s, model_size_gb=sizes["model_size_bytes"] / 1e9, lora_gb=sizes["lora_bytes"] / 1e9)
            for rank in args.ranks:
                sc.set_lora_rank(model, rank, seed=args.seed)
                if args.lengths != "fixed":
                    # the same drawn lengths for every method at a batch size (seeded)
                    engines = ([True] if fmt in args.methods else []) + \
                              ([False] if fmt == QERL_FORMAT and STATIC in args.methods else [])
                    runs = [(b, c, None, True) for b in args.batch for c in engines]
                    if args.rows and fmt == QERL_FORMAT:  # the batch on fewer rows: refill and / or waves
                        runs += [(b, True, args.rows, rf) for b in args.batch if args.rows < b
                                 for rf in {"on": [True], "off": [False], "both": [True, False]}[args.refill]]
                    for b, compact, nrows, refill in runs:
                        lengths = sc.draw_lengths(args.lengths, b, args.completion, seed=args.seed)
                        base = dict(model=mk, method=fmt, engine="fast", batch=b, lora_rank=rank, prompt_len=args.prompt,
                                    completion_len=args.completion, lengths=args.lengths, compact=compact)
                        if nrows is not None:
                            base.update(max_batch=nrows, refill=refill)
                        row = guarded(base, time_mix_row, model, mk, fmt, b, rank, args.prompt, lengths, args.lengths,
                                      args.completion, vocab, compact, nrows, refill)
                        rows.append({**row, **extra})
                        print_table(rows[-1:])
                        save()
                elif fmt in args.methods:
                    for b in args.batch:
                        for fu in {"on": [None], "off": [False], "both": [False, None]}[args.fused]:  # None: where it can
                            row = guarded(dict(model=mk, method=fmt, engine="fast", batch=b, lora_rank=rank,
                                               prompt_len=args.prompt, completion_len=args.completion, fused=fu),
                                          time_fast_engine, model, mk, fmt, b, rank, args.prompt, args.completion,
                                          vocab, copy_tbps, fu)
                            rows.append({**row, **extra})
                            print_table(rows[-1:])
                            save()
                if formats.is_dense(fmt) and "hf_generate_bf16" in args.methods and rank == args.ranks[0]:
                    for b in args.hf_batch:
                        row = guarded(dict(model=mk, method="hf_generate_bf16", engine="hf_generate", batch=b,
                                           lora_rank=rank, prompt_len=args.prompt, completion_len=args.hf_completion),
                                      time_hf_generate, model, mk, b, rank, args.prompt, args.hf_completion, vocab)
                        rows.append({**row, **extra})
                        print_table(rows[-1:])
                        save()
            del model
            sc.free()
            print(f"  ({time.time() - t_start:.0f} s so far)")
    result, path = save(complete=True)
    print_table(rows)
    print(f"\nwrote {path} ({time.time() - t_start:.0f} s)")
    for k, v in result["mix_ratios"].items():
        if k not in TARGETS:
            print(f"{k:45s} {'-' if v is None else f'{v:.3f}':>8s}")
    for k, v in result["summary"].items():
        status = "n/a" if v is None else ("ok" if v >= TARGETS[k] else "MISSED")
        print(f"{k:45s} {'-' if v is None else f'{v:.3f}':>8s}  target >= {TARGETS[k]}  {status}  "
              f"[{result['summary_notes'][k]}]")
    return result


def parse_args(argv=None):
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="+", default=list(SUMMARY_MODELS), choices=list(sc.MODELS),
                    help="architectures (random weights)")
    ap.add_argument("--methods", nargs="+", default=["bf16", QLORA_FORMAT, QERL_FORMAT, "hf_generate_bf16"], choices=METHODS,
                    help="base formats timed with the fast engine, hf_generate_bf16 (HF generate, bf16 LoRA model), and "
                         f"{STATIC} (with --lengths: NVFP4 with the static batch)")
    ap.add_argument("--batch", nargs="+", type=int, default=[1, 8], help="batch sizes (sequences per rollout)")
    ap.add_argument("--ranks", nargs="+", type=int, default=[SUMMARY_RANK], help="LoRA ranks (alpha = 2 r)")
    ap.add_argument("--prompt", type=int, default=256, help="prompt length in tokens (paper: 256)")
    ap.add_argument("--completion", type=int, default=2048, help="completion length, fixed (paper: 2048)")
    ap.add_argument("--lengths", default="fixed", type=sc.lengths_arg,
                    help="completion lengths, the cap being --completion: " + sc.LENGTHS_HELP + f"; with a mix, "
                         f"{STATIC} in --methods times NVFP4 again with the static batch on the same lengths")
    ap.add_argument("--hf-completion", type=int, default=128, help="new tokens of the HF generate baseline")
    ap.add_argument("--hf-batch", nargs="+", type=int, default=[1], help="batch sizes of the HF generate baseline")
    ap.add_argument("--fused", choices=("on", "off", "both"), default="on",
                    help="fast engine decode through the fused Triton kernels (on: the engine's default, on CUDA), "
                         "the unfused torch ops (off), or both, side by side")
    ap.add_argument("--rows", type=int, default=None,
                    help="with a length mix: NVFP4 again with the batch on this many rows (max_batch)")
    ap.add_argument("--refill", choices=("on", "off", "both"), default="both",
                    help="with --rows: freed rows take waiting prompts (on), waves of --rows (off), or both")
    ap.add_argument("--attention", choices=("qerl", "sdpa"), default="qerl",
                    help="the fused decode step's attention: qerl's split-over-keys kernel (the engine's default) or "
                         "torch SDPA over the whole window (A/B)")
    sc.add_run_args(ap, out="results/rollout")
    args = ap.parse_args(argv)
    if args.rows is not None and (args.lengths == "fixed" or args.rows < 1):
        ap.error("--rows needs a length mix (--lengths mix) and at least 1 row")
    try:
        sc.check_lengths(args.lengths, args.completion)
    except ValueError as e:
        ap.error(str(e))
    if STATIC in args.methods and args.lengths == "fixed":
        ap.error(f"--methods {STATIC} needs a length mix (--lengths mix): at a fixed length the static batch is "
                 "the compacting engine's")
    return args


def main(argv=None):
    args = parse_args(argv)
    sc.ENGINE_OPTIONS["attention"] = args.attention
    result = sc.main_run_or_merge(args, run, merge, "rollout_throughput.py")
    C.declare(ARTEFACT, Path(args.out))
    return result


if __name__ == "__main__":
    main()
