"""Datasets and prompts for math RL.

Every dataset comes out as a list of records ``{"id", "question", "answer", "dataset"}`` where
``answer`` is the gold FINAL answer as a string (what qerl.rewards compares against), whatever
the source's own field names are. Records of the built-in ``arith`` set also carry ``"level"``.

Sources:
- ``arith``: arithmetic word problems generated here (no download), seeded and deterministic, at
  difficulty levels 1-4 (see ARITH_LEVELS). It is the default task of the embedded 135M model.
- ``gsm8k``, ``math500``, ``aime24``, ``aime25``, ``amc23``, ``bigmath``: from local JSONL when a
  data dir is given (``data_dir=`` or the QERL_DATA_DIR environment variable), else from the
  Hugging Face hub. The local layout is ``<data_dir>/<name>/<split>.jsonl``; BigMath reads
  ``<data_dir>/bigmath/<config>/train.jsonl``.
- your own data (``load_user_split``): a ``.jsonl``, ``.json``, ``.parquet`` or ``.csv`` file (the
  file is every split), a folder holding ``<split>.jsonl|.parquet|.csv``, or a hub dataset id
  (``owner/name``). ``prompt_column`` and ``answer_column`` name its fields (default: ``prompt``,
  ``question`` or ``problem``; ``answer``, else ``solution``); every other field is kept in the
  record's ``"columns"`` and reaches the reward functions as a keyword argument, as in TRL. A prompt
  that is a list of chat messages (``[{"role": ..., "content": ...}]``) is rendered as it is.

Hub ids: gsm8k ``openai/gsm8k`` (config ``main``), math500 ``HuggingFaceH4/MATH-500``, bigmath
``open-r1/Big-Math-RL-Verified-Processed`` (configs ``level_3_4_5``, ``level_4_5``; what the
official QeRL code loads), aime24 ``HuggingFaceH4/aime_2024`` (its only split, ``train``, is
served as ``test``), aime25 ``math-ai/aime25``, amc23 ``math-ai/amc23`` (what the official QeRL
evaluation loads).

Prompts: ``build_prompt`` appends the paper's instruction (Appendix E, ``PROMPT_SUFFIX``) to the
question and applies the tokenizer's chat template. The official QeRL scripts pass the same text
as a system message instead; pass ``system_prompt=`` to add one.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
from pathlib import Path

from qerl import hub
from qerl.config import BIGMATH_CONFIGS, env
from qerl.rewards import gold_to_str, last_boxed

logger = logging.getLogger(__name__)

DATASETS = ("arith", "gsm8k", "math500", "aime24", "aime25", "amc23", "bigmath")

# Paper, Appendix E (exact text).
PROMPT_SUFFIX = (
    "Solve the following math problem step by step. The reasoning process and direct answer are "
    "enclosed within <think> </think> and <answer> </answer> tags, respectively, i.e., <think> "
    "reasoning process here </think> <answer> answer here </answer>"
)

DATA_DIR_ENV = "QERL_DATA_DIR"

# name -> hub path, hub config, {our split: hub split}
_HUB = {
    "gsm8k": ("openai/gsm8k", "main", {"train": "train", "test": "test"}),
    "math500": ("HuggingFaceH4/MATH-500", None, {"test": "test"}),
    "aime24": ("HuggingFaceH4/aime_2024", None, {"test": "train"}),
    "aime25": ("math-ai/aime25", None, {"test": "test"}),
    "amc23": ("math-ai/amc23", None, {"test": "test"}),
    "bigmath": ("open-r1/Big-Math-RL-Verified-Processed", "<config>", {"train": "train"}),
}
SPLITS = {"arith": ("train", "test"), **{name: tuple(hub[2]) for name, hub in _HUB.items()}}


# ---------------------------------------------------------------------------------------------
# gold answers


def gsm8k_gold(solution: str) -> str:
    """The final answer of a GSM8K solution: the text after the last ``####``, without thousands
    separators or a dollar sign ("#### 1,000" -> "1000")."""
    if "####" not in solution:
        raise ValueError(f"GSM8K solution has no '#### <answer>' line: {solution[-200:]!r}")
    answer = solution.rsplit("####", 1)[1].strip()
    return answer.replace(",", "").replace("$", "").strip()


def boxed_answer(solution: str) -> str | None:
    """Content of the last ``\\boxed{...}`` in a solution, or None."""
    return last_boxed(solution)


def _normalise(row: dict, name: str, split: str, index: int) -> dict:
    """One source row -> {"id", "question", "answer", "dataset"}."""
    question = next((row[k] for k in ("question", "problem", "prompt") if row.get(k)), None)
    if question is None:
        raise ValueError(f"{name}/{split} row {index} has no question/problem/prompt field: {sorted(row)}")
    if name == "gsm8k":
        if not isinstance(row.get("answer"), str):
            raise ValueError(f"{name}/{split} row {index} has no answer field (a string ending in '#### <answer>'): "
                             f"{sorted(row)}")
        answer = gsm8k_gold(row["answer"])
    elif row.get("answer") not in (None, ""):
        answer = gold_to_str(row["answer"])  # amc23 stores 27.0, aime25 ints
    elif row.get("solution"):
        solution = str(row["solution"])
        # MATH-style solutions end in \boxed{}; BigMath's "solution" is already the final answer.
        answer = boxed_answer(solution) or solution.strip()
    else:
        raise ValueError(f"{name}/{split} row {index} has no answer or solution field: {sorted(row)}")
    return {"id": f"{name}-{split}-{index}", "question": str(question).strip(), "answer": answer, "dataset": name}


# ---------------------------------------------------------------------------------------------
# loading


def _resolve_data_dir(data_dir) -> Path | None:
    data_dir = data_dir if data_dir is not None else env(DATA_DIR_ENV)
    return Path(data_dir).expanduser() if data_dir is not None else None


def _checked_jsonl(path: Path, name: str, split: str) -> list[dict]:
    """The rows of a JSONL file; a line that is not a usable JSON object is a ValueError naming file:line."""
    rows = []
    try:
        text = path.read_text()
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start}); expected JSON lines") from None
    # JSON lines end in "\n" only (str.splitlines would also split at \x1c-\x1e, \x85, \u2028, ...)
    for lineno, line in enumerate(text.split("\n"), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{lineno}: not valid JSON ({exc.msg} at column {exc.colno})") from None
        if not isinstance(row, dict):
            raise ValueError(f"{path}:{lineno}: expected a JSON object per line, got {type(row).__name__}")
        try:
            _normalise(row, name, split, len(rows))
        except (ValueError, TypeError) as exc:
            raise ValueError(f"{path}:{lineno}: {exc}") from None
        rows.append(row)
    if not rows:
        raise ValueError(f"{path}: no rows (an empty file); expected one JSON object per line")
    return rows


def _local_rows(name: str, split: str, data_dir: Path, config: str | None) -> list[dict]:
    folder = data_dir / name / config if name == "bigmath" else data_dir / name
    path = folder / f"{split}.jsonl"
    if not path.is_file():
        have = sorted(p.name for p in folder.glob("*.jsonl")) if folder.is_dir() else []
        raise FileNotFoundError(
            f"{name} split {split!r}: no file {path} (found in {folder}: {have or 'nothing'}). "
            f"Expected the layout <data_dir>/<dataset>/<split>.jsonl (docs/own-task.md)."
        )
    rows = _checked_jsonl(path, name, split)
    try:
        import datasets
    except ImportError:  # a bare GPU box: same rows, read line by line (no change to the data)
        logger.warning("the `datasets` package is not installed: reading %s with the json module", path)
        return rows

    # The "Generating train split" bar is noise for files this small.
    bars_were_off = datasets.utils.are_progress_bars_disabled()
    datasets.utils.disable_progress_bars()
    try:
        ds = datasets.load_dataset("json", data_files=str(path), split="train")
    except Exception as exc:  # noqa: BLE001 - e.g. a field that is a string in one row and a number in another
        # the rows the json module read above are the file's content as it is: use those
        logger.warning("datasets cannot read %s (%s: %s); using the rows as the json module read them", path,
                       type(exc).__name__, str(exc).strip().splitlines()[0] if str(exc).strip() else "")
        return rows
    finally:
        if not bars_were_off:
            datasets.utils.enable_progress_bars()
    return [dict(row) for row in ds]


def _hub_rows(name: str, split: str, config: str | None) -> list[dict]:
    import datasets

    path, hub_config, split_map = _HUB[name]
    if hub_config == "<config>":
        hub_config = config
    hub.online()  # no network: offline mode, so a dataset not in the cache fails at once
    try:
        ds = datasets.load_dataset(path, hub_config, split=split_map[split])
    except Exception as e:  # noqa: BLE001 - any hub failure gets the same advice
        raise RuntimeError(
            f"could not load {name!r} ({path}{', ' + hub_config if hub_config else ''}, split "
            f"{split_map[split]!r}) from the Hugging Face hub: {type(e).__name__}: {e}. Without hub "
            f"access, point qerl at local JSONL copies: set {DATA_DIR_ENV}=<dir> or pass "
            f"--data-dir <dir> (data_dir=...), laid out as <dir>/<dataset>/<split>.jsonl "
            f"(docs/own-task.md)."
        ) from e
    return [dict(row) for row in ds]


def load_dataset_split(
    name: str, split: str, data_dir=None, limit: int | None = None, seed: int = 0, **kw
) -> list[dict]:
    """Load one split of a dataset as normalised records.

    name: one of DATASETS, or your own data (a file, a folder or a hub id: see load_user_split; the
    options prompt_column, answer_column and require_answer go there).
    split: "train" or "test" (SPLITS lists what each built-in dataset has).
    data_dir: folder of local JSONL copies; default: $QERL_DATA_DIR, else the hub.
    limit: keep the first `limit` records (after shuffling, if shuffle=True).
    seed: the arith generator's seed, and the shuffle seed.
    kw: shuffle (bool, default False); bigmath: config (one of BIGMATH_CONFIGS, default
    "level_3_4_5"); arith: see generate_arith (levels, num_examples, test_fraction).
    """
    if limit is not None and limit < 0:
        raise ValueError(f"limit must be >= 0 or None, got {limit}")
    user = {k: kw.pop(k) for k in ("prompt_column", "answer_column", "require_answer") if k in kw}
    if name not in DATASETS:
        if not looks_like_user_data(name):
            raise ValueError(f"unknown dataset {name!r}: not a built-in name ({', '.join(DATASETS)}), an existing "
                             f"file ({', '.join(DATA_SUFFIXES)}) or folder, or a hub id (owner/name)")
        shuffle = bool(kw.pop("shuffle", False))
        if kw:
            raise ValueError(f"unexpected options for your own dataset {name!r}: {', '.join(sorted(kw))}")
        records = load_user_split(name, split, **user)
        if shuffle:
            random.Random(f"shuffle-{name}-{split}-{seed}").shuffle(records)
        return records if limit is None else records[:limit]
    if split not in SPLITS[name]:
        raise ValueError(f"dataset {name!r} has no split {split!r}; its splits: {', '.join(SPLITS[name])}")
    if user:
        raise ValueError(f"{', '.join(sorted(user))}: for your own data, not the built-in dataset {name!r}")
    shuffle = bool(kw.pop("shuffle", False))

    if name == "arith":
        unknown = sorted(set(kw) - {"levels", "num_examples", "test_fraction"})
        if unknown:
            raise ValueError(f"unexpected options for 'arith': {', '.join(unknown)}; "
                             f"allowed: levels, num_examples, test_fraction, shuffle")
        records = generate_arith(split, seed=seed, **kw)
    else:
        config = kw.pop("config", BIGMATH_CONFIGS[0]) if name == "bigmath" else None
        if config is not None and config not in BIGMATH_CONFIGS:
            raise ValueError(f"unknown bigmath config {config!r}; known: {', '.join(BIGMATH_CONFIGS)}")
        if kw:
            raise ValueError(f"unexpected options for {name!r}: {', '.join(sorted(kw))}")
        root = _resolve_data_dir(data_dir)
        rows = _local_rows(name, split, root, config) if root is not None else _hub_rows(name, split, config)
        records = [_normalise(row, name, split, i) for i, row in enumerate(rows)]

    if shuffle:
        random.Random(f"shuffle-{name}-{split}-{seed}").shuffle(records)
    return records if limit is None else records[:limit]


# ---------------------------------------------------------------------------------------------
# your own data: a file, a folder or a hub dataset

DATA_SUFFIXES = (".jsonl", ".json", ".parquet", ".csv")
PROMPT_COLUMNS = ("prompt", "question", "problem")


def looks_like_user_data(name: str) -> bool:
    """A local file or folder, or a hub id (owner/name) that is not a local path."""
    p = Path(name).expanduser()
    return p.exists() or p.suffix in DATA_SUFFIXES or (name.count("/") == 1 and not name.startswith((".", "/")))


def _read_rows(path: Path) -> list[tuple[str, dict]]:
    """(where, row) of every row of a local file; where is "file:line" (jsonl, csv) or "file: row i"."""
    where = str(path)
    if path.suffix in (".jsonl", ".json"):
        try:
            text = path.read_text()
        except UnicodeDecodeError as exc:
            raise ValueError(f"{where}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
        if path.suffix == ".json" and text.lstrip().startswith("["):  # one JSON array of objects
            try:
                rows = json.loads(text)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{where}:{exc.lineno}: not valid JSON ({exc.msg} at column {exc.colno})") from None
            out = [(f"{where}: item {i}", r) for i, r in enumerate(rows)]
        else:
            out = []
            for lineno, line in enumerate(text.splitlines(), 1):
                if not line.strip():
                    continue
                try:
                    out.append((f"{where}:{lineno}", json.loads(line)))
                except json.JSONDecodeError as exc:
                    raise ValueError(f"{where}:{lineno}: not valid JSON ({exc.msg} at column {exc.colno})") from None
    elif path.suffix == ".csv":
        import csv

        with path.open(newline="") as f:
            reader = csv.DictReader(f)
            out = [(f"{where}:{reader.line_num}", dict(row)) for row in reader]
    elif path.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq

            table = pq.read_table(path)
        except Exception as exc:  # noqa: BLE001 - pyarrow raises several types for a bad file
            raise ValueError(f"{where}: cannot read as Parquet ({type(exc).__name__}: {exc})") from None
        out = [(f"{where}: row {i}", r) for i, r in enumerate(table.to_pylist())]
    else:
        raise ValueError(f"{where}: unknown data file type {path.suffix!r}; expected one of {', '.join(DATA_SUFFIXES)}")
    for w, r in out:
        if not isinstance(r, dict):
            raise ValueError(f"{w}: expected a JSON object per row, got {type(r).__name__}")
    return out


def _folder_file(folder: Path, split: str) -> Path:
    """The file of one split in a folder: <split>.jsonl|.json|.parquet|.csv, or a hub-style <split>-*.parquet."""
    for suffix in DATA_SUFFIXES:
        if (folder / f"{split}{suffix}").is_file():
            return folder / f"{split}{suffix}"
    shards = sorted(folder.glob(f"**/{split}-*.parquet"))
    if shards:
        return shards[0]
    have = sorted(p.name for p in folder.iterdir())[:12]
    raise FileNotFoundError(f"{folder}: no {split} split (expected {split}.jsonl, {split}.parquet or {split}.csv; "
                            f"found {have or 'nothing'})")


def _hub_user_rows(name: str, split: str) -> list[tuple[str, dict]]:
    hub.online()  # no network: offline mode, so a dataset not in the cache fails at once
    try:
        import datasets

        ds = datasets.load_dataset(name, split=split)
    except Exception as exc:  # noqa: BLE001 - any hub failure gets the same advice
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise FileNotFoundError(f"dataset {name!r}: no such local file or folder, and loading it from the Hugging Face "
                                f"hub (split {split!r}) failed: {type(exc).__name__}: {first}") from None
    return [(f"{name} ({split}) row {i}", dict(r)) for i, r in enumerate(ds)]


def user_record(row: dict, where: str, index: int, name: str, prompt_column: str | None = None,
                answer_column: str | None = None, require_answer: bool = True) -> dict:
    """One row of your own data -> {"id", "question", "prompt", "answer", "dataset", "columns"}.

    ``columns`` holds every field but the prompt (the reward functions' keyword arguments);
    ``answer`` is the gold answer as a string, or None when the data has none and none is required.
    """
    cols = sorted(row)
    pcol = prompt_column or next((c for c in PROMPT_COLUMNS if row.get(c) not in (None, "")), None)
    if pcol is None or row.get(pcol) in (None, ""):
        want = repr(prompt_column) if prompt_column else "prompt, question or problem"
        raise ValueError(f"{where}: no {want} field (fields: {cols}); name the prompt field with --prompt-column")
    prompt = row[pcol]
    if isinstance(prompt, list):
        if not all(isinstance(m, dict) and "role" in m and "content" in m for m in prompt):
            raise ValueError(f"{where}: field {pcol!r} is a list but not chat messages [{{'role', 'content'}}, ...]")
        question = next((m["content"] for m in reversed(prompt) if m["role"] == "user"), "")
    else:
        prompt = question = str(prompt).strip()
    answer = None
    if answer_column is not None:
        if row.get(answer_column) in (None, ""):
            raise ValueError(f"{where}: no {answer_column!r} field (fields: {cols}); check --answer-column")
        answer = gold_to_str(row[answer_column])
    elif row.get("answer") not in (None, ""):
        answer = gold_to_str(row["answer"])
    elif row.get("solution"):
        answer = boxed_answer(str(row["solution"])) or str(row["solution"]).strip()
    if answer is None and require_answer:
        raise ValueError(f"{where}: no 'answer' field (fields: {cols}); the built-in rewards need the gold answer: "
                         f"name its field with --answer-column, or use only your own reward functions")
    return {"id": f"{name}-{index}", "question": question, "prompt": prompt, "answer": answer, "dataset": name,
            "columns": {k: v for k, v in row.items() if k != pcol}}


def user_records(rows, name: str = "train_dataset", **kw) -> list[dict]:
    """Records of in-memory rows (a list of dicts or a datasets.Dataset): ``qerl.train(train_dataset=...)``."""
    if isinstance(rows, (str, os.PathLike)):
        return load_user_split(str(rows), "train", **kw)
    out = []
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise ValueError(f"{name} item {i}: expected a dict per row, got {type(row).__name__}")
        out.append(user_record(dict(row), f"{name} item {i}", i, name, **kw))
    if not out:
        raise ValueError(f"{name} is empty")
    return out


def load_user_split(name: str, split: str = "train", prompt_column: str | None = None,
                    answer_column: str | None = None, require_answer: bool = True) -> list[dict]:
    """Records of your own data: a file (every split), a folder (<split>.jsonl|.parquet|.csv) or a hub id.

    Errors name the file and line (or row) and the field: a bad row is a ValueError, a missing file a
    FileNotFoundError.
    """
    path = Path(name).expanduser()
    if path.is_dir():
        path = _folder_file(path, split)
    if path.is_file():
        rows = _read_rows(path)
    elif path.suffix in DATA_SUFFIXES or name.startswith((".", "/", "~")):
        raise FileNotFoundError(f"dataset {name}: no such file")
    else:
        rows = _hub_user_rows(name, split)
    if not rows:
        raise ValueError(f"dataset {name}: no rows in {path if path.is_file() else name}")
    label = Path(name).stem if Path(name).exists() else name
    return [user_record(r, where, i, label, prompt_column, answer_column, require_answer)
            for i, (where, r) in enumerate(rows)]


# ---------------------------------------------------------------------------------------------
# prompts


def build_prompt(question, tokenizer, system_prompt: str | None = None, suffix: str = PROMPT_SUFFIX,
                 chat_template: bool = True) -> str:
    """The model input for one question: question + the paper's instruction, in the chat template.

    Uses ``tokenizer.apply_chat_template(..., add_generation_prompt=True)`` so the text ends where
    the assistant's answer begins. A tokenizer without a chat template gets plain text (with a
    warning): the question, the instruction, and an empty line. ``question`` may also be a list of
    chat messages (rendered as they are, no suffix); ``chat_template=False`` returns the text
    (question and suffix) untemplated.
    """
    if isinstance(question, list):
        if not chat_template or not getattr(tokenizer, "chat_template", None):
            raise ValueError("a prompt of chat messages needs the tokenizer's chat template (chat_template=True)")
        return tokenizer.apply_chat_template(question, tokenize=False, add_generation_prompt=True)
    content = f"{question.strip()}\n{suffix}" if suffix else question.strip()
    if not chat_template:
        return content
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    messages.append({"role": "user", "content": content})
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    logger.warning("tokenizer has no chat template; building a plain-text prompt")
    parts = ([system_prompt] if system_prompt else []) + [content]
    return "\n\n".join(parts) + "\n\n"


def prompt_suffix(setting: str) -> str:
    """TrainConfig.prompt_suffix -> the text appended to prompts ("paper": PROMPT_SUFFIX)."""
    return PROMPT_SUFFIX if setting == "paper" else setting


def tokenize_prompts(records, tokenizer, max_prompt_length: int, chat_template: bool = True,
                     suffix: str = PROMPT_SUFFIX):
    """Chat-templated prompt token ids; prompts over max_prompt_length are skipped and counted."""
    keep, skipped = [], 0
    for r in records:
        text = build_prompt(r.get("prompt", r["question"]), tokenizer, suffix=suffix, chat_template=chat_template)
        ids = tokenizer(text, add_special_tokens=not chat_template)["input_ids"]
        if len(ids) > max_prompt_length:
            skipped += 1
            continue
        keep.append({**r, "prompt_ids": ids})
    if skipped:
        print(f"[qerl] skipped {skipped} prompts longer than max_prompt_length={max_prompt_length}")
    if not keep:
        raise ValueError("no prompt fits max_prompt_length")
    return keep, skipped


# ---------------------------------------------------------------------------------------------
# arith: generated arithmetic word problems

ARITH_LEVELS = {
    0: "one step, no story: a + b or a - b with numbers up to 30 (a warm-up the 135M model can start on)",
    1: "one step: a + b or a - b, numbers of 1-2 digits",
    2: "two steps with a multiplication: a * b + c or a * b - c, a <= 12, b <= 15, c <= 50",
    3: "three steps, numbers up to 3 digits: a + b * c - d, (a + b) * p - d",
    4: "four steps with an exact division, up to 3 digits: (a * b + c) / k, (a + b * c - d) / k",
}
DEFAULT_ARITH_LEVELS = (1, 2)
_NAMES = ("Ava", "Ben", "Chloe", "Diego", "Emma", "Farah", "Hugo", "Ines", "Jack", "Kenji", "Lena", "Mateo",
          "Nora", "Omar", "Priya", "Sam", "Tara", "Yuki", "Zoe", "Liam")
_ITEMS = ("apples", "marbles", "stickers", "pencils", "cookies", "books", "shells", "cards", "coins", "stamps",
          "oranges", "balloons")


def _level0(rng):
    a, b = rng.randint(1, 30), rng.randint(1, 30)
    if rng.random() < 0.5:
        return 0, dict(a=a, b=b), a + b, "What is {a} + {b}?"
    a, b = max(a, b), min(a, b)
    return 1, dict(a=a, b=b), a - b, "What is {a} - {b}?"


def _level1(rng):
    a, b = rng.randint(1, 99), rng.randint(1, 99)
    if rng.random() < 0.5:
        return 0, dict(a=a, b=b), a + b, "{n} has {a} {i}. {n} gets {b} more {i}. How many {i} does {n} have now?"
    a, b = max(a, b), min(a, b)
    return 1, dict(a=a, b=b), a - b, "{n} has {a} {i} and gives {b} of them to a friend. How many {i} does {n} have left?"


def _level2(rng):
    a, b = rng.randint(2, 12), rng.randint(2, 15)
    if rng.random() < 0.5:
        c = rng.randint(1, 50)
        return 0, dict(a=a, b=b, c=c), a * b + c, (
            "{n} buys {a} bags of {i}. Each bag has {b} {i}. Then {n} finds {c} more {i}. "
            "How many {i} does {n} have in total?")
    c = rng.randint(1, a * b)
    return 1, dict(a=a, b=b, c=c), a * b - c, (
        "{n} has {a} boxes with {b} {i} in each box. {n} gives away {c} {i}. How many {i} are left?")


def _level3(rng):
    if rng.random() < 0.5:
        a, b, c = rng.randint(10, 199), rng.randint(2, 12), rng.randint(5, 49)
        d = rng.randint(1, a + b * c)
        return 0, dict(a=a, b=b, c=c, d=d), a + b * c - d, (
            "{n} has {a} {i}. {n} buys {b} packs with {c} {i} in each pack, then gives {d} {i} to "
            "a friend. How many {i} does {n} have now?")
    a, b, p = rng.randint(2, 40), rng.randint(2, 40), rng.randint(2, 25)
    d = rng.randint(1, (a + b) * p - 1)
    return 1, dict(a=a, b=b, p=p, d=d), (a + b) * p - d, (
        "{n} buys {a} {i} on Monday and {b} {i} on Tuesday. Each costs {p} dollars. {n} has a coupon "
        "for {d} dollars off the total. How many dollars does {n} pay?")


def _level4(rng):
    k, q = rng.randint(2, 12), rng.randint(5, 99)
    if rng.random() < 0.5:
        a, b = rng.randint(2, 20), rng.randint(2, 15)
        c = q * k - a * b
        if c < 1:
            return None
        return 0, dict(a=a, b=b, c=c, k=k), q, (
            "{n} collects {a} {i} every day for {b} days, then buys {c} more. {n} shares all the {i} "
            "equally among {k} friends. How many {i} does each friend get?")
    b, c = rng.randint(2, 12), rng.randint(5, 30)
    a = rng.randint(10, 300)
    d = a + b * c - q * k
    if d < 1 or d > a + b * c - 1:
        return None
    return 1, dict(a=a, b=b, c=c, d=d, k=k), q, (
        "A shop has {a} {i}. It receives {b} crates with {c} {i} in each crate and sells {d} {i}. "
        "The rest are packed equally into {k} boxes. How many {i} go in each box?")


_LEVEL_FNS = {0: _level0, 1: _level1, 2: _level2, 3: _level3, 4: _level4}


def _in_test_split(level: int, template: int, numbers: tuple, test_fraction: float) -> bool:
    """Deterministic split by the problem's arithmetic content (not its names or seed), so the
    same numbers can never appear in both train and test, whatever the seeds."""
    key = f"{level}|{template}|{','.join(map(str, numbers))}".encode()
    h = int.from_bytes(hashlib.sha256(key).digest()[:8], "big")
    return (h % 10_000) < test_fraction * 10_000


def generate_arith(
    split: str,
    seed: int = 0,
    levels=DEFAULT_ARITH_LEVELS,
    num_examples: int | None = None,
    test_fraction: float = 0.1,
) -> list[dict]:
    """Generated arithmetic word problems (records with an extra "level" key).

    split: "train" or "test"; the two never share a problem (same template and numbers), for any
    seeds. seed: same seed -> same list. levels: iterable of ARITH_LEVELS keys, used in turn.
    num_examples: default 5000 (train) / 500 (test). test_fraction: share of the problem space
    reserved for test.
    """
    if split not in ("train", "test"):
        raise ValueError(f"arith has splits 'train' and 'test', got {split!r}")
    levels = tuple(int(x) for x in ([levels] if isinstance(levels, int) else levels))
    bad = [x for x in levels if x not in ARITH_LEVELS]
    if not levels or bad:
        raise ValueError(f"arith levels must be a non-empty subset of {sorted(ARITH_LEVELS)}, got {levels}")
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")
    n = num_examples if num_examples is not None else (5000 if split == "train" else 500)
    if n < 0:
        raise ValueError(f"num_examples must be >= 0, got {n}")

    rng = random.Random(f"arith-{split}-{seed}")
    want_test = split == "test"
    seen: set = set()
    records: list[dict] = []
    # A level whose problem space is used up (this many draws in a row that add nothing) leaves the
    # rotation, so a small level (0) never stalls a mix. With the default size, the split is simply
    # all that the levels hold; an explicit num_examples that cannot be met is an error.
    misses = {lv: 0 for lv in levels}
    max_misses = 20_000
    live = list(levels)
    while len(records) < n:
        if not live:
            if num_examples is None:
                break
            raise ValueError(
                f"could only generate {len(records)} distinct arith {split} problems of levels "
                f"{levels} (asked for {n}); ask for fewer or add harder levels")
        level = live[len(records) % len(live)]
        out = _LEVEL_FNS[level](rng)
        misses[level] += 1
        if misses[level] > max_misses:
            live.remove(level)
            continue
        if out is None:
            continue
        template, fields, answer, text = out
        numbers = tuple(fields[k] for k in sorted(fields))
        key = (level, template, numbers)
        if key in seen or _in_test_split(level, template, numbers, test_fraction) != want_test:
            continue
        seen.add(key)
        misses[level] = 0
        question = text.format(n=rng.choice(_NAMES), i=rng.choice(_ITEMS), **fields)
        records.append({
            "id": f"arith-{split}-{seed}-{len(records)}",
            "question": question,
            "answer": str(answer),
            "dataset": "arith",
            "level": level,
        })
    return records


def save_jsonl(records: list[dict], path) -> None:
    """Write records one JSON object a line (e.g. to freeze a generated arith split)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")

