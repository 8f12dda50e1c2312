"""Paper Table 2 (BigMath, DAPO): accuracy on MATH500, AIME24, AIME25 and AMC23, and their average.

Rows per model, as in the paper: the untrained base in bf16 and nvfp4 (evaluation only); BF16
full fine-tuning; BF16 LoRA; NVFP4 LoRA; NVFP4 LoRA + AQN (QeRL). Training uses DAPO as the paper
ran it (TRL 0.18 loss_type "bnpo", beta 0, eps_high 0.28).

    python -m experiments.table2_bigmath --profile small --parallel 6 --data-dir /path/to/data  # 1 H200, ~10 min
    python -m experiments.table2_bigmath --profile smoke --data-dir /path/to/data   # CPU, ~6 x 3 min
    python -m experiments.table2_bigmath --profile paper --gpus 0 1 2 3 4 5 6 7 --data-dir DATA  # the user's GPUs

paper = Qwen2.5-7B and 14B-Instruct trained on BigMath levels 3-5 with Table 4's BigMath column
(qerl.config.TABLE4_BIGMATH: 8 prompts x 16 samples, 1 update per rollout, 8192 tokens, 500 steps)
and evaluated with 4096 tokens, T 0.6, top-p 0.95 (days per run; the paper used 8 H100s). The
paper's 32B row trained on levels 4-5: `--models Qwen/Qwen2.5-32B-Instruct` runs it with
bigmath_config=level_4_5 (set here for any 32B model); 32B full fine-tuning needs FSDP, which
qerl does not implement (data parallel replicates the weights, see the README).
small / smoke = the embedded SmolLM2-135M-Instruct: BigMath is beyond a 135M model and has no local
copy, so it trains with DAPO on the profile's arith task and is evaluated on arith plus the four
Table 2 benchmarks (expect ~0 there: the rows check the pipeline, not the paper's claim).
The benchmarks load from --data-dir (a folder of the benchmarks' JSONL files) or the Hugging Face hub.
Seeds: smoke 0; small 0; paper 0. Writes <run root>/results/table2_bigmath/<profile>/ and
<run root>/results/figures/table2_bigmath.png.
"""

from __future__ import annotations

from experiments import _common as C

NAME = "table2_bigmath"
BASE_ROWS = ("bf16", "nvfp4")
METHODS = ("bf16_full", "bf16_lora", "nvfp4_lora", "nvfp4_lora_aqn")
PAPER_MODELS = ("Qwen/Qwen2.5-7B-Instruct", "Qwen/Qwen2.5-14B-Instruct")


def plan(args) -> list[C.Run]:
    task = C.bigmath_task(args.profile)
    if args.profile != "paper":  # the profile's task (arith) plus the four Table 2 benchmarks
        task["eval_datasets"] = (*C.PROFILES[args.profile].get("eval_datasets", ("arith",)), *C.TABLE2_DATASETS)
    runs = []
    for model in args.models:
        mtask = dict(task, bigmath_config="level_4_5") if args.profile == "paper" and "32b" in model.lower() else task
        runs += [C.eval_run(args, fmt, model=model, **mtask) for fmt in BASE_ROWS]
        runs += [C.train_run(args, m, s, model=model, **mtask) for m in METHODS for s in args.seeds]
    return runs


OUTPUTS = C.Outputs(figure="table2", notebook="notebooks/experiments.ipynb")
EXPERIMENT = C.Experiment(NAME, __doc__, plan, paper_models=PAPER_MODELS,
                          seeds={"smoke": [0], "small": [0], "paper": [0]}, outputs=OUTPUTS)

if __name__ == "__main__":
    raise SystemExit(C.main(EXPERIMENT))
