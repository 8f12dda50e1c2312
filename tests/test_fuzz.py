"""Property-based tests of what users control: flag values, JSONL rows, model folders. Whatever goes
in, the CLI either accepts it or ends with exactly one `error:` line and exit 2, never a traceback.

The CLI's main runs in process; anything valid stops at a sentinel before the expensive part (the
training loop, the rollout engine), so each example costs milliseconds to a second. The examples
are derandomized (the same every run: CI does not turn red on a new draw); raise
QERL_FUZZ_EXAMPLES to search longer locally.

Run: python -m pytest tests/test_fuzz.py -q      (~1 min on 2 cores)
"""

import contextlib
import io
import json
import os
import shutil
import string
from pathlib import Path

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from qerl.cli import build_parser, main  # noqa: E402

EXAMPLES = int(os.environ.get("QERL_FUZZ_EXAMPLES", "0"))


def fuzz(examples: int):
    """settings: ``examples`` fixed examples (QERL_FUZZ_EXAMPLES random ones instead), no deadline, no database."""
    return settings(max_examples=EXAMPLES or examples, deadline=None, derandomize=not EXAMPLES, database=None,
                    print_blob=True, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


class Accepted(BaseException):
    """Raised where a valid input would start the real work (not an Exception: the CLI must not catch it)."""


def call(argv) -> tuple[int | None, str]:
    """(exit status, stderr) of the CLI; status None when the input was accepted."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            rc = main([str(a) for a in argv])
    except Accepted:
        return None, err.getvalue()
    except SystemExit as exc:  # argparse
        rc = exc.code
    return rc, err.getvalue()


def assert_accepted_or_one_error_line(rc, err, what):
    if rc is None:
        return
    lines = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert "Traceback" not in err, f"{what}: traceback\n{err[-3000:]}"
    assert rc == 2 and len(lines) == 1, f"{what}: exit {rc}, stderr:\n{err[-3000:]}"


def _train_flags():
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    return [a for a in sub.choices["train"]._actions if a.option_strings and a.dest not in ("help", "debug")]


TRAIN_FLAGS = _train_flags()
# values as a user types them: numbers of every kind, words, nothing, odd characters
VALUES = st.one_of(
    st.integers(-10**12, 10**12).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.sampled_from(["", "0", "-0", "1e-300", "1e400", "nan", "-inf", "true", "none", "auto", "bf16", "nvfp4",
                     "nvfp4_lora", "smoke", "../", "a b", "--", "-", "\u00e9", "0x10", "1_000"]),
    st.text(alphabet=string.printable, max_size=12),
)


@pytest.fixture
def no_training(monkeypatch):
    import qerl.train

    def stop(cfg, *a, **k):
        raise Accepted

    monkeypatch.setattr(qerl.train, "train", stop)


@fuzz(150)
@given(st.lists(st.tuples(st.sampled_from(TRAIN_FLAGS), st.lists(VALUES, min_size=0, max_size=2)), min_size=1,
                max_size=3))
def test_train_flag_values(no_training, tmp_path, flags):
    argv = ["train", "--profile", "smoke", "--output-dir", tmp_path / "r"]
    for action, values in flags:
        argv += [action.option_strings[0], *values]
    rc, err = call(argv)
    assert_accepted_or_one_error_line(rc, err, argv)


# ---------------------------------------------------------------------------------------------- JSONL rows
JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
                    max_leaves=6)
GOOD = json.dumps({"question": "What is 2 + 3?", "answer": "2 + 3 = 5\n#### 5"})
ROW = st.one_of(
    st.just(GOOD),
    st.fixed_dictionaries({}, optional={"question": JSON, "answer": JSON, "problem": JSON, "solution": JSON,
                                        "prompt": JSON}).map(json.dumps),
    st.builds(lambda q, a: json.dumps({"question": q, "answer": a}), st.text(max_size=30),
              st.text(max_size=10).map(lambda s: f"work\n#### {s}")),
    JSON.map(json.dumps),
    st.text(max_size=30),
    st.just(GOOD[: len(GOOD) // 2]),  # a row cut off by a full disk
)


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    import importlib.util

    spec = importlib.util.spec_from_file_location("_qerl_tests_conftest", Path(__file__).with_name("conftest.py"))
    conftest = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(conftest)
    path = tmp_path_factory.mktemp("fuzz_model")
    conftest.make_tiny_model("llama").save_pretrained(path)
    conftest.make_tiny_tokenizer().save_pretrained(path)
    return path


@pytest.fixture
def stop_at_the_engine(monkeypatch):
    """A run that got as far as building its rollout engine accepted its data and model."""
    import qerl.train

    def stop(*a, **k):
        raise Accepted

    monkeypatch.setattr(qerl.train, "make_engine", stop)


@fuzz(40)
@given(st.lists(ROW, min_size=1, max_size=6), st.sampled_from(["\n", "\r\n"]))
def test_jsonl_rows(stop_at_the_engine, tiny_model_dir, tmp_path_factory, rows, newline):
    data = tmp_path_factory.mktemp("data")
    (data / "gsm8k").mkdir()
    (data / "gsm8k" / "train.jsonl").write_text(newline.join(rows) + newline)
    argv = ["train", "--profile", "smoke", "--model", tiny_model_dir, "--fmt", "bf16", "--dataset", "gsm8k",
            "--data-dir", data, "--eval-datasets", "none", "--wandb-mode", "disabled", "--max-prompt-length", "512",
            "--output-dir", data / "run"]
    rc, err = call(argv)
    assert_accepted_or_one_error_line(rc, err, rows)


# ---------------------------------------------------------------------------------------------- model folders
def _mutate_config(folder, key, value):
    path = folder / "config.json"
    try:
        cfg = json.loads(path.read_text())
    except (OSError, ValueError):
        return  # an earlier mutation already broke it
    if not isinstance(cfg, dict):
        return
    if value is _DELETE:
        cfg.pop(key, None)
    else:
        cfg[key] = value
    path.write_text(json.dumps(cfg))


_DELETE = object()
CONFIG_KEYS = ["model_type", "architectures", "tie_word_embeddings", "torch_dtype", "quantization_config"]
MUTATION = st.one_of(
    st.tuples(st.just("truncate"), st.sampled_from(["model.safetensors", "config.json", "tokenizer.json"]),
              st.floats(0, 0.999)),
    st.tuples(st.just("garbage"), st.sampled_from(["model.safetensors", "config.json"]), st.binary(max_size=64)),
    st.tuples(st.just("delete"), st.sampled_from(["model.safetensors", "config.json", "tokenizer.json",
                                                  "tokenizer_config.json"]), st.none()),
    st.tuples(st.just("config"), st.sampled_from(CONFIG_KEYS), st.one_of(JSON, st.just(_DELETE))),
    st.tuples(st.just("config-root"), st.none(), JSON.filter(lambda v: not isinstance(v, dict))),
)


def _apply(folder, mutation):
    kind, name, arg = mutation
    if name is not None and kind != "config" and not (folder / name).is_file():
        return  # deleted by an earlier mutation
    if kind == "truncate":
        f = folder / name
        f.write_bytes(f.read_bytes()[: int(f.stat().st_size * arg)])
    elif kind == "garbage":
        (folder / name).write_bytes(arg)
    elif kind == "delete":
        (folder / name).unlink()
    elif kind == "config":
        _mutate_config(folder, name, arg)
    else:
        (folder / "config.json").write_text(json.dumps(arg))


@fuzz(40)
@given(st.lists(MUTATION, min_size=1, max_size=2), st.sampled_from(["quantize", "train"]))
def test_model_folders(stop_at_the_engine, tiny_model_dir, tmp_path_factory, mutations, command):
    folder = tmp_path_factory.mktemp("model")
    shutil.copytree(tiny_model_dir, folder, dirs_exist_ok=True)
    for m in mutations:
        _apply(folder, m)
    if command == "quantize":
        argv = ["quantize", "--model", folder, "--format", "nvfp4", "--out", folder.parent / (folder.name + "-q"),
                "--no-progress"]
    else:
        data = folder.parent / (folder.name + "-data")
        (data / "gsm8k").mkdir(parents=True)
        (data / "gsm8k" / "train.jsonl").write_text(GOOD + "\n")
        argv = ["train", "--profile", "smoke", "--model", folder, "--fmt", "bf16", "--dataset", "gsm8k",
                "--data-dir", data, "--eval-datasets", "none", "--wandb-mode", "disabled",
                "--max-prompt-length", "512", "--output-dir", data / "run"]
    rc, err = call(argv)
    if command == "quantize" and rc == 0:
        rc = None  # quantized: accepted
    assert_accepted_or_one_error_line(rc, err, (command, mutations))
