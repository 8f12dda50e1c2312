"""Adaptive Quantization Noise (AQN): the QeRL paper's Algorithm 1.

Training is split into K = ``num_stages`` equal stages. Stage 0 adds no noise (the policy
only sees the quantization noise of its 4-bit weights); stage k >= 1 samples with a fresh
channel-wise Gaussian vector z ~ N(0, sigma_k^2 I) added to the weight w of every RMSNorm that
feeds q/k/v (``input_layernorm``) and gate/up (``post_attention_layernorm``).

Why the norm weight: for ``y = W @ RMSNorm_w(x) = W @ (w * x_hat)``,
``W @ ((w + z) * x_hat) = (W * (1 + z / w)[None, :]) @ (w * x_hat)`` (the paper's Eq. 12):
noise in w is a multiplicative per-input-channel perturbation of every Linear the norm feeds,
obtained for the cost of a [hidden] vector instead of a perturbation of the packed 4-bit weights.

The schedule (``sigma_schedule``) follows the official code, not the paper's Eq. 8: the
paper writes the exponent (k-1)/(K-1), which never reaches sigma_end; the code uses
(k-1)/(K-2), so stage 1 is sigma_start and the last stage K-1 is exactly sigma_end.
With K == 2 there is one noisy stage, at sigma_start.

Departure from the official code: it adds the noise to the rollout model's weights in place,
step after step, so noise accumulates. ``noisy_norms`` keeps a copy of the clean vectors and
copies them back when the context exits (also on an exception): the weights after the
context are bitwise the weights before it.

``aqn_mode="upstream"`` (``upstream_norms``) instead does what NVlabs/QeRL's
trl_trainer/noise_scheduler.py does at e8c6e79 (docs/upstream.md): noise on every RMSNorm, the final
norm included, drawn in fp32, rounded to bf16 and added in place in bf16, never removed, so it
accumulates over steps. The rollout weights it builds live next to the model; the training forward
still sees the clean weights, as upstream's training model does (its noise is in the vLLM copy).

Precision note: a bf16 norm weight in [1, 2) has a spacing of 2**-7 (~7.8e-3), so additive
noise much smaller than that rounds back to the clean value. Measured with ``noisy_norms`` on
8192 bf16 channels all equal to 1.0: sigma 1e-2 changes 77% of them, 2e-3 20%, 1e-3 2.5%,
5e-4 0% (for w = 2.5: 1e-2 -> 44%, 2e-3 -> 0%). With bf16 norm weights the late, small-sigma
stages of the schedule are mostly no-ops; keep the norm weights in fp32 if they must act.
``noisy_norms`` adds in fp32 and rounds once; it does not change the weight dtype.

Run the tests with ``.venv/bin/python -m pytest tests/test_noise.py -q``.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator

import torch
from torch import nn

from qerl.arch import NORM_NAMES  # RMSNorms that feed q/k/v and gate/up (Llama/Qwen2/Qwen3)

SCHEDULES = ("exponential", "linear", "cosine", "logarithmic")
AQN_MODES = ("restored", "upstream")
# Seed of step k's noise vectors: seed * NOISE_SEED_STRIDE + k (both modes).
NOISE_SEED_STRIDE = 104729


# ----------------------------------------------------------------------------- schedule

def _check_schedule(num_stages: int, sigma_start: float, sigma_end: float, kind: str) -> None:
    if kind not in SCHEDULES:
        raise ValueError(f"schedule kind must be one of {SCHEDULES}, got {kind!r}")
    if isinstance(num_stages, bool) or not isinstance(num_stages, int) or num_stages < 2:
        raise ValueError(f"num_stages must be an int >= 2 (stage 0 is noise-free), got {num_stages!r}")
    if not (math.isfinite(sigma_start) and sigma_start > 0):
        raise ValueError(f"sigma_start must be finite and > 0, got {sigma_start!r}")
    if not (math.isfinite(sigma_end) and sigma_end >= 0):
        raise ValueError(f"sigma_end must be finite and >= 0, got {sigma_end!r}")
    if kind == "exponential" and sigma_end == 0:
        raise ValueError("the exponential schedule needs sigma_end > 0 (it interpolates in log space)")


def schedule_progress(stage: int, num_stages: int) -> float:
    """t in [0, 1] of noisy stage k: (k-1)/(K-2); 0.0 when K == 2 (a single noisy stage)."""
    return 0.0 if num_stages == 2 else (stage - 1) / (num_stages - 2)


def sigma_schedule(
    stage: int, num_stages: int, sigma_start: float, sigma_end: float, kind: str = "exponential"
) -> float:
    """Noise std of ``stage`` (0..K-1) in a K-stage AQN schedule.

    Stage 0 returns 0.0 (no added noise). For a noisy stage k >= 1 let
    t = (k-1)/(K-2) (t = 0 when K == 2), so t = 0 at k = 1 and t = 1 at k = K-1; then

    * ``exponential`` (the paper's and the official code's): sigma_start * (sigma_end / sigma_start) ** t
      (geometric interpolation, a straight line on a log axis);
    * ``linear``: sigma_start + (sigma_end - sigma_start) * t;
    * ``cosine``: sigma_end + (sigma_start - sigma_end) * (1 + cos(pi * t)) / 2
      (flat near both ends, fastest change mid-way);
    * ``logarithmic``: sigma_start + (sigma_end - sigma_start) * ln(1 + (e - 1) * t)
      (the interpolation weight ln(1 + (e-1) t) goes 0 -> 1 and is concave: most of the decay
      happens in the first stages). The paper names a logarithmic schedule without a formula;
      this is qerl's definition.

    All four give sigma_start at k = 1 and sigma_end at k = K-1.
    """
    _check_schedule(num_stages, sigma_start, sigma_end, kind)
    if isinstance(stage, bool) or not isinstance(stage, int) or not 0 <= stage < num_stages:
        raise ValueError(f"stage must be an int in [0, {num_stages - 1}], got {stage!r}")
    if stage == 0:
        return 0.0
    t = schedule_progress(stage, num_stages)
    if kind == "exponential":
        return float(sigma_start * (sigma_end / sigma_start) ** t)
    if kind == "linear":
        weight = t
    elif kind == "cosine":
        weight = 1.0 - (1.0 + math.cos(math.pi * t)) / 2.0
    else:  # logarithmic
        weight = math.log1p((math.e - 1.0) * t)
    return float(sigma_start + (sigma_end - sigma_start) * weight)


def sigma_trend(num_stages: int, sigma_start: float, sigma_end: float, kind: str = "exponential") -> list[float]:
    """The K sigmas of every stage, stage 0's 0.0 first (handy for logging and plots)."""
    return [sigma_schedule(k, num_stages, sigma_start, sigma_end, kind) for k in range(num_stages)]


