"""Weight SQNR of each 4-bit format (NVFP4, MXFP4, NF4) over a model's q,k,v,o,gate,up,down.

How much signal each format keeps on real LLM weights: SQNR = 10 log10(sum w^2 / sum (w - w_hat)^2)
in dB, per matrix, aggregated per projection type (sum of signal over sum of noise across
layers) and over all of them. NVFP4 is measured twice: with the fused global scales vLLM deploys
((q,k,v) and (gate,up) share the max amax, as qerl.quantize does) and with a per-tensor global
scale. Embeddings and lm_head stay 16-bit in qerl and are not measured.

    python -m benchmarks.sqnr                                   # embedded SmolLM2-135M-Instruct
    python -m benchmarks.sqnr --model /path/to/hf_folder_or_file.gguf [--dtype float32]

Writes results/sqnr/<model-name>.json (provenance: command, git sha, date, versions) and prints
a markdown table. Runtime: ~10-20 s on 2 CPU cores for the 135M model (plus a one-off GGUF
conversion into the qerl cache); on a CPU shared with other jobs, OMP_NUM_THREADS=1 avoids
thread oversubscription (10x faster there).

Caveat for the embedded model: its GGUF is Q4_1, so the "original" weights are already Q4_1
values (dequantized by transformers); SQNR is measured against those, not against the
upstream bf16 checkpoint. The JSON records the GGUF tensor types.
"""

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

from qerl import formats
from qerl.arch import FUSED_GROUPS, LINEAR_NAMES

# ----------------------------------------------------------------------------------------------
# CLI

PROJS = LINEAR_NAMES
FUSED = {p: group[0] for _, group in FUSED_GROUPS for p in group}  # projection -> its fused group's key
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}
# (column, format, fused global scale): every registered format; a format with a fused global scale
# (nvfp4) also gets a column with each matrix's own global scale ("<fmt>_per_tensor_gs").
COLUMNS = tuple(col for f in formats.names() for col in (
    ((f, f, True), (f"{f}_per_tensor_gs", f, False)) if formats.get(f).fused_global_scale else ((f, f, False),)))


def parse_args(argv=None):
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct",
                   help="local HF folder, a .gguf file, or the embedded 'smollm2-135m-instruct'")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES),
                   help="dtype the weights are loaded in and quantized from (qerl trains from bf16)")
    p.add_argument("--device", default="cpu", help="torch device for the quantization")
    p.add_argument("--out", default="results/sqnr", help="output folder for <model-name>.json")
    return p.parse_args(argv)


# ----------------------------------------------------------------------------------------------
# Model loading


def model_name(name_or_path: str) -> str:
    p = Path(name_or_path)
    if p.suffix == ".gguf":
        return p.stem
    return p.name if p.exists() else name_or_path.replace("/", "__")


def gguf_file_of(name_or_path: str) -> Path | None:
    """The GGUF file behind `--model`, if any (for recording its tensor types)."""
    if name_or_path.endswith(".gguf"):
        return Path(name_or_path)
    try:
        from qerl.models import DEFAULT_MODEL, embedded_gguf_path

        if name_or_path.lower() == DEFAULT_MODEL:
            return embedded_gguf_path()
    except ImportError:
        pass
    return None


def load(name_or_path: str, dtype: torch.dtype):
    """qerl.models.load_model when present; otherwise transformers directly (HF dir or GGUF)."""
    try:
        from qerl.models import load_model
    except ImportError:
        load_model = None
    if load_model is not None:
        return load_model(name_or_path, dtype=dtype)[0]
    from transformers import AutoModelForCausalLM

    p = Path(name_or_path)
    if p.suffix == ".gguf":
        return AutoModelForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name, dtype=dtype)
    return AutoModelForCausalLM.from_pretrained(str(p), dtype=dtype)


def gguf_tensor_types(path: Path) -> dict:
    """Count of GGUF tensor types per projection kind, e.g. {"ffn_down": {"Q4_1": 30}}."""
    from gguf import GGUFReader

    counts = defaultdict(lambda: defaultdict(int))
    for t in GGUFReader(str(path)).tensors:
        kind = t.name.split(".")[-2] if t.name.startswith("blk.") else t.name.rsplit(".", 1)[0]
        counts[kind][t.tensor_type.name] += 1
    return {k: dict(v) for k, v in sorted(counts.items())}


# ----------------------------------------------------------------------------------------------
# Measurement


def linear_weights(model) -> dict[str, torch.Tensor]:
    out = {}
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear) and name.rsplit(".", 1)[-1] in PROJS:
            out[name] = mod.weight.detach()
    if not out:
        raise ValueError(f"no Linear modules named {PROJS} found in {type(model).__name__}")
    return out


