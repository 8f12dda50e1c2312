"""`python -m qerl train` and `python -m qerl eval`: flags are TrainConfig's field names.

Every training flag is accepted in kebab-case (--num-generations) and snake_case (--num_generations),
and under TRL's name where it differs (--per_device_train_batch_size, --save_steps, --lora_r, ...:
qerl.config.TRL_ALIASES). `--config file.yaml|.json` sets any fields first (a run folder's
config.json repeats that run); flags override it.

    python -m qerl train --profile smoke --output-dir runs/smoke
    python -m qerl train --profile small --method nvfp4_lora_aqn --seed 1 --output-dir runs/aqn-s1
    python -m qerl train --config my_task.yaml --num_generations 8 --output_dir runs/mine
    python -m qerl eval --model smollm2-135m-instruct --method nvfp4_lora --adapter runs/x/checkpoints/step-60 \
        --datasets gsm8k arith --data-dir /path/to/data
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import typing

from qerl.config import (
    PROFILES,
    TRL_ALIASES,
    TrainConfig,
    eval_settings,
    method_name,
    methods,
    parse_method,
    report_to_mode,
    resolve_config,
    table_bases,
)
from qerl.paths import check_writable  # noqa: F401 - also imported from here


def _field_type(f: dataclasses.Field):
    t = f.type if not isinstance(f.type, str) else eval(f.type, vars(typing), {})  # noqa: S307 - our own annotations
    return t


def _bool(s: str) -> bool:
    if s.lower() in ("1", "true", "yes"):
        return True
    if s.lower() in ("0", "false", "no"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {s!r}")


def _field_docs() -> dict[str, str]:
    """Each TrainConfig field's trailing comment in qerl/config.py: the flags' help texts."""
    import inspect
    import re

    docs = {}
    for line in inspect.getsource(TrainConfig).splitlines():
        m = re.match(r"\s+(\w+): [^=]+= .*?\s+#\s+(.*)$", line)
        if m:
            docs[m.group(1)] = m.group(2)
    return docs


def _field_help(f: dataclasses.Field, docs: dict[str, str]) -> str:
    """Help text of a training flag: the field's comment, its default, and the profiles that change it."""
    default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
    show = lambda v: " ".join(map(str, v)) if isinstance(v, (tuple, list)) else v  # noqa: E731
    by_profile = [f"{p} {show(v[f.name])}" for p, v in PROFILES.items() if f.name in v]
    text = f"{docs.get(f.name, f.name.replace('_', ' '))} (default: {show(default)}"
    text += f"; profiles: {', '.join(by_profile)})" if by_profile else ")"
    return text.replace("%", "%%")


def _spellings(*names: str) -> list[str]:
    """--a-b and --a_b for each name (one spelling when they are the same)."""
    out = []
    for n in names:
        out += [f"--{n.replace('_', '-')}"] + ([f"--{n}"] if "_" in n else [])
    return out


