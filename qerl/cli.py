"""Command line: `python -m qerl <command> ...`.

    python -m qerl quantize --model PATH_OR_ID --format FORMAT --out DIR

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
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m qerl", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (help_, add_args, _) in COMMANDS.items():
        sp = sub.add_parser(name, help=help_, description=help_)
        try:
            add_args(sp)
        except ImportError as exc:  # a broken optional stack must not take `quantize` down
            sp.set_defaults(_unavailable=f"`{name}` is unavailable: {exc}")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit status. Expected errors print one line, not a traceback."""
    args = build_parser().parse_args(argv)
    if getattr(args, "_unavailable", None):
        print(f"error: {args._unavailable}", file=sys.stderr)
        return 2
    _, _, run = COMMANDS[args.command]
    try:
        return run(args)
    except (ValueError, FileNotFoundError, FileExistsError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