def stage_for_step(step: int, total_steps: int, num_stages: int) -> int:
    """Stage (0..K-1) of training step ``step`` out of ``total_steps``: K equal intervals.

    floor(step / (total_steps / K)) computed in integers, capped at K-1 (the official code's
    interval_id, with the step clamped to total_steps). Steps are 0-based; step == total_steps
    (one past the end) is still the last stage.
    """
    if isinstance(num_stages, bool) or not isinstance(num_stages, int) or num_stages < 1:
        raise ValueError(f"num_stages must be a positive int, got {num_stages!r}")
    if not isinstance(total_steps, int) or total_steps < 1:
        raise ValueError(f"total_steps must be a positive int, got {total_steps!r}")
    if not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be an int >= 0, got {step!r}")
    step = min(step, total_steps)
    return min(step * num_stages // total_steps, num_stages - 1)


@dataclass
class AQNConfig:
    """Adaptive Quantization Noise settings (the paper's Algorithm 1, section 3.3)."""

    enabled: bool = field(default=False, metadata={"help": "add AQN noise to the RMSNorm weights during rollout"})
    sigma_start: float = field(default=1e-2, metadata={"help": "sigma_start: noise std of stage 1 (paper Table 4)"})
    sigma_end: float = field(
        default=5e-4,
        metadata={"help": "sigma_end: noise std of the last stage (Table 4: 5e-4; official scripts 1e-4)"},
    )
    num_stages: int = field(default=10, metadata={"help": "K: number of equal stages; stage 0 is noise-free"})
    schedule: str = field(default="exponential", metadata={"help": f"sigma decay between stages: {SCHEDULES}"})
    seed: int = field(default=0, metadata={"help": "seed of the torch.Generator the noise vectors are drawn from"})
    mode: str = field(default="restored", metadata={"help": f"how the noise reaches the norms: {AQN_MODES}"})

    def __post_init__(self) -> None:
        if not isinstance(self.enabled, bool):
            raise ValueError(f"enabled must be a bool, got {self.enabled!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"seed must be an int, got {self.seed!r}")
        if self.mode not in AQN_MODES:
            raise ValueError(f"mode must be one of {AQN_MODES}, got {self.mode!r}")
        _check_schedule(self.num_stages, self.sigma_start, self.sigma_end, self.schedule)

    def sigma_at(self, step: int, total_steps: int) -> tuple[int | None, float]:
        """(stage, sigma) for training step ``step`` (0-based); (None, 0.0) when AQN is disabled: a run
        without noise has no stage (logged as null, not a count that reads as a schedule).

        Mode "upstream" counts steps from 1, as upstream's ``update_step`` does when the noise is drawn
        (replacement/trainer.py line 2626 increments it before the step runs), so its stages start one
        step earlier."""
        if not self.enabled:
            return None, 0.0
        step = step + 1 if self.mode == "upstream" else step
        stage = stage_for_step(step, total_steps, self.num_stages)
        return stage, sigma_schedule(stage, self.num_stages, self.sigma_start, self.sigma_end, self.schedule)


# ----------------------------------------------------------------------------- injection

def find_norms(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, module) of every RMSNorm AQN perturbs: modules whose last name component is in
    ``NORM_NAMES`` and that hold a 1-D ``weight`` (Llama/Qwen2/Qwen3:
    ``model.layers.<i>.input_layernorm``; PEFT-wrapped names work the same)."""
    found = []
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] not in NORM_NAMES:
            continue
        weight = getattr(module, "weight", None)
        if isinstance(weight, torch.Tensor) and weight.dim() == 1:
            found.append((name, module))
    return found


@contextmanager
def noisy_norms(
    model: nn.Module,
    sigma: float,
    generator: torch.Generator | None = None,
    seed: int | None = None,
) -> Iterator[int]:
    """Add a fresh N(0, sigma^2) vector to each AQN norm weight for the duration of the context.

    One vector of shape [hidden] per module, drawn in fp32 from ``generator`` (on the
    generator's device, then moved to the weight's device, so a seed gives the same noise on
    CPU and GPU), or from a new generator seeded with ``seed``, or from torch's global RNG when
    neither is given. Pass one long-lived generator to get fresh noise at every rollout and a
    reproducible sequence over a run. The weights are modified in place (same storage, so
    CUDA graphs captured on them see the noise) and restored bitwise on exit, exceptions
    included. Yields the number of modules perturbed (0 when sigma == 0: nothing is touched).

    Raises ValueError for a negative/non-finite sigma, for both generator and seed, or when
    sigma > 0 and the model has no module named as in ``NORM_NAMES``.
    """
    if not (isinstance(sigma, (int, float)) and math.isfinite(sigma) and sigma >= 0):
        raise ValueError(f"sigma must be a finite number >= 0, got {sigma!r}")
    if generator is not None and seed is not None:
        raise ValueError("pass either generator or seed, not both")
    if sigma == 0:
        yield 0
        return
    norms = find_norms(model)
    if not norms:
        raise ValueError(
            f"AQN found no RMSNorm to perturb: no module named one of {NORM_NAMES} with a 1-D weight "
            f"(model class {type(model).__name__})"
        )
    if seed is not None:
        generator = torch.Generator().manual_seed(seed)
    gen_device = generator.device if generator is not None else torch.device("cpu")

    saved: list[tuple[torch.Tensor, torch.Tensor]] = []
    seen: set[int] = set()
    try:
        with torch.no_grad():
            for _, module in norms:
                weight = module.weight
                if id(weight) in seen:  # a weight shared by two modules is perturbed once
                    continue
                seen.add(id(weight))
                z = torch.randn(weight.shape, generator=generator, device=gen_device, dtype=torch.float32)
                clean = weight.detach().clone()
                saved.append((weight, clean))
                # add in fp32, round once to the weight's dtype; never on top of earlier noise
                weight.copy_((clean.float() + sigma * z.to(weight.device)).to(weight.dtype))
        yield len(saved)
    finally:
        with torch.no_grad():
            for weight, clean in saved:
                weight.copy_(clean)


def keep_norms_fp32(model: nn.Module) -> int:
    """Hold the AQN norm weights in fp32 (output cast back to the input dtype); returns how many.

    Why: bf16 has ~7.8e-3 spacing in [1, 2), so a noise of sigma <= 1e-3 added to a bf16 norm
    weight mostly rounds back to the clean value (measured: 0% of channels change at 5e-4), and
    the later AQN stages would do nothing. With fp32 weights the noise survives and only the
    product is rounded, once, to the activation dtype. Applied to every method alike so AQN is
    the only difference between the nvfp4_lora and nvfp4_lora_aqn rows.
    """
    n = 0
    for _, module in find_norms(model):
        if module.weight.dtype != torch.float32:
            module.weight.data = module.weight.data.float()
            module.register_forward_hook(lambda m, inp, out: out.to(inp[0].dtype))
            n += 1
    return n


# ----------------------------------------------------------------------------- upstream mode

def find_all_norms(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, module) of every RMSNorm upstream's noise reaches: the decoder layers' ``NORM_NAMES`` and the
    final norm (a module named ``norm`` with a 1-D weight). Upstream matches by class (transformers'
    Qwen2RMSNorm and LlamaRMSNorm): for Qwen2 and Llama models these are the same modules."""
    found = []
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] not in NORM_NAMES + ("norm",):
            continue
        weight = getattr(module, "weight", None)
        if isinstance(weight, torch.Tensor) and weight.dim() == 1:
            found.append((name, module))
    return found


def upstream_draw(shape, sigma: float, generator: torch.Generator) -> torch.Tensor:
    """One upstream noise vector: N(0, sigma^2) drawn in fp32, rounded to bf16 (noise_scheduler.py lines 30-31)."""
    return (sigma * torch.randn(shape, generator=generator, dtype=torch.float32)).to(torch.bfloat16)


class UpstreamNoise:
    """The rollout norm weights of ``aqn_mode="upstream"``, step by step.

    Upstream (NVlabs/QeRL at e8c6e79) keeps a bf16 copy of the model in vLLM. Before each step's rollout
    it loads the trained weights into that copy (the LoRA adapter and, with ``--ln True``, the
    input/post-attention norms: trl_trainer/grpo_trainer.py lines 1319-1329), then adds a fresh bf16
    noise vector in place to every RMSNorm weight (lines 1364-1369, noise_scheduler.py lines 22-33).
    A norm that is not reloaded (the final norm always; every norm without --ln) therefore carries the
    sum of all noise drawn so far; a reloaded (trained) norm carries only this step's draw, on top of
    its trained value rounded to bf16. Stage 0 adds nothing.

    ``weights(model, step)`` returns those rollout weights for ``step`` (0-based). The state of the
    untrained norms is a pure function of (seed, schedule, step): consecutive steps advance it by one
    draw, any other step (a resumed run) replays the draws from step 0, so a resumed run samples with
    the same noise as an uninterrupted one.
    """

    def __init__(self, aqn: AQNConfig, total_steps: int):
        if aqn.mode != "upstream":
            raise ValueError(f"UpstreamNoise needs an AQNConfig with mode='upstream', got {aqn.mode!r}")
        self.aqn, self.total_steps = aqn, total_steps
        self.step: int | None = None  # the last step whose draws are in self.state
        self.state: dict[str, torch.Tensor] = {}  # bf16 rollout weights of the norms that are never reloaded

    def _advance(self, norms, step: int) -> dict[str, torch.Tensor]:
        """Draw step ``step``'s noise (one vector per norm, in ``norms`` order); fold it into the state of
        the untrained norms; return this step's draws."""
        _, sigma = self.aqn.sigma_at(step, self.total_steps)
        if sigma == 0:
            return {}
        gen = torch.Generator().manual_seed(self.aqn.seed * NOISE_SEED_STRIDE + step)
        draws = {}
        for name, module in norms:
            z = upstream_draw(module.weight.shape, sigma, gen)
            draws[name] = z
            if not module.weight.requires_grad:  # never reloaded: the noise piles up (add_ rounds to bf16)
                if name not in self.state:
                    self.state[name] = module.weight.detach().to("cpu", torch.bfloat16, copy=True)
                self.state[name].add_(z)
        return draws

    def weights(self, model: nn.Module, step: int) -> dict[str, torch.Tensor]:
        """{norm name: its bf16 rollout weight at ``step``} (empty before the first noisy step)."""
        norms = find_all_norms(model)
        if not norms:
            raise ValueError(f"AQN (upstream mode) found no RMSNorm in model class {type(model).__name__}")
        if self.step is None or step != self.step + 1:  # a fresh or resumed run: replay from step 0
            self.state, self.step = {}, None
            for s in range(step):
                self._advance(norms, s)
        draws = self._advance(norms, step)
        self.step = step
        out = dict(self.state)
        for name, module in norms:
            if module.weight.requires_grad and name in draws:  # reloaded from training, then noised once
                out[name] = module.weight.detach().to("cpu", torch.bfloat16, copy=True).add_(draws[name])
        return out


@contextmanager
def upstream_norms(model: nn.Module, noise: UpstreamNoise, step: int) -> Iterator[int]:
    """Put ``noise``'s rollout weights of ``step`` into the norms for the duration of the context (in place,
    same storage); the clean weights come back bitwise on exit. Yields how many norms carry noise."""
    rollout = noise.weights(model, step)
    saved: list[tuple[torch.Tensor, torch.Tensor]] = []
    try:
        with torch.no_grad():
            for name, module in find_all_norms(model):
                if name in rollout:
                    w = module.weight
                    saved.append((w, w.detach().clone()))
                    w.copy_(rollout[name].to(w.device, w.dtype))
        yield len(saved)
    finally:
        with torch.no_grad():
            for w, clean in saved:
                w.copy_(clean)


@contextmanager
def rollout_noise(model: nn.Module, aqn: AQNConfig, step: int, total_steps: int, sigma: float) -> Iterator[int]:
    """The noise of ``step``'s rollout on the norms, by ``aqn.mode``; yields the number of norms perturbed.

    "restored": ``noisy_norms`` with ``sigma`` and the seed (aqn.seed, step); "upstream": ``upstream_norms``
    (every step's sigma from the schedule) with an ``UpstreamNoise`` kept on the model
    (``model.qerl_upstream_noise``)."""
    if aqn.mode == "restored" or not aqn.enabled:
        with noisy_norms(model, sigma, seed=aqn.seed * NOISE_SEED_STRIDE + step) as n:
            yield n
        return
    noise = getattr(model, "qerl_upstream_noise", None)
    if noise is None or noise.aqn != aqn or noise.total_steps != total_steps:
        noise = UpstreamNoise(aqn, total_steps)
        model.qerl_upstream_noise = noise
    with upstream_norms(model, noise, step) as n:
        yield n