def add_train_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default=None, metavar="FILE",
                   help="a YAML or JSON file of settings (field names, or TRL's); a run's config.json repeats it. "
                        "Flags override it (default: none)")
    p.add_argument("--profile", default=None, choices=tuple(PROFILES) + ("custom",),
                   help="base settings; the config file and flags override (default: the file's, else small; "
                        "custom = the plain defaults)")
    p.add_argument("--method", default=None, choices=methods(),
                   help="shorthand for --fmt, --lora and --aqn (nvfp4_lora_aqn = nvfp4 base, LoRA, AQN; "
                        "default: the profile's, else nvfp4_lora_aqn)")
    p.add_argument("--report-to", "--report_to", default=None, nargs="+", metavar="TARGET",
                   help="TRL's report_to: wandb (default) or none (= --wandb-mode disabled)")
    p.add_argument("--dry-run", "--dry_run", action="store_true", default=False,
                   help="print the resolved config (JSON) and what it runs, then exit without training (default: off)")
    hints = typing.get_type_hints(TrainConfig)
    docs = _field_docs()
    aliases: dict[str, list[str]] = {}
    for trl, field in TRL_ALIASES.items():
        aliases.setdefault(field, []).append(trl)
    for f in dataclasses.fields(TrainConfig):
        if f.name == "profile":
            continue
        flags = _spellings(f.name, *aliases.get(f.name, []))
        help_ = _field_help(f, docs)
        t = hints[f.name]
        origin = typing.get_origin(t)
        if t is bool:  # `--flag` alone means true; `--flag false` turns a profile's true off
            p.add_argument(*flags, dest=f.name, type=_bool, nargs="?", const=True, default=None, metavar="BOOL",
                           help=help_)
        elif origin is tuple:
            inner = typing.get_args(t)[0]
            p.add_argument(*flags, dest=f.name, type=inner, nargs="+", default=None, help=help_)
        elif t in (int, float, str):
            kw = {"choices": table_bases()} if f.name == "fmt" else {}
            p.add_argument(*flags, dest=f.name, type=t, default=None, help=help_, **kw)
        else:  # Optional[str], Optional[float]: the inner type
            inner = next((a for a in typing.get_args(t) if a is not type(None)), str)
            p.add_argument(*flags, dest=f.name, type=inner, default=None, help=help_)


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    fields = {f.name for f in dataclasses.fields(TrainConfig)} - {"profile"}
    flags = {k: getattr(args, k) for k in fields if getattr(args, k, None) is not None}
    if getattr(args, "report_to", None) is not None:
        mode = report_to_mode(args.report_to)
        if mode is not None and flags.get("wandb_mode", mode) != mode:
            raise ValueError(f"--report-to {' '.join(args.report_to)} and --wandb-mode {flags['wandb_mode']} contradict "
                             f"each other; keep one")
        if mode is not None:
            flags["wandb_mode"] = mode
    return resolve_config(getattr(args, "config", None), getattr(args, "profile", None),
                          method=getattr(args, "method", None), **flags)


def run_train(args: argparse.Namespace) -> int:
    from qerl.train import NonFiniteError, RolloutGapError, train

    try:
        cfg = config_from_args(args)
        check_writable(cfg.output_dir, "--output-dir")
        from qerl.rewards import RewardSet

        rewards = RewardSet.from_config(cfg)  # a module:function that does not import fails here, before the model loads
        from qerl.data import DATASETS
        from qerl.evaluate import eval_records, own_needs_answer

        settings = eval_settings(cfg)
        for d in (d for d in cfg.eval_datasets if d not in DATASETS):  # so does your own evaluation file
            eval_records(d, settings["limit"], cfg.data_dir, cfg.seed, cfg.arith_levels, cfg.prompt_column,
                         cfg.answer_column, require_answer=own_needs_answer(rewards))
        if getattr(args, "dry_run", False):
            from qerl.config import describe

            print(json.dumps(cfg.to_dict(), indent=1, default=str))
            print("\n".join(describe(cfg)))
            return 0
        summary = train(cfg)
    except (NonFiniteError, RolloutGapError) as exc:  # a run stopped on purpose: one line, no traceback
        print(f"error: {exc}", file=sys.stderr)
        return 3
    print(json.dumps(summary, default=str))
    if summary.get("status") == "ok":
        from qerl.logging import run_report

        print(f"done: {run_report(cfg.output_dir)}")
    return 0 if summary.get("status") == "ok" else 1


