"""Rewards for math RL: answer accuracy (checked with math-verify) and output format.

The paper's prompt (Appendix E) asks for ``<think> ... </think> <answer> ... </answer>``; the
official code's evaluation (eval/gsm8k.py) takes the answer inside the tags, exact match first, then
math-verify. qerl scores that answer with math-verify (its GSM8K training reward, an exact match, is
``reward="official_exact"`` below), with fallbacks for completions that forget the tags:

1. the content of the last ``<answer>...</answer>`` (an ``<answer>`` that is never closed, e.g. a
   truncated completion, counts from the tag to the end of the text);
2. else the content of the last ``\\boxed{...}`` in the text;
3. else the last number in the text (``1,000``, ``-3.5`` and ``7/2`` count as numbers).

Pass ``fallback=False`` to score only answers inside the tags (the strict reading of the prompt).

Guards, so one bad completion cannot stall a training step:
- nothing here raises on any string; errors inside math-verify count as a wrong answer;
- candidate answers are cut to ``MAX_ANSWER_CHARS`` before parsing (math-verify's own regexes
  and SymPy are the slow parts; the tag/box/number search here is linear in the text);
- math-verify's timeouts (``signal.alarm``, whole seconds) bound parsing and comparison when
  called from the main thread. Signals do not work in other threads, so there qerl turns them off
  and instead scores 0 (without calling SymPy) the inputs known to make SymPy run for minutes:
  power towers (``9^{9^{9}}``) and factorials of large numbers. Call from the main thread for the
  full guarantee.

``format_reward`` is 1.0 for the full structure, ``PARTIAL_FORMAT_REWARD`` (0.5) when only the
answer block is there, 0.0 otherwise: the partial credit gives a small model that never writes
``<think>`` a gradient towards at least delimiting its answer.

Typical use in the RL loop::

    res = score_batch(completions, golds)                 # reward="math_verify", the default
    res.rewards, res.format, res.unparsed

``reward="official_exact"`` scores as the official QeRL code's GSM8K reward does since its change of
2025-11-27 instead (see ``official_exact_batch``): 2.0 for an exact string match of the answer inside
the answer tags, and as format the think and answer tags (weighted 0.2 by the trainer:
TrainConfig.format_reward_weight).
"""

from __future__ import annotations

import collections
import functools
import logging
import re
import threading
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)

# Answers longer than this are cut (keeping the end, where final answers usually are): no
# legitimate final answer in GSM8K/MATH/AIME is anywhere near this long.
MAX_ANSWER_CHARS = 512
# Seconds math-verify may spend on one parse and one comparison (its timer counts whole seconds).
DEFAULT_TIMEOUT_S = 2
PARTIAL_FORMAT_REWARD = 0.5
# Built-in rewards (TrainConfig.reward); evaluation scores a run whose rewards are all built-in with math_verify
# (your own functions score your own evaluation data: qerl.evaluate).
REWARDS = ("math_verify", "official_exact", "upstream")
# The official GSM8K reward (2025-11-27 version): 2.0 for the exact answer inside the answer tags, and
# 0.2 for the think and answer tags (the trainer's default format_reward_weight for official_exact).
OFFICIAL_EXACT_REWARD = 2.0
OFFICIAL_FORMAT_REWARD = 0.2
_THINK_ANSWER_RE = re.compile(r"<think>.+?</think>.*?<answer>.+?</answer>", re.DOTALL)
# reward="upstream": NVlabs/QeRL's soft format check at e8c6e79 (utils/rewards.py line 97, searched with
# re.DOTALL): empty blocks count, and only whitespace may separate them.
UPSTREAM_FORMAT_PATTERN = r"<think>.*?</think>\s*<answer>.*?</answer>"
_UPSTREAM_FORMAT_RE = re.compile(UPSTREAM_FORMAT_PATTERN, re.DOTALL)

# Sources a prediction can come from, in the order they are tried.
SOURCES = ("answer_tag", "boxed", "number", "none")

