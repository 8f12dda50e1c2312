"""Paper Figure 7: training reward of QeRL vs bf16 LoRA vs bf16 full fine-tuning, DAPO on BigMath.

The paper plots Qwen2.5-7B and 14B-Instruct over 250 steps on BigMath levels 3-5 (its Fig. 13 adds
32B on levels 4-5). Here: methods nvfp4_lora_aqn (QeRL), bf16_lora and bf16_full with DAPO (TRL
0.18 loss_type "bnpo", beta 0, eps_high 0.28), one panel per model.

    python -m experiments.fig7_training_reward --profile small --parallel 6   # 1 H200, ~10 min (6-9 runs)
    python -m experiments.fig7_training_reward --profile smoke                # CPU, ~3 x 3 min
    python -m experiments.fig7_training_reward --profile paper --gpus 0 1 2 3 4 5   # 7B and 14B, 250 steps

small / smoke = the embedded SmolLM2-135M-Instruct, NOT the paper's 7B/14B/32B: BigMath is beyond a
135M model, so it trains with DAPO on the profile's arith task (30 steps at small). paper = Table
4's BigMath column (qerl.config.TABLE4_BIGMATH), 250 steps, days per run (not run here); BigMath
comes from the hub (open-r1/Big-Math-RL-Verified-Processed) or <data-dir>/bigmath/level_3_4_5/.
Seeds: smoke 0; small 0 1 2; paper 0. Writes <run root>/results/fig7_training_reward/<profile>/ and
<run root>/results/figures/fig7_training_reward.png.
"""

from __future__ import annotations

from experiments import _common as C

NAME = "fig7_training_reward"
METHODS = ("bf16_full", "bf16_lora", "nvfp4_lora_aqn")
PAPER_MODELS = ("Qwen/Qwen2.5-7B-Instruct", "Qwen/Qwen2.5-14B-Instruct")
PAPER_STEPS = 250  # the x-range of the paper's figure


def plan(args) -> list[C.Run]:
    task = C.bigmath_task(args.profile)
    if args.profile == "paper":
        task["max_steps"] = PAPER_STEPS
    return [C.train_run(args, m, s, model=model, **task) for model in args.models for m in METHODS for s in args.seeds]


OUTPUTS = C.Outputs(
    figure="plot_curves", notebook="notebooks/experiments.ipynb", figure_kwargs=dict(
        by="method", panels="model", title="Training reward: QeRL vs LoRA vs full, DAPO (Fig. 7 analogue)"))
EXPERIMENT = C.Experiment(NAME, __doc__, plan, paper_models=PAPER_MODELS, outputs=OUTPUTS)

if __name__ == "__main__":
    raise SystemExit(C.main(EXPERIMENT))
