"""Paper Table 1 (GSM8K, GRPO): every row, at a chosen profile.

Rows: the untrained base in bf16 / nf4 / mxfp4 / nvfp4 (evaluation only); BF16 full fine-tuning
(lr 1e-5), BF16 LoRA, NF4 LoRA, MXFP4 LoRA, NVFP4 LoRA and NVFP4 LoRA + AQN, each trained with GRPO
(TRL loss_type "grpo", beta 0, clip 0.2 / 0.28: pinned here, whatever the profile's default) over
every seed. Each row is a `python -m qerl train|eval` process (several at once with --parallel; the
135M model leaves a GPU mostly idle) in a new run root (experiments/_common.py); it writes
<root>/results/table1/<profile>/table.csv (long form: model, method, dataset, metric, value, seed,
run, git_sha), summary.csv / summary.md (mean +- std over seeds) and <root>/results/figures/table1.png.
--publish copies them into results/.

    python -m experiments.table1_gsm8k --profile small --parallel 4   # 1 H100 or H200, ~25 min (22 rows)
    python -m experiments.table1_gsm8k --profile smoke --methods nvfp4_lora --base-rows   # CPU, ~3 min
    python -m experiments.table1_gsm8k --profile paper --gpus 0 1 2 3 4 5 6 7   # Qwen2.5-3B and 7B
    python -m experiments.table1_gsm8k --profile small --dry-run          # the planned runs and commands

small = the embedded SmolLM2-135M-Instruct on the built-in arith task (level 0), where the model
starts at ~15% and can learn; paper = Qwen2.5-3B/7B-Instruct on GSM8K with Table 4 settings
(qerl.config.PROFILES["paper"]: GRPO, 16 prompts x 8 samples, 4 updates per rollout, 4096 tokens,
lr 1e-5, bf16 LoRA 5e-6), ~600 steps per run; not run here (the paper used 8 H100s per run).
Seeds: smoke 0; small 0 1 2; paper 0.
"""

from __future__ import annotations

from experiments import _common as C
from qerl.config import METHODS, table_bases

NAME = "table1"
BASE_ROWS = table_bases()  # untrained rows: bf16 and every registered format
PAPER_MODELS = ("Qwen/Qwen2.5-7B-Instruct", "Qwen/Qwen2.5-3B-Instruct")
# Reference only (docs/design.md): GSM8K accuracy (%), paper Table 1.
PAPER_TABLE1 = {"bf16": 76.3, "bf16_full": 91.2, "bf16_lora": 88.1, "nf4_lora": 85.0, "nvfp4_lora": 88.5,
                "nvfp4_lora_aqn": 90.8}  # Qwen2.5-7B-Instruct
PAPER_TABLE1_3B = {"bf16": 61.2, "bf16_lora": 76.1, "nvfp4_lora_aqn": 83.7}  # Qwen2.5-3B-Instruct


def add_args(ap):
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    ap.add_argument("--base-rows", nargs="*", default=list(BASE_ROWS), choices=BASE_ROWS)


def plan(args) -> list[C.Run]:
    runs = []
    for model in args.models:
        runs += [C.eval_run(args, fmt, model=model) for fmt in args.base_rows]
        for m in args.methods:
            runs += [C.train_run(args, m, s, model=model, **C.GRPO) for s in args.seeds]
    return runs


OUTPUTS = C.Outputs(figure="table1", notebook="notebooks/table1.ipynb")
EXPERIMENT = C.Experiment(NAME, __doc__, plan, paper_models=PAPER_MODELS, curves=False, add_args=add_args, outputs=OUTPUTS)

if __name__ == "__main__":
    raise SystemExit(C.main(EXPERIMENT))
