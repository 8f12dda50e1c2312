"""Evaluation: pass@1 averaged over n samples (the paper: temperature 0.6, top-p 0.95), or greedy.

pass@1 with n samples is the mean accuracy over all n samples of all problems (every problem has
the same n, so it is also the mean over problems of each problem's mean). Its standard error is
taken over problems: std(per-problem means, ddof=1) / sqrt(problems), which counts both the
sampling noise and the finite problem set; more samples per problem shrink the first part only.
Results per dataset: accuracy, accuracy_stderr, format rate, mean completion length, truncated
(the fraction of samples that reached max_new_tokens without ending), num_problems and samples.

Your own task is scored as it is trained: with ``rewards`` (a ``qerl.rewards.RewardSet`` holding one of your
functions), each completion gets the run's reward functions, called as in training (the prompt as written,
the completions, the row's other fields as keyword arguments), and their weighted sum. pass@1 is then the
mean of that sum over samples and problems (the expected reward of one sample; the accuracy when the reward
is a 0/1 check), and ``rewards/<name>/mean`` each function's mean. Built-in rewards alone (math_verify,
official_exact) keep math_verify's accuracy.

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
             chat_template: bool = True, rewards=None, keep_completions: bool = False) -> dict:
    """pass@1 over ``samples`` samples per problem (greedy: one deterministic sample). Prompts are built as
    in training: ``prompt_suffix`` (TrainConfig.prompt_suffix: "paper", "" or a text) and ``chat_template``.
    ``rewards``: the run's RewardSet; with a function of your own in it, pass@1 is the mean weighted reward
    and ``rewards/<name>/mean`` each function's mean (see the module's docstring). ``keep_completions``: the
    result's "completions" holds each sample's text and its problem's row (problem by problem)."""
    if samples < 1:
        raise ValueError("samples must be >= 1")
    samples = 1 if greedy else samples
    engine = make_engine(model, tokenizer, kind=engine)
    was_training = model.training
    model.eval()
    kept, skipped = qdata.tokenize_prompts(records, tokenizer, max_prompt_length, chat_template,
                                           qdata.prompt_suffix(prompt_suffix))
    own = rewards if rewards is not None and any(not f.builtin for f in rewards.funcs) else None
    items = [(r["prompt_ids"], r["answer"], r) for r in kept for _ in range(samples)]
    acc, fmt, lens, unparsed, comps, texts_all, cut = [], [], [], 0, [], [], 0
    for s in tqdm(range(0, len(items), batch_size), desc=desc, leave=False):
        chunk = items[s:s + batch_size]
        ro = engine.generate([c[0] for c in chunk], max_new_tokens, temperature=temperature, top_p=top_p,
                             greedy=greedy, seed=seed, seq_ids=list(range(s, s + len(chunk))))
        texts = tokenizer.batch_decode(ro.completion_ids * ro.completion_mask + engine.pad_id * (1 - ro.completion_mask),
                                       skip_special_tokens=True)
        texts_all += texts
        if own is not None:
            comp, bad, total = score_rows(own, [c[2] for c in chunk], texts)
            acc += total
            comps += comp
            unparsed += bad
        else:
            res = qrewards.score_batch(texts, [c[1] for c in chunk])
            acc += res.rewards
            fmt += res.format
            unparsed += res.unparsed
        lens += ro.completion_mask.sum(1).tolist()
        cut += int(ro.truncated.sum())
    model.train(was_training)
    n = max(len(acc), 1)
    mean, stderr = pass_at_1(acc, samples)
    out = {"accuracy": mean, "accuracy_stderr": stderr, "format": sum(fmt) / n if fmt else None,
           "mean_length": sum(lens) / n, "truncated": cut / n, "num_problems": len(items) // samples, "samples": samples,
           "unparsed": unparsed, "skipped_long_prompts": skipped}
    if own is not None:
        out["reward"] = mean
        for j, name in enumerate(own.names):
            vals = [row[j] for row in comps if not math.isnan(row[j])]
            out[f"rewards/{name}/mean"] = sum(vals) / len(vals) if vals else None
    if keep_completions:
        out["completions"] = [{"row": {k: v for k, v in c[2].items() if k not in ("prompt_ids",)}, "completion": t}
                              for c, t in zip(items, texts_all)]
    return out


