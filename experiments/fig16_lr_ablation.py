"""Paper Figures 16 and 17: learning-rate ablation of QeRL and of bf16 LoRA.

The paper trains Qwen2.5-7B-Instruct at lr 5e-6 and 3e-5 with QeRL (Fig. 16) and with bf16 LoRA
(Fig. 17) over 200 steps (GSM8K, inferred from the reward range): at 3e-5 QeRL learns ~2x faster
while bf16 LoRA becomes unstable. Here: methods nvfp4_lora_aqn and bf16_lora at a low and a high
learning rate (6x apart, as in the paper), one panel per method.

    python -m experiments.fig16_lr_ablation --profile small --parallel 8   # 1 H200, ~15 min (12 runs)
    python -m experiments.fig16_lr_ablation --profile smoke                # CPU, ~4 x 3 min
    python -m experiments.fig16_lr_ablation --profile paper --gpus 0 1 2 3 # 4 x Qwen2.5-7B, 200 steps

Learning rates: paper 5e-6 / 3e-5; small and smoke 5e-5 / 3e-4 (around the small profile's 2e-4,
which the 135M model needs to move in 30 steps). small = the embedded SmolLM2-135M-Instruct on arith
level 0; paper = Table 4 settings on GSM8K, 200 steps (days per run; not run here).
Seeds: smoke 0; small 0 1 2; paper 0. Writes <run root>/results/fig16_lr_ablation/<profile>/ and
<run root>/results/figures/fig16_lr_ablation.png.
"""

from __future__ import annotations

from experiments import _common as C

NAME = "fig16_lr_ablation"
METHODS = ("nvfp4_lora_aqn", "bf16_lora")
LEARNING_RATES = {"smoke": (5e-5, 3e-4), "small": (5e-5, 3e-4), "paper": (5e-6, 3e-5)}
PAPER_STEPS = 200  # the x-range of the paper's figures


def plan(args) -> list[C.Run]:
    steps = {"max_steps": PAPER_STEPS} if args.profile == "paper" else {}
    return [C.train_run(args, m, s, model=model, name=f"{m}-lr{lr:.0e}", label=f"lr={lr:.0e}", learning_rate=lr, **C.GRPO, **steps)
            for model in args.models for m in METHODS for lr in LEARNING_RATES[args.profile] for s in args.seeds]


OUTPUTS = C.Outputs(
    figure="plot_curves", notebook="notebooks/experiments.ipynb", figure_kwargs=dict(
        by="learning_rate", panels="method", title="Learning-rate ablation (Fig. 16 / 17 analogue)",
        panel_names={"nvfp4_lora_aqn": "QeRL (Fig. 16)", "bf16_lora": "bf16 LoRA (Fig. 17)"}))
EXPERIMENT = C.Experiment(NAME, __doc__, plan, outputs=OUTPUTS)

if __name__ == "__main__":
    raise SystemExit(C.main(EXPERIMENT))
