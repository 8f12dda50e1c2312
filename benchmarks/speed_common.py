"""Helpers shared by the speed experiments (rollout_throughput.py, table3_speed_memory.py).

Random-weight models of the paper's architectures built straight into a format (qerl.models.
build_quantized_model: layer by layer, never a dense copy), random token prompts, the fast engine
with a cheap warm-up (every CUDA graph the timed call needs is captured by short calls first),
OOM-safe phases, and provenance. Speed does not depend on weight values, so random weights time
exactly what real weights would.
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import inspect
import json
import math
import statistics
import time
from pathlib import Path

import torch

from qerl import formats  # noqa: E402
from qerl.arch import PAPER_MODELS
from qerl.config import table_bases
from qerl.logging import environment
from qerl.qlinear import QuantLinear
from qerl.quantize import QuantizeConfig, model_size_bytes
from qerl.rollout.fast import buckets

MODELS = {
    **PAPER_MODELS,  # "qwen2.5-7b" -> "Qwen/Qwen2.5-7B-Instruct" (qerl.arch)
    # a toy architecture for the scripts' CPU smoke tests (--models tiny-qwen2 --device cpu)
    "tiny-qwen2": dict(model_type="qwen2", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, vocab_size=256, tie_word_embeddings=True,
                       eos_token_id=2, bos_token_id=1, max_position_embeddings=4096),
}
FORMATS = table_bases()  # base weight formats (bf16 and the format registry); LoRA on top of each
FIRST_SPECIAL_TOKEN = 151643  # Qwen2.5's <|endoftext|>; prompts use ordinary token ids below it


# ----------------------------------------------------------------------------------------------
# provenance


def gpu_tag() -> str:
    """'h100', 'h200', else the device name in lower case ('cpu' without CUDA)."""
    if not torch.cuda.is_available():
        return "cpu"
    name = torch.cuda.get_device_name(0)
    return "h100" if "H100" in name else "h200" if "H200" in name else name.lower().replace(" ", "_")


def vocab_size(model: str) -> int:
    from qerl.models import model_config

    return model_config(MODELS[model]).vocab_size


def provenance(git_sha: str | None = None) -> dict:
    """gpu, git_sha, date and the environment (versions, GPU memory, bitsandbytes)."""
    env = environment()
    if git_sha:
        env["git_sha"] = git_sha
    try:
        import bitsandbytes

        env["bitsandbytes"] = bitsandbytes.__version__
    except Exception as e:  # noqa: BLE001 - record why, the nf4 rows will say so too
        env["bitsandbytes"] = f"not importable: {type(e).__name__}"
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        env["gpu_total_gib"] = props.total_memory / 2**30
        env["cuda"] = torch.version.cuda
        from qerl import kernels

        env["pdl"] = kernels.pdl(torch.device("cuda", 0))  # programmatic dependent launch of qerl's kernels (QERL_PDL)
    return {"gpu": gpu_tag(), "git_sha": env.get("git_sha"),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "env": env}


def copy_bandwidth_tbps(nbytes: int = 1 << 30, reps: int = 20) -> float:
    """Device-to-device copy bandwidth in TB/s, bytes read plus written (median of ``reps`` copies)."""
    a = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        b.copy_(a)
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) / 1e3)
    del a, b
    return 2 * nbytes / statistics.median(times) / 1e12


def write_json(result: dict, out_dir: str, gpu: str) -> Path:
    path = Path(out_dir) / f"{gpu}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1))
    return path


# ----------------------------------------------------------------------------------------------
# models


def build(model: str, fmt: str, lora_rank: int, device, seed: int = 0, config=None):
    """The random-weight model `model` (a key of MODELS, or any config via `config`) with its
    decoder linears in `fmt` and LoRA rank `lora_rank` (alpha = 2 r, the paper's 32/64), built
    layer by layer on `device`."""
    from qerl.models import build_quantized_model

    qc = QuantizeConfig(fmt=fmt, lora_rank=lora_rank, lora_alpha=2.0 * lora_rank)
    return build_quantized_model(config if config is not None else MODELS[model], qc, device=device, seed=seed)


def set_lora_rank(model, rank: int, seed: int = 0) -> None:
    """Replace every QuantLinear's adapter by a fresh one of rank `rank` (PEFT init, alpha = 2 r),
    so one built base serves several ranks. Engines must be rebuilt afterwards (their graphs hold
    the old adapters)."""
    g = torch.Generator().manual_seed(seed)
    for m in model.modules():
        if not isinstance(m, QuantLinear) or m.r == rank:
            continue
        dev = (m.weight if formats.is_dense(m.fmt) else m.weight_packed).device
        dt = m.lora_A.weight.dtype if m.r else torch.float32
        m.r, m.lora_alpha = rank, 2.0 * rank
        m.scaling = m.lora_alpha / rank
        m.lora_A = torch.nn.Linear(m.in_features, rank, bias=False, device=dev, dtype=dt)
        m.lora_B = torch.nn.Linear(rank, m.out_features, bias=False, device=dev, dtype=dt)
        if not hasattr(m, "lora_dropout"):
            m.lora_dropout = torch.nn.Identity()
        bound = 1 / math.sqrt(m.in_features)  # kaiming_uniform(a=sqrt(5)), as PEFT
        with torch.no_grad():
            m.lora_A.weight.copy_((torch.rand(m.lora_A.weight.shape, generator=g) * 2 - 1) * bound)
            m.lora_B.weight.zero_()


def model_bytes(model) -> dict:
    """Bytes of the model as stored: base (the paper's Model Size), LoRA, embedding, lm_head."""
    lora = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if ".lora_" in n)
    head = model.get_output_embeddings().weight
    emb = model.get_input_embeddings().weight
    return {"model_size_bytes": model_size_bytes(model), "lora_bytes": lora,
            "lm_head_bytes": head.numel() * head.element_size(), "embedding_bytes": emb.numel() * emb.element_size(),
            "tied_embeddings": head is emb}


def decode_bytes_per_step(model, batch: int, context: float) -> dict:
    """HBM bytes one decode step must read, at least (the roofline numerator).

      weights = every decoder-layer tensor (packed base + scales + global scales, biases, LoRA A and
                B, norms) + final norm + lm_head (read whole for every step)
                + batch rows of the embedding table (only the looked-up rows are read)
      kv      = layers * 2 (K and V) * batch * kv_heads * head_dim * context * bytes per element
    `context` is the mean cache length over the completion (prompt + completion / 2). Activations
    and the sampled-token bookkeeping are ignored (kilobytes). The fast engine's attention reads a
    power-of-two window of the cache, not just the valid context; that excess is its overhead and
    is not counted as useful bytes.
    """
    cfg = model.config
    layers = model.model.layers
    layer_bytes = sum(t.numel() * t.element_size() for t in list(layers.parameters()) + list(layers.buffers()))
    norm = model.model.norm.weight
    head = model.get_output_embeddings().weight
    emb = model.get_input_embeddings().weight
    weights = layer_bytes + norm.numel() * norm.element_size() + head.numel() * head.element_size()
    weights += batch * emb.shape[1] * emb.element_size()
    n_kv = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv = len(layers) * 2 * batch * n_kv * head_dim * context * emb.element_size()
    return {"weight_bytes": int(weights), "kv_bytes": int(kv), "bytes_per_step": int(weights + kv)}


def free() -> None:
    """Collect garbage and return cached blocks to the GPU (after the caller dropped its references)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ----------------------------------------------------------------------------------------------
# engines


def random_prompts(batch: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """`batch` prompts of exactly `length` ordinary token ids (below any special token)."""
    hi = min(vocab, FIRST_SPECIAL_TOKEN)
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, hi, (batch, length), generator=g).tolist()


# FastEngine options every benchmark engine takes (a script's --attention sets "attention")
ENGINE_OPTIONS: dict = {}


def make_fast_engine(model, batch: int, max_seq_len: int, kind: str = "fast", cuda_graphs: bool | None = None,
                     fused: bool | None = None, compact: bool = True, max_batch: int | None = None,
                     refill: bool = True):
    """qerl.rollout.make_engine for benchmark rollouts (EOS = the config's, pad 0); ``compact=False``:
    the static batch (finished rows stay); ``max_batch``: the rows (more sequences refill them, or run
    in waves with ``refill=False``); ENGINE_OPTIONS added. Keyword arguments this version of the engine
    does not take are dropped."""
    from qerl import rollout

    kw = dict(eos_token_ids=[int(getattr(model.config, "eos_token_id", 0) or 0)], pad_id=0,
              max_batch_size=batch, max_seq_len=max_seq_len, cuda_graphs=cuda_graphs, fused=fused, compact=compact,
              **ENGINE_OPTIONS)
    if max_batch is not None:
        kw.update(max_batch=max_batch, refill=refill)
    if kind == "fast":
        accepted = inspect.signature(rollout.FastEngine.__init__).parameters
        kw = {k: v for k, v in kw.items() if k in accepted}
    return rollout.make_engine(model, None, kind=kind, **kw)


SAMPLING = dict(temperature=1.0, top_p=1.0, top_k=0, greedy=False, ignore_eos=True)


# ----------------------------------------------------------------------------------------------
# completion lengths
#
# A GRPO rollout's completions differ in length: most answers end well before the cap and a few run
# to it. DAPO (arXiv 2503.14476) shows both: the mean response length it plots over training stays
# well below its generation cap, and its Overlong Reward Shaping (truncated samples filtered, a soft
# penalty near the cap) exists because some responses do reach the cap. The
# benchmarks time either every sequence at the cap (``fixed``, the paper's Table 3 setting) or a
# clipped log-normal, which has that shape: a bulk of short answers and a long right tail. ``mix``,
# the documented default, is median cap / 4 with the 95th percentile at the cap (sigma = ln 4 /
# 1.645 = 0.843), so about 5% of the sequences reach the cap and the mean is about a third of it.
# These two parameters are a choice that matches that shape, not a fit to a published
# distribution; ``lognormal:median=M,p95=Q`` times any other. Each sequence is forced to end at its
# drawn length (EOS ignored, the engine's per-sequence cap), so every engine decodes the same tokens.
Z95 = 1.6448536269514722  # the standard normal's 95th percentile
LENGTH_FIELDS = ("median", "p95")
LENGTHS_HELP = ("fixed (every sequence at the cap) | mix (clipped log-normal: median cap / 4, 95th percentile at "
                "the cap) | lognormal:median=M[,p95=Q] (tokens, or fractions of the cap when <= 1; p95 defaults to "
                "the cap)")


def parse_lengths(spec: str) -> dict:
    """``fixed`` | ``mix`` | ``lognormal:median=M[,p95=Q]`` as a dict (M, Q: tokens, or fractions of the
    cap when <= 1; Q defaults to the cap); a ValueError naming the problem otherwise. Whether M < Q
    in tokens depends on the cap: ``lognormal_params`` checks that."""
    text = spec.strip() if isinstance(spec, str) else spec
    if text == "fixed":
        return {"kind": "fixed"}
    if text == "mix":
        return {"kind": "lognormal", "median": 0.25, "p95": 1.0}
    kind, _, rest = str(text).partition(":")
    if kind != "lognormal" or not rest:
        raise ValueError(f"lengths {spec!r}: expected 'fixed', 'mix' or 'lognormal:median=M[,p95=Q]'")
    out = {"kind": "lognormal"}
    for item in rest.split(","):
        k, _, v = item.strip().partition("=")
        if k not in LENGTH_FIELDS or not v:
            raise ValueError(f"lengths {spec!r}: unknown or empty field {item!r} (expected median=M, p95=Q)")
        if k in out:
            raise ValueError(f"lengths {spec!r}: {k}= given twice")
        try:
            out[k] = float(v)
        except ValueError:
            raise ValueError(f"lengths {spec!r}: {k}={v!r} is not a number") from None
        if not (math.isfinite(out[k]) and out[k] > 0):
            raise ValueError(f"lengths {spec!r}: {k}={v!r} must be a positive finite number")
    if "median" not in out:
        raise ValueError(f"lengths {spec!r}: median= is required")
    out.setdefault("p95", 1.0)
    return out


def lognormal_params(spec: str | dict, cap: int) -> tuple[float, float]:
    """(mu, sigma) of the log-normal of a ``lognormal`` spec at this cap, in tokens; a ValueError unless
    1 <= median < p95."""
    d = parse_lengths(spec) if isinstance(spec, str) else spec
    if cap < 1:
        raise ValueError(f"the length cap must be >= 1, got {cap}")

    def tokens(v):
        return v * cap if v <= 1 else v

    median, p95 = tokens(d["median"]), tokens(d["p95"])
    if not 1 <= median < p95:
        raise ValueError(f"lengths {spec!r} at cap {cap}: need 1 <= median < p95 in tokens, got median {median:g}, "
                         f"p95 {p95:g}")
    return math.log(median), math.log(p95 / median) / Z95


def check_lengths(spec: str, cap: int) -> str:
    """``spec`` if it can be drawn at ``cap`` (the CLI's check), else a ValueError."""
    if parse_lengths(spec)["kind"] != "fixed":
        lognormal_params(spec, cap)
    return spec


def lengths_arg(spec: str) -> str:
    """argparse ``type`` of ``--lengths``: the spec if it parses (its check against the cap comes after
    parsing, ``check_lengths``)."""
    import argparse

    try:
        parse_lengths(spec)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return spec


def draw_lengths(spec: str | dict, n: int, cap: int, seed: int = 0) -> list[int]:
    """``n`` completion lengths, integers in [1, cap], from the spec (``parse_lengths``): the log-normal
    rounded to the nearest integer and clipped to [1, cap]. Seeded with numpy's PCG64 bit generator
    (no global state; the same lengths on every machine and every torch version)."""
    import numpy as np

    d = parse_lengths(spec) if isinstance(spec, str) else spec
    if d["kind"] == "fixed":
        return [int(cap)] * n
    mu, sigma = lognormal_params(d, cap)
    x = np.random.Generator(np.random.PCG64(seed)).lognormal(mu, sigma, n)
    return [int(v) for v in np.clip(np.rint(x), 1, cap)]


def length_summary(lengths: list[int], cap: int) -> dict:
    """median, 95th percentile, mean, max, sum and the fraction at the cap of drawn lengths (result rows)."""
    import numpy as np

    a = np.asarray(lengths, dtype=float)
    return {"median": float(np.median(a)), "p95": float(np.percentile(a, 95)), "mean": float(a.mean()),
            "max": int(a.max()), "total": int(a.sum()), "cap": int(cap), "at_cap_frac": float((a >= cap).mean())}


def decode_windows(prompt_len: int, completion_len: int) -> list[int]:
    """The attention windows (CUDA graphs) FastEngine replays for this prompt/completion (see fast.py)."""
    try:
        from qerl.rollout.fast import WINDOW
    except ImportError:
        return []
    L = WINDOW * math.ceil((prompt_len + completion_len) / WINDOW)
    windows = sorted({min(L, WINDOW * 2 ** i) for i in range(32) if WINDOW * 2 ** (i - 1) < L})
    return sorted({next(w for w in windows if w > prompt_len + t - 1) for t in range(1, completion_len)})


def warm_up_engine(engine, batch: int, prompt_len: int, completion_len: int, vocab: int,
                   lengths: list[int] | None = None, rows: int | None = None) -> float:
    """Capture every CUDA graph the timed call will replay, without a full-length rollout: with a
    compacting engine and ``lengths`` that differ (the timed call's per-sequence caps), every window
    at every batch bucket; else every window at the whole batch (sequences that all end together
    never leave the batch).

    A 2-token call at the real prompt length allocates the (B, L) buffers and warms the prefill GEMMs
    (Triton autotuning keys on M). Then each attention window w the timed call uses is captured:
    directly with FastEngine._graph(w, sampling) where the engine has it (no extra prefill), else
    with a (w - 2)-token prompt and 2 new tokens (a long prefill: more transient memory). Returns the
    seconds spent; the timed call checks engine.stats["captures"] did not move.
    """
    t0 = time.perf_counter()
    engine.generate(random_prompts(batch, prompt_len, vocab, seed=1), 2, seed=1, **SAMPLING)
    # with ``rows`` (refill) the cursor runs on past prompt + completion, up to the cache's end
    span = completion_len + (getattr(engine, "sync_every", 16) + 1 if rows else 0)
    windows = decode_windows(prompt_len, span) if getattr(engine, "cuda_graphs", False) else []
    key = (float(SAMPLING["temperature"]), int(SAMPLING["top_k"]), float(SAMPLING["top_p"]), bool(SAMPLING["greedy"]),
           bool(SAMPLING["ignore_eos"]))  # FastEngine's graph key for these settings
    # a compacting engine replays each window at every batch bucket the sequences can shrink to (the
    # static batch, or one length for all: the whole batch, _graph's default)
    shrinks = getattr(engine, "compact", False) and lengths is not None and len(set(lengths)) > 1
    sizes = buckets(rows or batch) if shrinks else [None]  # ``rows``: the batch decodes on that many rows
    for w in windows:
        if hasattr(engine, "_graph"):
            for n in sizes:
                if n is None:
                    engine._graph(w, key)
                else:
                    engine._graph(w, key, n)
        elif w - 2 != prompt_len:
            engine.generate(random_prompts(batch, max(1, w - 2), vocab, seed=w), 2, seed=1, **SAMPLING)
    sync()
    return time.perf_counter() - t0


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def captures(engine) -> int:
    return int(getattr(engine, "stats", {}).get("captures", 0))


def reset_peak() -> None:
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()


def peak_gib() -> float | None:
    return torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None


# ----------------------------------------------------------------------------------------------
# OOM-safe phases


class PhaseTimer:
    """Wall seconds of named phases, the GPU synchronized at both ends of each, and the phase that is
    running (``current``: the one an exception escaped from; None between phases).

        timer = PhaseTimer()
        with timer("rollout"): ...
        timer.seconds -> {"rollout": 12.3}
    """

    def __init__(self):
        self.seconds: dict[str, float] = {}
        self.current: str | None = None

    @staticmethod
    def sync() -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    @contextlib.contextmanager
    def __call__(self, name: str):
        self.current = name
        self.sync()
        t0 = time.perf_counter()
        yield
        self.sync()
        self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t0
        self.current = None


def is_oom(e: BaseException) -> bool:
    """CUDA out-of-memory (torch.OutOfMemoryError, or the same message from another library)."""
    return isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e).lower()


def apply_memory_cap(cap_gib: float | None) -> float | None:
    """Cap this process's CUDA allocations at `cap_gib` (the paper's 80 GB H100 on a larger GPU).

    Returns the effective cap in GiB (the device total when that is smaller), None for no cap.
    """
    if cap_gib is None or not torch.cuda.is_available():
        return None
    total = torch.cuda.get_device_properties(0).total_memory / 2**30
    torch.cuda.set_per_process_memory_fraction(min(1.0, cap_gib / total), 0)
    return min(cap_gib, total)


def add_run_args(ap, out: str) -> None:
    """The flags every speed script shares: device, seed, output folder, provenance, merge."""
    ap.add_argument("--device", default="cuda", help="cuda; cpu only for the smoke test with --models tiny-qwen2")
    ap.add_argument("--seed", type=int, default=0, help="seed of the random weights and prompts")
    ap.add_argument("--out", default=out, help="folder for <gpu>.json")
    ap.add_argument("--git-sha", default=None, help="commit measured (when the machine has no .git; else QERL_GIT_SHA)")
    ap.add_argument("--merge", nargs="+", default=None, help="merge these result files into --out (no GPU)")


def merged_runs(paths, files, extra: tuple = ()) -> list[dict]:
    """The runs behind a merged result file: each input's own ``runs`` where it is a merge itself (so
    the provenance of rows merged earlier is kept), else the input file with its commit, date and settings."""
    runs = []
    for p, f in zip(paths, files):
        if f.get("runs"):
            runs.extend(f["runs"])
        else:
            runs.append({"file": str(p), "git_sha": f.get("git_sha"), "date": f.get("date"),
                         **{k: f.get(k) for k in extra}, "settings": f.get("settings")})
    return runs


def main_run_or_merge(args, run, merge, script: str) -> dict:
    """A speed script's main: merge result files (CPU), or run on the GPU; print the summary as the
    last stdout line (one JSON object) and return the result."""
    import sys

    if args.merge:
        result = merge(args.merge, args.out)
    else:
        if args.device == "cuda" and not torch.cuda.is_available():
            sys.exit(f"{script} needs a CUDA GPU (use --merge to combine result files)")
        result = run(args)
    print(json.dumps(result["summary"]))
    return result