def add_data_args(p: argparse.ArgumentParser, datasets: bool = True) -> None:
    """The dataset options `train` has, for `eval` and `generate`: --config (a training config file: its columns,
    prompt suffix, chat template and evaluation settings), --dataset, --prompt-column, --answer-column,
    --prompt-suffix, --chat-template, --data-dir. Each defaults to the config file's value (else the profile's)."""
    p.add_argument("--config", default=None, metavar="FILE",
                   help="a training config file (YAML or JSON, or a run's config.json): its model, dataset columns, "
                        "prompt suffix, chat template and evaluation settings are the defaults (default: none)")
    if datasets:
        p.add_argument("--datasets", "--dataset", dest="datasets", nargs="+", default=None, metavar="DATASET",
                       help="built-in names (arith, gsm8k, ...), your own .jsonl/.json/.parquet/.csv files, folders "
                            "(<split>.jsonl) or hub ids (owner/name) (default: the config's eval_datasets)")
    p.add_argument(*_spellings("prompt_column"), dest="prompt_column", default=None, metavar="FIELD",
                   help="your data's prompt field (default: the config's, else prompt, question or problem)")
    p.add_argument(*_spellings("answer_column"), dest="answer_column", default=None, metavar="FIELD",
                   help="your data's gold-answer field (default: the config's, else answer, else solution)")
    p.add_argument(*_spellings("prompt_suffix"), dest="prompt_suffix", default=None, metavar="TEXT",
                   help="text appended to text prompts: paper = the paper's think/answer instruction, \"\" = nothing "
                        "(default: the config's, else paper)")
    p.add_argument(*_spellings("chat_template"), dest="chat_template", type=_bool, nargs="?", const=True, default=None,
                   metavar="BOOL", help="render prompts with the tokenizer's chat template (default: the config's, "
                                        "else true)")
    p.add_argument(*_spellings("data_dir"), dest="data_dir", default=None,
                   help="local copies of the built-in datasets (default: the config's, else $QERL_DATA_DIR, else the hub)")


