"""Paper Figure 8: ablation of adaptive quantization noise (NVFP4 LoRA with vs without AQN).

The paper's panels: Qwen2.5-3B-Instruct over 80 steps and Qwen2.5-7B-Instruct over 250 steps. The
caption names no data; from the reward ranges (3B: 0.25-0.85, like its GSM8K runs; 7B: 0.05-0.5,
like its BigMath curves in Fig. 7) qerl runs 3B on GSM8K with GRPO and 7B on BigMath with DAPO.
Here: methods nvfp4_lora and nvfp4_lora_aqn, same seeds; the figure adds `aqn/sigma` per step.

    python -m experiments.fig8_aqn_ablation --profile small --parallel 6   # 1 H200, ~10 min (6-9 runs)
    python -m experiments.fig8_aqn_ablation --profile smoke                # CPU, ~2 x 3 min
    python -m experiments.fig8_aqn_ablation --profile paper --gpus 0 1 2 3 # 3B (80 steps) + 7B (250 steps)

small = the embedded SmolLM2-135M-Instruct on arith level 0 with GRPO (the 3B GSM8K panel), 30 steps,
K=5 AQN stages; paper =
Table 4 settings (days per run; not run here). Seeds: smoke 0; small 0 1 2; paper 0.
Writes <run root>/results/fig8_aqn_ablation/<profile>/ and <run root>/results/figures/fig8_aqn_ablation.png.
"""

from __future__ import annotations

from experiments import _common as C

NAME = "fig8_aqn_ablation"
METHODS = ("nvfp4_lora", "nvfp4_lora_aqn")
PAPER_MODELS = ("Qwen/Qwen2.5-3B-Instruct", "Qwen/Qwen2.5-7B-Instruct")
# paper: model -> (task, steps = the x-range of its panel); other models get the GSM8K task.
PAPER_TASKS = {"Qwen/Qwen2.5-3B-Instruct": ("gsm8k", 80), "Qwen/Qwen2.5-7B-Instruct": ("bigmath", 250)}


def task_for(args, model) -> dict:
    if args.profile != "paper":
        return dict(C.GRPO)  # the profile's arith task stands for GSM8K (the 3B panel)
    data, steps = PAPER_TASKS.get(model, ("gsm8k", None))
    task = C.bigmath_task("paper") if data == "bigmath" else dict(C.GRPO)
    return {**task, **({"max_steps": steps} if steps else {})}


def plan(args) -> list[C.Run]:
    return [C.train_run(args, m, s, model=model, **task_for(args, model))
            for model in args.models for m in METHODS for s in args.seeds]


OUTPUTS = C.Outputs(
    figure="plot_curves", notebook="notebooks/rewards.ipynb", figure_kwargs=dict(
        by="method", panels="model", keys=("reward", "aqn/sigma"), title="AQN ablation (Fig. 8 analogue)"))
EXPERIMENT = C.Experiment(NAME, __doc__, plan, paper_models=PAPER_MODELS,
                          seeds={"smoke": [0], "small": [0, 1, 2], "paper": [0]}, outputs=OUTPUTS)

if __name__ == "__main__":
    raise SystemExit(C.main(EXPERIMENT))
