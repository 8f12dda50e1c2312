"""Paper Figure 5: token entropy during RL, NVFP4 / MXFP4 / NF4 LoRA vs bf16 LoRA (rank 32).

The paper shows that the 4-bit policies keep a higher entropy than bf16 LoRA over 200 GRPO steps
of Qwen2.5-7B-Instruct on GSM8K. Here: one run per method and seed with GRPO (TRL loss_type
"grpo"); the figure draws the training-forward `entropy` and the sampler's `sampling/entropy`.

    python -m experiments.fig5_entropy --profile small --parallel 8   # 1 H200, ~15 min (12 runs)
    python -m experiments.fig5_entropy --profile smoke                # CPU, ~4 x 3 min
    python -m experiments.fig5_entropy --profile paper --gpus 0 1 2 3 # 4 x Qwen2.5-7B, 200 steps

small = the embedded SmolLM2-135M-Instruct on arith level 0, 30 steps; paper = Qwen2.5-7B-Instruct
on GSM8K with Table 4 settings, 200 steps (days per run; not run here). At paper scale these are
the same runs as Fig. 4's GRPO LoRA rows: run both scripts only if the GPU time is there.
Seeds: smoke 0; small 0 1 2; paper 0. Writes <run root>/results/fig5_entropy/<profile>/ and
<run root>/results/figures/fig5_entropy.png.
"""

from __future__ import annotations

from experiments import _common as C
from qerl.config import method_name, table_bases

NAME = "fig5_entropy"
METHODS = tuple(method_name(b) for b in table_bases())  # LoRA on every base
PAPER_STEPS = 200  # the x-range of the paper's figure


def plan(args) -> list[C.Run]:
    steps = {"max_steps": PAPER_STEPS} if args.profile == "paper" else {}
    return [C.train_run(args, m, s, model=model, **C.GRPO, **steps)
            for model in args.models for m in METHODS for s in args.seeds]


OUTPUTS = C.Outputs(figure="plot_entropy", notebook="notebooks/experiments.ipynb")
EXPERIMENT = C.Experiment(NAME, __doc__, plan, outputs=OUTPUTS)

if __name__ == "__main__":
    raise SystemExit(C.main(EXPERIMENT))
