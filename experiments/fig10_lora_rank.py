"""Paper Figure 10: ablation of the LoRA rank in QeRL (r = 16, 32, 64, 128).

The paper trains Qwen2.5-3B-Instruct with QeRL (NVFP4 LoRA + AQN) at each rank over 150 steps
(GSM8K with GRPO, inferred from the reward range) and finds similar curves, r=16 slightly faster.
Here: method nvfp4_lora_aqn at each rank with lora_alpha = 2 r, so the LoRA scaling (alpha / r = 2)
stays that of the profiles and only the rank changes (the paper does not give its alpha).

    python -m experiments.fig10_lora_rank --profile small --parallel 8   # 1 H200, ~15 min (12 runs)
    python -m experiments.fig10_lora_rank --profile smoke                # CPU, ~4 x 3 min
    python -m experiments.fig10_lora_rank --profile paper --gpus 0 1 2 3 # 4 x Qwen2.5-3B, 150 steps

small = the embedded SmolLM2-135M-Instruct on arith level 0, 30 steps; paper = Table 4 settings on
GSM8K, 150 steps (hours per run; not run here). Seeds: smoke 0; small 0 1 2; paper 0.
Writes <run root>/results/fig10_lora_rank/<profile>/ and <run root>/results/figures/fig10_lora_rank.png.
"""

from __future__ import annotations

from experiments import _common as C

NAME = "fig10_lora_rank"
RANKS = (16, 32, 64, 128)
PAPER_MODELS = ("Qwen/Qwen2.5-3B-Instruct",)
PAPER_STEPS = 150  # the x-range of the paper's figure


def plan(args) -> list[C.Run]:
    steps = {"max_steps": PAPER_STEPS} if args.profile == "paper" else {}
    return [C.train_run(args, "nvfp4_lora_aqn", s, model=model, name=f"r{r}", label=f"lora_rank={r}",
                        lora_rank=r, lora_alpha=2 * r, **C.GRPO, **steps)
            for model in args.models for r in RANKS for s in args.seeds]


OUTPUTS = C.Outputs(
    figure="plot_curves", notebook="notebooks/experiments.ipynb", figure_kwargs=dict(
        by="lora_rank", title="LoRA rank ablation, QeRL (Fig. 10 analogue)"))
EXPERIMENT = C.Experiment(NAME, __doc__, plan, paper_models=PAPER_MODELS, outputs=OUTPUTS)

if __name__ == "__main__":
    raise SystemExit(C.main(EXPERIMENT))
