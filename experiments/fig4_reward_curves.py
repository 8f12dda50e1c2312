"""Paper Figure 4: training reward under DAPO (top) and GRPO (bottom) across weight formats.

The paper's panels compare NVFP4 / MXFP4 / NF4 LoRA with bf16 LoRA and bf16 full fine-tuning on
Qwen2.5-7B-Instruct, LoRA rank 32, over 200 steps (GSM8K: the section 3.2 study; the caption does
not name the data). Here: every method in {bf16_full, bf16_lora, nf4_lora, mxfp4_lora, nvfp4_lora}
under both losses, GRPO = TRL loss_type "grpo" and DAPO = "bnpo" (both beta 0, clip 0.2 / 0.28,
Table 4); everything else from the profile.

    python -m experiments.fig4_reward_curves --profile small --parallel 10   # 1 H200, ~30 min (30 runs)
    python -m experiments.fig4_reward_curves --profile smoke                 # CPU, ~10 x 3 min
    python -m experiments.fig4_reward_curves --profile paper --gpus 0 1 2 3 4 5 6 7   # 10 x Qwen2.5-7B, 200 steps

small = the embedded SmolLM2-135M-Instruct on arith level 0, 30 steps; paper = Qwen2.5-7B-Instruct
on GSM8K with Table 4 settings, 200 steps (days per run with qerl's rollout; not run here).
Seeds: smoke 0; small 0 1 2; paper 0. Writes <run root>/results/fig4_reward_curves/<profile>/ and
<run root>/results/figures/fig4_reward_curves.png (one panel per loss).
"""

from __future__ import annotations

from experiments import _common as C
from qerl.config import method_name, table_bases

NAME = "fig4_reward_curves"
METHODS = ("bf16_full",) + tuple(method_name(b) for b in table_bases())  # full, then LoRA on every base
LOSSES = {"grpo": C.GRPO, "dapo": C.DAPO}
PAPER_STEPS = 200  # the x-range of the paper's figure


def plan(args) -> list[C.Run]:
    steps = {"max_steps": PAPER_STEPS} if args.profile == "paper" else {}
    return [C.train_run(args, m, s, model=model, name=f"{loss}-{m}", label=loss, **LOSSES[loss], **steps)
            for model in args.models for loss in LOSSES for m in METHODS for s in args.seeds]


OUTPUTS = C.Outputs(
    figure="plot_curves", notebook="notebooks/rewards.ipynb", figure_kwargs=dict(
        by="method", panels="loss_type", title="Training reward across formats (Fig. 4 analogue)",
        panel_names={"grpo": "GRPO (loss_type grpo)", "bnpo": "DAPO (loss_type bnpo)"}))
EXPERIMENT = C.Experiment(NAME, __doc__, plan, seeds={"smoke": [0], "small": [0, 1, 2], "paper": [0]}, outputs=OUTPUTS)

if __name__ == "__main__":
    raise SystemExit(C.main(EXPERIMENT))