_ANSWER_OPEN, _ANSWER_CLOSE = "<answer>", "</answer>"
_THINK_OPEN, _THINK_CLOSE = "<think>", "</think>"
# A number: optional sign, digits with optional thousands separators, optional decimals, and an
# optional "/denominator" so 7/2 is one number, not two.
_NUMBER_RE = re.compile(r"-?\d+(?:,\d{3}(?!\d))*(?:\.\d+)?(?:\s*/\s*\d+(?:\.\d+)?)?")
_THOUSANDS_RE = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")
# Math delimiters other than "$" (which doubles as a currency sign).
_LATEX_ENV_RE = re.compile(r"\\\(|\\\[|\\boxed|\\fbox")
# A word: two or more letters not part of a LaTeX command ("\\frac", "\\pi").
_WORD_RE = re.compile(r"(?<![\\a-zA-Z])[a-zA-Z]{2,}")
# \text{...} and friends hold words that belong to the answer ("\\text{Evelyn}", units), and
# \begin{pmatrix} names an environment: neither makes the answer prose.
_TEXT_CMD_RE = re.compile(r"\\(?:text|textbf|mathrm|mbox|operatorname|begin|end)\s*\{[^{}]*\}")
# Inputs that make SymPy evaluate astronomically large numbers: nested powers, big factorials.
_PATHOLOGICAL_RE = re.compile(r"\^\s*\{[^{}]*\^|\^\s*\(?-?\d+\)?\s*\^|\*\*[^*]*\*\*|\d{3,}\s*!|\d{4,}\s*\^\s*\{?\s*\d{3,}")
# Inline math "$...$": the opening "$" is followed and the closing "$" preceded by a non-space, so
# the currency signs in "$18 and $20" do not pair up.
_LATEX_MATH_RE = re.compile(r"\$(?=\S)[^$]*?(?<=\S)\$")


@dataclass
class RewardResult:
    """Per-completion rewards for one batch.

    rewards: accuracy in {0.0, 1.0} (official_exact: {0.0, OFFICIAL_EXACT_REWARD}, the official scale);
    format: format reward in {0.0, 0.5, 1.0};
    unparsed: how many completions gave no prediction math-verify could parse, or one refused as
    pathological outside the main thread (these score 0);
    sources: where each prediction came from (one of SOURCES).
    """

    rewards: list[float]
    format: list[float]
    unparsed: int = 0
    sources: list[str] = field(default_factory=list)


# ---------------------------------------------------------------------------------------------
# extraction


def _last_answer_tag(text: str) -> str | None:
    """Content of the last <answer>...</answer>; an unclosed last <answer> runs to the end."""
    start = text.rfind(_ANSWER_OPEN)
    if start < 0:
        return None
    body = text[start + len(_ANSWER_OPEN):]
    end = body.find(_ANSWER_CLOSE)
    return body if end < 0 else body[:end]


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``), braces matched; None if absent."""
    for cmd in ("\\boxed", "\\fbox"):
        start = text.rfind(cmd)
        if start < 0:
            continue
        i = start + len(cmd)
        while i < len(text) and text[i] == " ":
            i += 1
        if i >= len(text) or text[i] != "{":
            # "\boxed 5" is valid LaTeX: one token follows.
            m = re.match(r"\s*(\S+)", text[start + len(cmd):])
            return m.group(1) if m else None
        depth = 0
        for j in range(i, len(text)):
            if text[j] == "{":
                depth += 1
            elif text[j] == "}":
                depth -= 1
                if depth == 0:
                    return text[i + 1:j]
        return None  # unbalanced braces: nothing trustworthy to extract
    return None


def last_number(text: str) -> str | None:
    """The last number in the text, thousands separators removed; None if there is none."""
    tail = collections.deque(_NUMBER_RE.finditer(text), maxlen=1)
    if not tail:
        return None
    return _THOUSANDS_RE.sub("", tail[0].group(0)).replace(" ", "")


def extract_answer(completion: str, fallback: bool = True) -> tuple[str | None, str]:
    """Find the predicted answer text in a completion.

    Returns (candidate, source) with source one of SOURCES; candidate is None when nothing was
    found. With fallback=False only the answer tags are read.
    """
    if not isinstance(completion, str) or not completion:
        return None, "none"
    tag = _last_answer_tag(completion)
    if tag is not None and tag.strip():
        return tag.strip(), "answer_tag"
    if not fallback:
        return None, "none"
    boxed = last_boxed(completion)
    if boxed is not None and boxed.strip():
        return boxed.strip(), "boxed"
    number = last_number(completion)
    if number is not None:
        return number, "number"
    return None, "none"


# ---------------------------------------------------------------------------------------------
# parsing and verification


def _timeout(timeout_s: int | None) -> int | None:
    """math-verify's timers use signal.alarm, which only works in the main thread."""
    if timeout_s is None or threading.current_thread() is not threading.main_thread():
        return None
    return max(1, int(timeout_s))