def score_rows(rewards, rows: list[dict], completions: list[str]) -> tuple[list[list[float]], int, list[float]]:
    """(each completion's component rewards [n][len(rewards.names)], NaN where a function gave None; the
    completions the built-in reward could not parse; each completion's weighted sum, a None left out) of
    completions of the dataset records ``rows``, called as training calls the reward functions: the prompt
    as written, the row's other fields as keyword arguments (``answer`` the gold one for a built-in)."""
    prompts = [r.get("prompt", r.get("question")) for r in rows]
    cols = [r.get("columns") or {k: v for k, v in r.items() if k in ("answer", "level")} for r in rows]
    columns = {k: [c.get(k) for c in cols] for k in sorted({k for c in cols for k in c})}
    if rewards.needs_answer:
        columns["answer"] = [r.get("answer") for r in rows]
    comp, unparsed = rewards(prompts, completions, columns)
    total = [sum(w * v for w, v in zip(rewards.weights, row) if not math.isnan(v)) for row in comp]
    return comp, unparsed, total


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
    keys = ("accuracy", "accuracy_stderr", "format", "truncated", "num_problems", "samples", "reward")
    return {f"{prefix}/{d}/{k}": r[k] for d, r in results.items() for k in r if k in keys or k.startswith("rewards/")}


def eval_records(name: str, limit: int = 0, data_dir=None, seed: int = 0, arith_levels=None,
                 prompt_column: str | None = None, answer_column: str | None = None,
                 require_answer: bool = True) -> list[dict]:
    """The test split of one evaluation dataset: a built-in name, or your own file, folder or hub id
    (qerl.data.load_user_split), whose fields ``prompt_column`` and ``answer_column`` name (the gold answer
    is needed unless ``require_answer`` is False: scored by your own reward functions only)."""
    from qerl.config import TrainConfig

    arith_levels = arith_levels if arith_levels is not None else TrainConfig.arith_levels
    extra = ({"levels": tuple(arith_levels)} if name == "arith" else {} if name in qdata.DATASETS
             else {"prompt_column": prompt_column, "answer_column": answer_column, "require_answer": require_answer})
    return qdata.load_dataset_split(name, "test", data_dir=data_dir, seed=seed, limit=limit or None, **extra)


def evaluate_datasets(model, tokenizer, datasets, limit: int = 0, data_dir=None, seed: int = 0,
                      arith_levels=None, prompt_column: str | None = None, answer_column: str | None = None,
                      records: dict[str, list[dict]] | None = None, rewards=None, **kw) -> dict[str, dict]:
    """Evaluate on the test split of each dataset (``eval_records``; ``records``: {name: records} read
    already, e.g. before the model loaded); returns {dataset: result}. ``rewards`` (the run's RewardSet)
    scores your own datasets; the built-in ones are scored by math_verify."""
    out = {}
    for name in datasets:
        mine = rewards if name not in qdata.DATASETS else None
        recs = (records or {}).get(name)
        if recs is None:
            recs = eval_records(name, limit, data_dir, seed, arith_levels, prompt_column, answer_column,
                                require_answer=own_needs_answer(mine))
        out[name] = evaluate(model, tokenizer, recs, seed=seed, desc=f"eval {name}", rewards=mine, **kw)
    return out


def own_needs_answer(rewards) -> bool:
    """Whether your evaluation data needs its gold-answer field: scored by math_verify, or by a reward set
    with a built-in reward in it."""
    return rewards is None or not any(not f.builtin for f in rewards.funcs) or rewards.needs_answer


def write_results(results: dict, path: str | Path, meta: dict | None = None):
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps({"results": results, **(meta or {})}, indent=2, default=str))