def add_eval_args(p: argparse.ArgumentParser) -> None:
    """Evaluation flags; each defaults to the config file's evaluation settings (--config), else the chosen
    profile's (qerl.config.eval_settings), so `eval --profile small` evaluates as `train --profile small` does."""
    p.add_argument("--profile", default=None, choices=tuple(PROFILES),
                   help="the profile whose evaluation settings (and model) are the defaults below "
                        "(default: the config file's, else small)")
    p.add_argument("--model", default=None, help="hub id, local folder, .gguf, or the embedded default "
                                                 "(default: the checkpoint's model, else the config's or profile's)")
    p.add_argument("--method", default=None, choices=methods() + table_bases(),
                   help="base format: a method name, or a bare format for the untrained rows "
                        "(default: the checkpoint's method, else the config file's, else bf16)")
    p.add_argument("--adapter", default=None,
                   help="a qerl checkpoint folder (checkpoints/step-N) or a PEFT adapter folder it exported; "
                        "LoRA rank/alpha/targets and trained norms are read from it")
    add_data_args(p)
    p.add_argument(*_spellings("reward", "reward_funcs"), dest="reward", nargs="+", default=None, metavar="FUNC",
                   help="the reward functions that score your own datasets, as in training: module:function "
                        "references or built-in names (default: the config file's, else the checkpoint's; built-in "
                        "rewards alone score with math_verify)")
    p.add_argument(*_spellings("reward_weights"), dest="reward_weights", type=float, nargs="+", default=None,
                   metavar="W", help="one weight per reward function (default: the config file's, else the "
                                     "checkpoint's, else 1.0 each)")
    p.add_argument("--limit", type=int, default=None, help="problems per dataset (0 = all)")
    p.add_argument("--samples", type=int, default=None, help="samples per problem; pass@1 is their mean accuracy")
    p.add_argument("--temperature", type=float, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--greedy", action="store_true", default=None, help="one greedy sample per problem")
    p.add_argument("--max-new-tokens", type=int, default=None)
    p.add_argument("--max-prompt-length", type=int, default=None)
    p.add_argument("--batch-size", type=int, default=None)
    p.add_argument("--engine", default=None, choices=("auto", "fast", "hf"),
                   help="rollout engine: fast (static cache + CUDA graphs; Llama/Qwen) or hf (reference)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--arith-levels", type=int, nargs="+", default=None, help="levels of the built-in arith set")
    p.add_argument("--out", default=None, help="write results JSON here, with every completion and its row")


# eval_settings values the eval CLI takes by default (from the profile or --config): left out of eval_flags,
# so that the experiments' eval commands stay as they were
_EVAL_DEFAULTS = {"prompt_suffix": "paper", "chat_template": True}


def eval_flags(settings: dict) -> list[str]:
    """`python -m qerl eval` flags for a qerl.config.eval_settings dict (experiment scripts use this)."""
    out = []
    for k, v in settings.items():
        if v is None or (k == "greedy" and not v) or (k in _EVAL_DEFAULTS and v == _EVAL_DEFAULTS[k]):
            continue
        flag = "--" + k.replace("_", "-")
        if k == "greedy":
            out.append(flag)
        elif isinstance(v, (list, tuple)):
            out += [flag, *map(str, v)]
        else:
            out += [flag, str(v)]
    return out


def eval_settings_of(args: argparse.Namespace) -> tuple[TrainConfig, dict]:
    """(the config the eval defaults come from, the evaluation settings): the config file's (--config) over
    the profile's, then the flags. A greedy evaluation takes one sample per problem and says so in its
    settings; --samples above 1 with --greedy is refused."""
    base = resolve_config(getattr(args, "config", None), getattr(args, "profile", None))
    settings = eval_settings(base)
    for k in settings:
        v = getattr(args, k, None)
        if v is not None:
            settings[k] = tuple(v) if isinstance(v, list) else v
    if settings["greedy"]:
        if getattr(args, "samples", None) not in (None, 1):
            raise ValueError(f"--samples {args.samples} with --greedy: a greedy evaluation has one sample per problem "
                             f"(drop --greedy to sample)")
        settings["samples"] = 1
    settings["datasets"] = tuple(d for d in settings["datasets"] if d not in ("none", ""))
    if not settings["datasets"]:
        where = f"{args.config} sets no eval_datasets" if getattr(args, "config", None) else "no datasets"
        raise ValueError(f"nothing to evaluate: {where}; pass --dataset (a built-in name or your own file)")
    return base, settings


# eval flag -> (lowest value, inclusive): checked before any model is loaded
EVAL_RANGES = {"limit": (0, True), "samples": (1, True), "temperature": (0, False), "top_p": (0, False),
               "max_new_tokens": (1, True), "max_prompt_length": (1, True), "batch_size": (1, True), "seed": (0, True)}


def check_eval_ranges(args: argparse.Namespace) -> None:
    for name, (lo, inclusive) in EVAL_RANGES.items():
        v = getattr(args, name, None)
        if v is not None and (v < lo if inclusive else v <= lo) or (name == "top_p" and v is not None and v > 1):
            want = f"{'>=' if inclusive else '>'} {lo}" + (" and <= 1" if name == "top_p" else "")
            raise ValueError(f"--{name.replace('_', '-')} must be {want}, got {v}")


def eval_rewards(args: argparse.Namespace, base: TrainConfig):
    """The RewardSet that scores your own evaluation data, as training scored it: --reward / --reward-weights,
    else the config file's reward functions, else the checkpoint's (its config.json); None when these are
    built-in rewards only (math_verify scores)."""
    from pathlib import Path

    from qerl.rewards import REWARDS, RewardSet

    funcs, weights = args.reward, args.reward_weights
    if funcs is None and getattr(args, "config", None):
        funcs, weights = list(base.reward), (weights if weights is not None else list(base.reward_weights))
    if funcs is None and args.adapter and (Path(args.adapter) / "config.json").is_file():
        recorded = json.loads((Path(args.adapter) / "config.json").read_text())
        funcs = recorded.get("reward")
        weights = weights if weights is not None else recorded.get("reward_weights")
    if funcs is None:
        if weights is not None:
            raise ValueError("--reward-weights without reward functions: pass --reward (or --config)")
        return None
    funcs = [funcs] if isinstance(funcs, str) else list(funcs)
    if all(f in REWARDS for f in funcs):
        return None
    weights = tuple(weights or ())
    if weights and len(weights) != len(funcs):
        raise ValueError(f"--reward-weights: {len(weights)} weights for {len(funcs)} reward functions")
    return RewardSet(funcs, weights, base.format_reward_weight)


def _policy_of(method: str) -> tuple:
    """What an evaluation loads for a method: its base format and whether it has adapters (AQN only
    shapes training, so nvfp4_lora_aqn and nvfp4_lora evaluate alike)."""
    if method in table_bases():
        return (method, True)
    m = parse_method(method)
    return (m["fmt"], m["lora"])


def run_eval(args: argparse.Namespace) -> int:
    from qerl.checkpoint import load_trainable, read_checkpoint_config
    from qerl.data import DATASETS
    from qerl.evaluate import eval_records, evaluate_datasets, own_needs_answer, write_results
    from qerl.logging import environment
    from qerl.policy import build_policy

    check_eval_ranges(args)
    base, settings = eval_settings_of(args)  # bad settings and config files fail before any model loads
    if args.out:
        check_writable(args.out, "--out", file=True)
    rewards = eval_rewards(args, base)  # your reward functions import here, before the model loads
    keys = ("limit", "data_dir", "arith_levels", "prompt_column", "answer_column")
    records = {d: eval_records(d, seed=args.seed, **{k: settings[k] for k in keys},
                               require_answer=own_needs_answer(rewards if d not in DATASETS else None))
               for d in settings["datasets"]}
    ck = read_checkpoint_config(args.adapter) if args.adapter else {}
    if args.adapter and not (args.method or ck.get("method")):
        raise ValueError(f"{args.adapter} does not record its method (a PEFT adapter folder): pass --method, "
                         f"e.g. --method nvfp4_lora")
    if args.method and ck.get("method") and _policy_of(args.method) != _policy_of(ck["method"]):
        raise ValueError(f"--method {args.method} contradicts the checkpoint {args.adapter}, trained as "
                         f"{ck['method']}: drop --method to evaluate it as {ck['method']}")
    if args.adapter and not args.method:
        print(f"[qerl] method {ck['method']}: the checkpoint's ({args.adapter})")
    method = args.method or ck.get("method") or (base.method if args.config else "bf16")
    bare = method in table_bases()
    if bare and args.adapter:
        raise ValueError(f"--method {method} is a bare base format (no adapter); to load --adapter give a method "
                         f"such as {method}_lora")
    policy = {k: ck[k] for k in ("lora_rank", "lora_alpha", "lora_dropout", "train_norms") if k in ck}
    model = args.model or ck.get("model") or base.model
    cfg = TrainConfig(model=model, **parse_method(method_name(method) if bare else method), **policy)
    model, tok, _, info = build_policy(cfg, lora=not bare)
    if args.adapter:
        load_trainable(args.adapter, model)
    res = evaluate_datasets(model, tok, seed=args.seed, records=records, rewards=rewards,
                            keep_completions=bool(args.out), **settings)
    for d, r in res.items():
        se = f" +- {r['accuracy_stderr']:.4f} (s.e. over problems)" if r["accuracy_stderr"] is not None else ""
        means = [(k.split("/")[1], v) for k, v in r.items() if k.startswith("rewards/")]
        each = ("; " + ", ".join(f"{n} {v:.4f}" if v is not None else f"{n} -" for n, v in means)) if means else ""
        what = " (mean weighted reward)" if means else ""
        print(f"{d}: pass@1{what} {r['accuracy']:.4f}{se}{each}, {r['num_problems']} problems x {r['samples']} samples")
    if args.out:
        write_results(res, args.out, {"args": vars(args), "settings": settings, "policy": info,
                                      "provenance": environment()})
    print(json.dumps({d: {k: v for k, v in r.items() if k != "completions"} for d, r in res.items()}))
    return 0