def _parse(text: str, timeout_s: int | None):
    # Imported lazily: math-verify pulls in SymPy and ANTLR (about a second of import time).
    from math_verify import parse

    try:
        return parse(text, parsing_timeout=_timeout(timeout_s))
    except Exception:  # noqa: BLE001 - math-verify may raise on odd input; that is "unparsed"
        logger.debug("math-verify parse failed on %r", text[:200], exc_info=True)
        return []


def _prepare_prediction(candidate: str) -> str:
    """Make a candidate answer parseable by math-verify.

    - text with its own math delimiters ("$3, 5$", "\\(x\\)", "\\boxed{7}") is left alone;
    - a remaining "$" is a currency sign ("$18", "$18 and $20") and is dropped;
    - text with words ("18 dollars", "The answer is 42.") goes to the plain-expression parser,
      which takes the last value (LaTeX parsing would read "dollars" as a product of symbols);
    - anything else is bare math ("2\\sqrt{3}", "p - q", "6 - 5i", "1,000", "(1, 2)") and is
      wrapped in "$...$": without delimiters the plain parser would read only one number of it.
    """
    text = candidate.strip()[-MAX_ANSWER_CHARS:]
    # "\$" is LaTeX's escaped dollar (currency), never a math delimiter.
    text = text.replace("\\$", "")
    if _LATEX_ENV_RE.search(text) or _LATEX_MATH_RE.search(text):
        return text
    text = text.replace("$", "").strip()
    if _WORD_RE.search(_TEXT_CMD_RE.sub("", text)):
        return text
    return f"${text}$"


@functools.lru_cache(maxsize=65536)
def _parse_gold(gold: str, timeout_s: int | None):
    """Parse a gold answer (cached: each gold is scored against many samples)."""
    # "\$36" (MATH writes money this way) would not parse inside "$...$".
    text = gold.strip().replace("\\$", "")
    if not (_LATEX_ENV_RE.search(text) or _LATEX_MATH_RE.search(text)):
        text = f"${text}$"
    parsed = tuple(_parse(text, timeout_s))
    if not parsed:  # logged once per gold thanks to the cache
        logger.warning("gold answer %r could not be parsed; comparing as text", gold)
    return parsed


def gold_to_str(value) -> str:
    """A gold answer as a string: 27.0 -> "27", 70 -> "70", strings stripped."""
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value).strip()


def _verify_candidate(candidate: str | None, gold: str, timeout_s: int | None) -> tuple[float, bool]:
    """(reward, parsed) for one candidate answer against one gold answer."""
    if candidate is None:
        return 0.0, False
    from math_verify import verify

    gold_parsed = _parse_gold(gold_to_str(gold), timeout_s)
    prepared = _prepare_prediction(candidate)
    if _timeout(timeout_s) is None and _PATHOLOGICAL_RE.search(prepared):
        # No timer can stop SymPy here (see the module docstring): refuse rather than hang.
        logger.warning("refusing to evaluate %r without a timeout; scoring 0", prepared[:100])
        return 0.0, False
    pred_parsed = _parse(prepared, timeout_s)
    if not pred_parsed:
        return 0.0, False
    if not gold_parsed:
        # An unparseable gold can still match exactly as text.
        return float(candidate.strip() == gold_to_str(gold)), True
    try:
        ok = verify(list(gold_parsed), pred_parsed, timeout_seconds=_timeout(timeout_s))
    except Exception:  # noqa: BLE001 - a comparison that errors is a wrong answer, not a crash
        logger.debug("math-verify verify failed", exc_info=True)
        ok = False
    return float(bool(ok)), True


def accuracy_reward(
    completion: str, gold, fallback: bool = True, timeout_s: int | None = DEFAULT_TIMEOUT_S
) -> float:
    """1.0 if the completion's answer equals the gold answer (math-verify), else 0.0.

    Never raises. ``gold`` may be a string or a number (27.0 and "27" are the same gold).
    """
    try:
        candidate, _ = extract_answer(completion, fallback=fallback)
        return _verify_candidate(candidate, gold, timeout_s)[0]
    except Exception:  # noqa: BLE001 - reward code must not crash the training loop
        logger.warning("accuracy_reward failed; scoring 0", exc_info=True)
        return 0.0


