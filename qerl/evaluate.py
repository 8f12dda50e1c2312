"""Evaluation: pass@1 averaged over n samples (the paper: temperature 0.6, top-p 0.95), or greedy.

pass@1 with n samples is the mean accuracy over all n samples of all problems (every problem has
the same n, so it is also the mean over problems of each problem's mean). Its standard error is
taken over problems: std(per-problem means, ddof=1) / sqrt(problems), which counts both the
sampling noise and the finite problem set; more samples per problem shrink the first part only.
Results per dataset: accuracy, accuracy_stderr, format rate, mean completion length,
num_problems and samples.

``qerl.config.eval_settings(cfg)`` is the one place a run config becomes evaluation settings: the
trainer, the ``eval`` CLI's defaults and the experiment scripts all read it.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from tqdm.auto import tqdm

from qerl import data as qdata
from qerl import rewards as qrewards
from qerl.rollout import make_engine


@torch.no_grad()
def evaluate(model, tokenizer, records: list[dict], samples: int = 1, temperature: float = 0.6, top_p: float = 0.95,
             greedy: bool = False, max_new_tokens: int = 512, batch_size: int = 32, seed: int = 0,
             max_prompt_length: int = 1024, desc: str = "eval", engine: str = "auto", prompt_suffix: str = "paper",
             chat_template: bool = True) -> dict:
    """pass@1 over ``samples`` samples per problem (greedy: one deterministic sample). Prompts are built as
    in training: ``prompt_suffix`` (TrainConfig.prompt_suffix: "paper", "" or a text) and ``chat_template``."""
    if samples < 1:
        raise ValueError("samples must be >= 1")
    samples = 1 if greedy else samples
    engine = make_engine(model, tokenizer, kind=engine)
    was_training = model.training
    model.eval()
    kept, skipped = qdata.tokenize_prompts(records, tokenizer, max_prompt_length, chat_template,
                                           qdata.prompt_suffix(prompt_suffix))
    items = [(r["prompt_ids"], r["answer"]) for r in kept for _ in range(samples)]
    acc, fmt, lens, unparsed = [], [], [], 0
    for s in tqdm(range(0, len(items), batch_size), desc=desc, leave=False):
        chunk = items[s:s + batch_size]
        ro = engine.generate([c[0] for c in chunk], max_new_tokens, temperature=temperature, top_p=top_p,
                             greedy=greedy, seed=seed, seq_ids=list(range(s, s + len(chunk))))
        texts = tokenizer.batch_decode(ro.completion_ids * ro.completion_mask + engine.pad_id * (1 - ro.completion_mask),
                                       skip_special_tokens=True)
        res = qrewards.score_batch(texts, [c[1] for c in chunk])
        acc += res.rewards
        fmt += res.format
        unparsed += res.unparsed
        lens += ro.completion_mask.sum(1).tolist()
    model.train(was_training)
    n = max(len(acc), 1)
    mean, stderr = pass_at_1(acc, samples)
    return {"accuracy": mean, "accuracy_stderr": stderr, "format": sum(fmt) / n, "mean_length": sum(lens) / n,
            "num_problems": len(items) // samples, "samples": samples, "unparsed": unparsed,
            "skipped_long_prompts": skipped}


def pass_at_1(correct: list[float], samples: int) -> tuple[float, float | None]:
    """(pass@1, its standard error over problems) from per-sample scores laid out problem by problem
    (``samples`` consecutive entries per problem). The error is None with fewer than two problems."""
    if samples < 1 or len(correct) % samples:
        raise ValueError(f"{len(correct)} scores do not split into problems of {samples} samples")
    per_problem = [sum(correct[i:i + samples]) / samples for i in range(0, len(correct), samples)]
    k = len(per_problem)
    if k == 0:
        return 0.0, None
    mean = sum(per_problem) / k
    if k < 2:
        return mean, None
    var = sum((x - mean) ** 2 for x in per_problem) / (k - 1)
    return mean, math.sqrt(var / k)


def summary_entries(prefix: str, results: dict[str, dict]) -> dict:
    """Flat ``{prefix}/{dataset}/{key}`` entries of evaluation results for metrics and summaries."""
    keys = ("accuracy", "accuracy_stderr", "format", "num_problems", "samples")
    return {f"{prefix}/{d}/{k}": r[k] for d, r in results.items() for k in keys if k in r}


def eval_records(name: str, limit: int = 0, data_dir=None, seed: int = 0, arith_levels=None,
                 prompt_column: str | None = None, answer_column: str | None = None) -> list[dict]:
    """The test split of one evaluation dataset: a built-in name, or your own file, folder or hub id
    (qerl.data.load_user_split), whose fields ``prompt_column`` and ``answer_column`` name (the gold answer
    is needed: the built-in reward scores it)."""
    from qerl.config import TrainConfig

    arith_levels = arith_levels if arith_levels is not None else TrainConfig.arith_levels
    extra = ({"levels": tuple(arith_levels)} if name == "arith" else {} if name in qdata.DATASETS
             else {"prompt_column": prompt_column, "answer_column": answer_column})
    return qdata.load_dataset_split(name, "test", data_dir=data_dir, seed=seed, limit=limit or None, **extra)


def evaluate_datasets(model, tokenizer, datasets, limit: int = 0, data_dir=None, seed: int = 0,
                      arith_levels=None, prompt_column: str | None = None, answer_column: str | None = None,
                      records: dict[str, list[dict]] | None = None, **kw) -> dict[str, dict]:
    """Evaluate on the test split of each dataset (``eval_records``; ``records``: {name: records} read
    already, e.g. before the model loaded); returns {dataset: result}."""
    out = {}
    for name in datasets:
        recs = (records or {}).get(name)
        if recs is None:
            recs = eval_records(name, limit, data_dir, seed, arith_levels, prompt_column, answer_column)
        out[name] = evaluate(model, tokenizer, recs, seed=seed, desc=f"eval {name}", **kw)
    return out


def write_results(results: dict, path: str | Path, meta: dict | None = None):
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps({"results": results, **(meta or {})}, indent=2, default=str))