def fused_scales(weights: dict[str, torch.Tensor], fmt: str) -> dict[str, torch.Tensor]:
    """The global scale of `fmt` (its spec's fused_global_scale) per module, (q,k,v) and (gate,up) of
    each block sharing one."""
    groups = defaultdict(list)
    for name in weights:
        parent, proj = name.rsplit(".", 1)
        groups[(parent, FUSED.get(proj, proj))].append(name)
    scales = {}
    for names in groups.values():
        gs = formats.get(fmt).fused_global_scale([weights[n] for n in names])
        scales.update({n: gs for n in names})
    return scales


def measure(weights: dict[str, torch.Tensor], device: str) -> list[dict]:
    """Per-matrix signal and noise energies (fp64) for every column."""
    gs_fused = {fmt: fused_scales(weights, fmt) for _, fmt, fuse in COLUMNS if fuse}
    rows = []
    for name, w in weights.items():
        w = w.to(device)
        w64 = w.double()
        row = {"module": name, "proj": name.rsplit(".", 1)[-1], "shape": list(w.shape),
               "signal": float(w64.pow(2).sum())}
        for col, fmt, fuse in COLUMNS:
            gs = gs_fused[fmt][name].to(device) if fuse else None
            w_hat = formats.dequantize(formats.quantize(w, fmt, global_scale=gs), fmt, dtype=torch.float32)
            row[f"noise_{col}"] = float((w64 - w_hat.double()).pow(2).sum())
        rows.append(row)
    return rows


def db(signal: float, noise: float) -> float | None:
    import math

    return None if noise == 0 else 10 * math.log10(signal / noise)


def summarise(rows: list[dict]) -> dict:
    """Aggregate SQNR (total signal / total noise) per projection and overall, plus the worst matrix."""
    out = {}
    for proj in PROJS + ("all",):
        sel = [r for r in rows if proj == "all" or r["proj"] == proj]
        if not sel:
            continue
        sig = sum(r["signal"] for r in sel)
        out[proj] = {"num_matrices": len(sel)}
        for col, _, _ in COLUMNS:
            out[proj][col] = db(sig, sum(r[f"noise_{col}"] for r in sel))
            out[proj][f"{col}_min_matrix"] = min(db(r["signal"], r[f"noise_{col}"]) or float("inf") for r in sel)
    return out


# ----------------------------------------------------------------------------------------------
# Main


def main(argv=None):
    args = parse_args(argv)
    from qerl.logging import environment

    t0 = time.perf_counter()
    model = load(args.model, DTYPES[args.dtype])
    t_load = time.perf_counter() - t0
    weights = linear_weights(model)
    t0 = time.perf_counter()
    rows = measure(weights, args.device)
    t_measure = time.perf_counter() - t0
    summary = summarise(rows)

    for r in rows:
        for col, _, _ in COLUMNS:
            r[f"sqnr_db_{col}"] = db(r["signal"], r[f"noise_{col}"])
    gguf = gguf_file_of(args.model)
    result = {
        "command": " ".join(["python"] + sys.argv),
        **environment(),
        "model": args.model,
        "model_class": type(model).__name__,
        "dtype": args.dtype,
        "gguf_file": str(gguf) if gguf else None,
        "gguf_tensor_types": gguf_tensor_types(gguf) if gguf else None,
        "definition": "SQNR dB = 10 log10(sum w^2 / sum (w - dequant(quant(w)))^2); aggregates pool "
                      "signal and noise over the matrices of a row",
        "columns": {c: {"format": f, "fused_global_scale": fz, "bits_per_weight": formats.bits_per_weight(f)}
                    for c, f, fz in COLUMNS},
        "time_s": {"load": round(t_load, 2), "quantize_all_formats": round(t_measure, 2)},
        "torch_threads": torch.get_num_threads(),
        "summary": summary,
        "per_matrix": rows,
    }
    out = Path(args.out) / f"{model_name(args.model)}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))

    print(f"SQNR (dB) of {args.model} ({args.dtype}, {summary['all']['num_matrices']} matrices); "
          f"wrote {out}\n")
    header = " | ".join(f"{c} ({formats.bits_per_weight(f)} b/w)" for c, f, _ in COLUMNS)
    print(f"| weights | {header} |")
    print("|---" * (len(COLUMNS) + 1) + "|")
    for proj, s in summary.items():
        cells = " | ".join(f"{s[c]:.2f}" for c, _, _ in COLUMNS)
        print(f"| {proj} (x{s['num_matrices']}) | {cells} |")
    print(f"\nquantize+dequantize of all formats took {t_measure:.1f} s on {args.device}")


if __name__ == "__main__":
    main()