def format_reward(completion: str, partial: float = PARTIAL_FORMAT_REWARD) -> float:
    """1.0 for ``<think>...</think> <answer>...</answer>`` (one of each, in that order, a non-empty
    answer, nothing outside them but whitespace); ``partial`` if only one non-empty
    ``<answer>...</answer>`` block is present; 0.0 otherwise.

    Plain string scans rather than one regex: a tempered regex backtracks quadratically on long
    completions that almost match.
    """
    if not isinstance(completion, str):
        return 0.0
    text = completion.strip()
    if text.count(_ANSWER_OPEN) != 1 or text.count(_ANSWER_CLOSE) != 1:
        return 0.0
    a_open, a_close = text.find(_ANSWER_OPEN), text.find(_ANSWER_CLOSE)
    if a_close < a_open or not text[a_open + len(_ANSWER_OPEN):a_close].strip():
        return 0.0
    full = (
        text.startswith(_THINK_OPEN)
        and text.count(_THINK_OPEN) == 1
        and text.count(_THINK_CLOSE) == 1
        and text.find(_THINK_CLOSE) < a_open
        and not text[text.find(_THINK_CLOSE) + len(_THINK_CLOSE):a_open].strip()
        and text.endswith(_ANSWER_CLOSE)
    )
    return 1.0 if full else float(partial)


def official_answer(completion: str) -> str:
    """The official code's ``extract_xml_answer``: the text after the last ``<answer>``, up to the next
    ``</answer>``, stripped (a completion without the tag is read whole)."""
    return completion.split(_ANSWER_OPEN)[-1].split(_ANSWER_CLOSE)[0].strip()


def official_exact_batch(completions: list[str], golds: list) -> RewardResult:
    """The official QeRL code's GSM8K reward as of its change of 2025-11-27, on qerl's answer-tag prompt.

    That version scores 2.0 when the answer inside the answer tags equals the gold string exactly
    (no math-verify), plus 0.2 when the completion has the think and the answer tags. Before it,
    the official ``qerl.py`` (read in the mirror vukrosic/QeRL-learn) scored 1.0 for an exact match
    after "####" (its GSM8K prompt asked for "#### number") plus 0.2 for a ``<think>.+?</think>``
    block; qerl keeps the paper's answer-tag prompt throughout, and reads the answer as the official
    ``extract_xml_answer`` does.

    rewards: exact match in {0, OFFICIAL_EXACT_REWARD}; format: 1.0 when a non-empty think block is
    followed by a non-empty answer block (the trainer weights it by format_reward_weight, 0.2 by
    default for this reward); unparsed: completions without ``<answer>``.
    """
    if len(completions) != len(golds):
        raise ValueError(f"official_exact_batch needs one gold per completion, got {len(completions)} "
                         f"completions and {len(golds)} golds")
    rewards, formats, unparsed = [], [], 0
    for completion, gold in zip(completions, golds):
        text = completion if isinstance(completion, str) else ""
        unparsed += _ANSWER_OPEN not in text
        rewards.append(OFFICIAL_EXACT_REWARD * float(official_answer(text) == gold_to_str(gold)))
        formats.append(float(_THINK_ANSWER_RE.search(text) is not None))
    return RewardResult(rewards=rewards, format=formats, unparsed=unparsed,
                        sources=["answer_tag" if _ANSWER_OPEN in (c or "") else "none" for c in completions])


def upstream_batch(completions: list[str], golds: list) -> RewardResult:
    """The GSM8K reward NVlabs/QeRL trains with at e8c6e79 (qerl.py lines 43-46: soft_format_reward_func and
    correctness_reward_func of utils/rewards.py, lines 76-81 and 95-100), scored by qerl's own code.

    rewards: 2.0 when the text after the last ``<answer>`` (up to the next ``</answer>``, stripped; the whole
    completion when there is no tag) equals the gold string, else 0; format: 1.0 when
    ``UPSTREAM_FORMAT_PATTERN`` is found anywhere in the completion (weighted 0.2 by the trainer:
    TrainConfig.format_reward_weight); unparsed: completions without ``<answer>``.
    """
    res = official_exact_batch(completions, golds)
    res.format = [float(isinstance(c, str) and _UPSTREAM_FORMAT_RE.search(c) is not None) for c in completions]
    return res


