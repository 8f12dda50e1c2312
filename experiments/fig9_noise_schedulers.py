"""Paper Figure 9: AQN noise schedulers (linear, exponential, cosine, logarithmic decay of sigma).

The paper trains Qwen2.5-3B-Instruct with QeRL (NVFP4 LoRA + AQN, K=10 stages, sigma 1e-2 -> 5e-4)
under each schedule and plots the reward over 150 steps (GSM8K with GRPO, inferred from the reward
range; the caption names no data). Here: method nvfp4_lora_aqn, one run per schedule and seed
(qerl.noise.sigma_schedule defines the four curves); the figure adds `aqn/sigma` per step (Fig. 15).

    python -m experiments.fig9_noise_schedulers --profile small --parallel 8   # 1 H200, ~15 min (12 runs)
    python -m experiments.fig9_noise_schedulers --profile smoke                # CPU, ~4 x 3 min
    python -m experiments.fig9_noise_schedulers --profile paper --gpus 0 1 2 3 # 4 x Qwen2.5-3B, 150 steps

small = the embedded SmolLM2-135M-Instruct on arith level 0, 30 steps, K=5 stages (so 4 noisy
stages); paper = Table 4 settings on GSM8K, 150 steps (hours per run; not run here).
Seeds: smoke 0; small 0 1 2; paper 0. Writes <run root>/results/fig9_noise_schedulers/<profile>/ and
<run root>/results/figures/fig9_noise_schedulers.png.
"""

from __future__ import annotations

from experiments import _common as C
from qerl.config import NOISE_SCHEDULES

NAME = "fig9_noise_schedulers"
PAPER_MODELS = ("Qwen/Qwen2.5-3B-Instruct",)
PAPER_STEPS = 150  # the x-range of the paper's figure


def plan(args) -> list[C.Run]:
    steps = {"max_steps": PAPER_STEPS} if args.profile == "paper" else {}
    return [C.train_run(args, "nvfp4_lora_aqn", s, model=model, name=sched, label=f"noise_schedule={sched}",
                        noise_schedule=sched, **C.GRPO, **steps)
            for model in args.models for sched in NOISE_SCHEDULES for s in args.seeds]


OUTPUTS = C.Outputs(
    figure="plot_curves", notebook="notebooks/experiments.ipynb", figure_kwargs=dict(
        by="noise_schedule", keys=("reward", "aqn/sigma"), title="AQN noise schedulers (Fig. 9 / 15 analogue)"))
EXPERIMENT = C.Experiment(NAME, __doc__, plan, paper_models=PAPER_MODELS, outputs=OUTPUTS)

if __name__ == "__main__":
    raise SystemExit(C.main(EXPERIMENT))
