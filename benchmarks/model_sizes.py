"""The paper's "Model Size" column (Table 3): bf16 vs NVFP4/MXFP4/NF4 bytes of Qwen2.5-3B/7B/14B/32B.

Computed on the meta device from the public configs (no weights): quantize_ allocates the packed
buffers with their real shapes, and the size is the sum of parameter and buffer bytes (LoRA
excluded; embeddings and lm_head stay bf16, as in the paper). The paper's numbers are a labelled
reference column.

    python -m benchmarks.model_sizes        # seconds, CPU; writes results/model_sizes/sizes.json
"""

import json
import sys
from pathlib import Path

from qerl import formats
from qerl.arch import QWEN25_CONFIGS
from qerl.logging import environment
from qerl.models import build_model_from_config
from qerl.quantize import QuantizeConfig, model_size_bytes, quantize_

PAPER_GB = {  # paper Table 3, "Model Size" (GB), reference only
    "Qwen/Qwen2.5-7B-Instruct": {"bf16": 15.2, "nvfp4": 5.9},
    "Qwen/Qwen2.5-14B-Instruct": {"bf16": 29.6, "nvfp4": 10.6},
    "Qwen/Qwen2.5-32B-Instruct": {"bf16": 62.3, "nvfp4": 20.7},
}


def main():
    rows = []
    for name in QWEN25_CONFIGS:
        row = {"model": name, "bf16_gb": model_size_bytes(build_model_from_config(name, device="meta")) / 1e9}
        for fmt in formats.names():
            m = build_model_from_config(name, device="meta")
            quantize_(m, QuantizeConfig(fmt=fmt, lora_rank=0))
            row[f"{fmt}_gb"] = model_size_bytes(m) / 1e9
        for k, v in PAPER_GB.get(name, {}).items():
            row[f"paper_{k}_gb"] = v
        rows.append(row)
    out = Path("results/model_sizes/sizes.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"command": " ".join(["python"] + sys.argv), **environment(), "unit": "GB (1e9 bytes)",
                               "rows": rows}, indent=2))
    fmts = ("bf16",) + formats.names()
    print("| model | " + " | ".join(f"{f} GB" for f in fmts) + " | paper bf16 | paper nvfp4 |")
    print("|---" * (len(fmts) + 3) + "|")
    for r in rows:
        print(f"| {r['model']} | " + " | ".join(f"{r[f + '_gb']:.1f}" for f in fmts)
              + f" | {r.get('paper_bf16_gb', '-')} | {r.get('paper_nvfp4_gb', '-')} |")


if __name__ == "__main__":
    main()