def score_batch(
    completions: list[str],
    golds: list,
    fallback: bool = True,
    timeout_s: int | None = DEFAULT_TIMEOUT_S,
    partial_format: float = PARTIAL_FORMAT_REWARD,
    reward: str = "math_verify",
) -> RewardResult:
    """Accuracy and format rewards for a batch; golds[i] is the gold answer of completions[i].

    ``reward`` is one of REWARDS: "math_verify" (this module's extraction + math-verify, the format
    reward above), "official_exact" (``official_exact_batch``) or "upstream" (``upstream_batch``); the other
    options apply to math_verify only.
    """
    if reward not in REWARDS:
        raise ValueError(f"reward must be one of {REWARDS}, got {reward!r}")
    if reward == "official_exact":
        return official_exact_batch(completions, golds)
    if reward == "upstream":
        return upstream_batch(completions, golds)
    if len(completions) != len(golds):
        raise ValueError(
            f"score_batch needs one gold per completion, got {len(completions)} completions "
            f"and {len(golds)} golds"
        )
    rewards, formats, sources, unparsed = [], [], [], 0
    for completion, gold in zip(completions, golds):
        try:
            candidate, source = extract_answer(completion, fallback=fallback)
            reward, parsed = _verify_candidate(candidate, gold, timeout_s)
        except Exception:  # noqa: BLE001 - see accuracy_reward
            logger.warning("scoring failed; scoring 0", exc_info=True)
            reward, parsed, source = 0.0, False, "none"
        unparsed += not parsed
        rewards.append(reward)
        formats.append(format_reward(completion, partial=partial_format))
        sources.append(source)
    return RewardResult(rewards=rewards, format=formats, unparsed=unparsed, sources=sources)


# ---------------------------------------------------------------------------------------------
# reward functions as plug-ins (TRL's reward_funcs)
#
# A reward function has TRL's signature ``f(prompts, completions, **columns) -> list[float]``:
# ``prompts`` and ``completions`` are lists of strings (a prompt may be a list of chat messages),
# one entry per completion, and every other field of the dataset row comes as a keyword argument
# holding one value per completion (e.g. ``answer=[...]``). A None in the returned list means "does
# not apply" (TRL: NaN, left out of the weighted sum). The built-in names REWARDS expand to two
# logged components, ``accuracy`` (weight w) and ``format`` (weight w * format_reward_weight).

_REF_RE = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")


class RewardError(ValueError):
    """A reward function raised, or returned something other than one number per completion."""


def check_reward_names(names, weights=()) -> None:
    """ValueError unless every name is a built-in (REWARDS) or a ``module:function`` reference, at most
    one built-in is used, and ``weights`` is empty or gives one weight per name."""
    names = tuple(names)
    if not names:
        raise ValueError("reward: give at least one reward function")
    for n in names:
        if not isinstance(n, str) or (n not in REWARDS and not _REF_RE.match(n)):
            raise ValueError(f"reward {n!r}: expected a built-in ({', '.join(REWARDS)}) or a module:function "
                             f"reference (e.g. my_rewards:length_penalty)")
    if sum(n in REWARDS for n in names) > 1:
        raise ValueError(f"reward: at most one built-in answer reward ({', '.join(REWARDS)}), got {names}")
    if weights and len(weights) != len(names):
        raise ValueError(f"reward_weights: {len(weights)} weights for {len(names)} reward functions {names}")


def reward_ref(fn) -> str:
    """A reward function's name as config.json records it: a built-in name, ``module:function`` when
    the function can be imported back, else its bare name."""
    if isinstance(fn, str):
        return fn
    mod, qual = getattr(fn, "__module__", None), getattr(fn, "__qualname__", None) or type(fn).__name__
    return f"{mod}:{qual}" if mod and qual and "<" not in qual and mod != "__main__" else reward_name(fn)


def reward_name(fn) -> str:
    """The name a reward function is logged under (rewards/<name>/mean): TRL's, the function's __name__."""
    if isinstance(fn, str):
        return fn.rsplit(":", 1)[-1].rsplit(".", 1)[-1]
    return getattr(fn, "__name__", None) or type(fn).__name__


def import_reward(ref: str):
    """The callable a ``module:function`` reference names (the module found on sys.path, which holds
    the working directory when run as ``python -m qerl``)."""
    import importlib

    mod_name, _, attr = ref.partition(":")
    try:
        obj = importlib.import_module(mod_name)
    except ImportError as exc:
        raise ValueError(f"reward {ref!r}: cannot import module {mod_name!r} ({exc}); run from the folder that "
                         f"holds it or add that folder to PYTHONPATH") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"reward {ref!r}: module {mod_name!r} has no {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"reward {ref!r}: {attr!r} is not callable")
    return obj


@dataclass
class RewardFunc:
    name: str  # logged as rewards/<name>/mean and /std
    weight: float
    fn: object = None  # the callable; None for a built-in
    builtin: str | None = None  # one of REWARDS


class RewardSet:
    """The run's reward functions and weights; ``__call__`` scores one batch of completions.

    ``names`` are the component columns (built-in: accuracy, format; else each function's name,
    made unique), ``weights`` their weights in the reward the advantages see.
    """

    def __init__(self, funcs, weights=(), format_reward_weight: float = 0.0):
        funcs = list(funcs)
        weights = tuple(weights) or (1.0,) * len(funcs)
        if len(weights) != len(funcs):
            raise ValueError(f"reward_weights: {len(weights)} weights for {len(funcs)} reward functions")
        self.funcs: list[RewardFunc] = []
        for f, w in zip(funcs, weights):
            if isinstance(f, str) and f in REWARDS:
                self.funcs.append(RewardFunc("accuracy", float(w), builtin=f))
            else:
                fn = import_reward(f) if isinstance(f, str) else f
                if not callable(fn):
                    raise ValueError(f"reward_funcs: {fn!r} is not callable")
                self.funcs.append(RewardFunc(reward_name(f), float(w), fn=fn))
        self.format_reward_weight = float(format_reward_weight)
        self.names, self.weights, seen = [], [], set()
        for f in self.funcs:
            for name, w in ([("accuracy", f.weight), ("format", f.weight * self.format_reward_weight)] if f.builtin
                            else [(f.name, f.weight)]):
                unique, k = name, 2
                while unique in seen:
                    unique, k = f"{name}_{k}", k + 1
                seen.add(unique)
                self.names.append(unique)
                self.weights.append(w)

    @classmethod
    def from_config(cls, cfg, reward_funcs=None) -> RewardSet:
        """The reward set of a TrainConfig; ``reward_funcs`` (callables or names) replaces cfg.reward."""
        funcs = list(reward_funcs) if reward_funcs is not None else list(cfg.reward)
        weights = tuple(cfg.reward_weights) if len(cfg.reward_weights) == len(funcs) else ()
        if cfg.reward_weights and not weights:
            raise ValueError(f"reward_weights: {len(cfg.reward_weights)} weights for {len(funcs)} reward functions")
        return cls(funcs, weights, cfg.format_reward_weight)

    @property
    def needs_answer(self) -> bool:
        """Whether a built-in answer reward is in the set (the data must then hold gold answers)."""
        return any(f.builtin for f in self.funcs)

    def refs(self) -> list[str]:
        return [f.builtin or reward_ref(f.fn) for f in self.funcs]

    def __call__(self, prompts: list, completions: list[str], columns: dict[str, list]) -> tuple[list[list[float]], int]:
        """Per-completion component rewards [n][len(names)] (NaN where a function returned None) and
        the number of completions the built-in reward could not parse."""
        import math

        n = len(completions)
        out: list[list[float]] = [[] for _ in range(n)]
        unparsed = 0
        for f in self.funcs:
            if f.builtin:
                res = score_batch(completions, columns.get("answer", [None] * n), reward=f.builtin)
                unparsed += res.unparsed
                for row, a, b in zip(out, res.rewards, res.format):
                    row += [float(a), float(b)]
                continue
            try:
                vals = f.fn(prompts=prompts, completions=completions, **columns)
            except Exception as exc:  # noqa: BLE001 - a user's function: one clear line naming it
                msg = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
                raise RewardError(f"reward function {reward_ref(f.fn)} raised {type(exc).__name__}: {msg}") from exc
            try:
                vals = list(vals)
            except TypeError:
                raise RewardError(f"reward function {reward_ref(f.fn)} returned {type(vals).__name__}, "
                                  f"expected a list of {n} floats") from None
            if len(vals) != n:
                raise RewardError(f"reward function {reward_ref(f.fn)} returned {len(vals)} values for {n} completions")
            for row, v in zip(out, vals):
                try:
                    row.append(math.nan if v is None else float(v))
                except (TypeError, ValueError):
                    raise RewardError(f"reward function {reward_ref(f.fn)} returned {v!r}, not a number") from None
        return out, unparsed
