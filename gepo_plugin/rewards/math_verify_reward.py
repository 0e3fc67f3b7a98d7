"""Math reward: 1 if the last ``\\boxed{...}`` answer is equivalent to the ground truth, else 0 (math-verify).

The paper's reward (GEPO, arXiv 2508.17850: "math-verify on \\boxed{} answers") as a verl custom
reward function::

    reward.custom_reward_function.path=pkg://gepo_plugin.rewards.math_verify_reward
    reward.custom_reward_function.name=compute_score

With verl 0.9.1's V1 trainer and no colocated reward model (``reward.reward_model.enable=false``,
the default), this function runs in verl's streaming reward loop: each agent-loop worker sends a
finished trajectory to a ``RewardLoopWorker`` actor as soon as it is generated, so the score is
attached to the rollout before it enters the replay buffer (the HeteroRL paper's "localized reward
computation"); the learner never gathers responses to score them.

What counts as the answer: the LAST ``\\boxed{...}`` (or ``\\fbox{...}``) of the response, found by
:func:`gepo_plugin.rewards.boxed.last_boxed`, the same function that extracts ground truths from reference
solutions in ``examples/data/prepare_math.py`` (nested braces handled; an unclosed last box, i.e. a
truncated response, counts as "no answer"). Ground truth may be a bare answer, a solution containing a box,
or a list of accepted answers.

Equivalence is decided by ``math_verify.verify`` (``\\frac{1}{2}`` = ``0.5`` = ``1/2``; ``x^2+1`` = ``1+x^2``;
``x=3`` = ``3``; ``\\{1,2\\}`` = ``\\{2,1\\}``; ``(0,1]`` != ``[0,1)``; units such as ``5\\text{ cm}`` and
degrees ``90^\\circ`` are dropped), with a normalised string comparison first (for answers math-verify cannot
parse, e.g. a word). Two additions, decided here rather than left to math-verify:

* Percentages. An answer ending in a percent sign (``50\\%``, ``50%``, ``50\\text{ percent}``) equals both its
  number (``50``: the sign is a unit on the answer, as competition graders accept ``50`` for ``50\\%``) and
  that number divided by 100 (``0.5``, ``\\frac{1}{2}``); this holds whichever side, prediction or ground
  truth, carries the sign, and ``50\\%`` = ``50\\%``. Without a sign on either side nothing is scaled
  (``50`` != ``0.5``). math-verify alone is inconsistent here (in 0.9.0 ``\\boxed{50\\%}`` does not parse at
  all, and ``50%`` equals ``50`` but not ``0.5``), hence the explicit rule.
* Scientific notation typed as ``1.2e3`` / ``2E-3`` (a whole answer of that form) means ``1.2\\times10^{3}``;
  math-verify would read the ``e`` as Euler's number.

Boxed answers longer than ``MAX_ANSWER_CHARS`` characters (degenerate outputs) are compared as normalised
strings only, so they cannot spend the time limit.

Time limit (``timeout_s``, default 5 s, fractions allowed; set it with
``+reward.custom_reward_function.reward_kwargs.timeout_s=10``; None or 0: no limit) bounds the check of the
answer against each accepted ground truth, parsing included. A check that runs out of time scores 0 AND sets
the ``verify_timeout`` key to 1.0, so verl's reward metrics show the rate of unverifiable answers next to
the accuracy, and the first such check in a process logs a WARNING naming the option above. The limit is a
``SIGALRM`` timer, which only works in a process's main thread (math-verify's own timeouts use ``signal.alarm``
too, and are switched off here because they cannot be nested with ours and only take whole seconds). verl's
reward managers may call a synchronous reward function from a thread pool, so off the main thread the check
runs in a small process pool (as verl's own ``verl.utils.reward_score.math_verify`` does), each worker
timing its checks in its own main thread; a result that does not come back in ``4 * timeout_s + 5`` seconds
also counts as a timeout.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import re
import signal
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures import TimeoutError as FuturesTimeoutError
from typing import Any, NamedTuple, TypeVar

from gepo_plugin.rewards.boxed import BOX_COMMANDS, last_boxed

INSTALL_HINT = 'pip install "math-verify>=0.9"  (or: pip install "gepo-plugin[math]")'

try:
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify
except ImportError as error:  # pragma: no cover - exercised only where math-verify is missing
    raise ImportError(
        f"gepo_plugin.rewards.math_verify_reward needs the math-verify package, which is not installed: {INSTALL_HINT}"
    ) from error

__all__ = ["BOX_COMMANDS", "Verdict", "check_answer", "compute_score", "is_equivalent", "last_boxed"]

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 5.0
TIMEOUT_OPTION = "+reward.custom_reward_function.reward_kwargs.timeout_s"
# Longer boxed answers are compared as strings only (real answers are far shorter; parsing a long one is slow).
MAX_ANSWER_CHARS = 1000
# Process pool for checks requested off the main thread (signal-based timeouts need a main thread).
POOL_WORKERS = int(os.environ.get("GEPO_MATH_VERIFY_WORKERS", "4"))
# After the deadline the timer fires again at this interval until the check stops, in case some library
# code swallowed the first interruption with a bare ``except:``.
_REFIRE_S = 0.1
_EXTRACTION = (LatexExtractionConfig(), ExprExtractionConfig())

_pool: ProcessPoolExecutor | None = None
_pool_lock = threading.Lock()
_timeout_warned = False
_warn_lock = threading.Lock()

T = TypeVar("T")


class Verdict(NamedTuple):
    """Outcome of one check: ``correct``, and whether the check ran out of time before it could say so."""

    correct: bool
    timed_out: bool = False


class CheckTimeout(BaseException):
    """Raised by the deadline timer inside a check.

    A BaseException, like math-verify's own TimeoutException, so that the ``except Exception`` blocks of
    math-verify and sympy (which turn parse errors into "no match") do not swallow it.
    """


class _QuietDisabledTimeoutWarning(logging.Filter):
    """Drops math-verify's one-off "Timeout is disabled ... provide the logic yourself" warning: we do."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Timeout is disabled")


for _name in ("math_verify.parser", "math_verify.grader"):
    logging.getLogger(_name).addFilter(_QuietDisabledTimeoutWarning())


# ---------------------------------------------------------------- normalisation and percent handling

_PERCENT_SUFFIX = re.compile(
    r"^(?P<body>.*?\S)\s*(?:\\[,;:! ]\s*)*"
    r"(?:\\%|%|\\(?:text|mathrm)\{\s*(?:\\%|%|percent)\s*\}|percent)\s*\.?$",
    re.DOTALL,
)
_SCIENTIFIC = re.compile(r"^([+-]?(?:\d+(?:\.\d*)?|\.\d+))[eE]([+-]?\d+)$")


def _normalise(answer: str) -> str:
    """A canonical string form, for answers math-verify cannot parse (words, letters) and as a fast path."""
    answer = answer.strip().strip("$").strip()
    answer = answer.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    for token in ("\\left", "\\right", "\\displaystyle", "\\!", "\\,", "\\;", "\\ "):
        answer = answer.replace(token, "")
    answer = re.sub(r"\\text\{([^{}]*)\}", r"\1", answer)  # (no lazy quantifier: linear on long inputs)
    answer = re.sub(r"\s+", "", answer)
    return answer.rstrip(".").lower()


def _split_percent(answer: str) -> tuple[str, bool]:
    """``("50", True)`` for ``50\\%`` / ``50%`` / ``50\\text{ percent}``; ``(answer, False)`` without a sign."""
    match = _PERCENT_SUFFIX.match(answer.strip())
    if match is None:
        return answer, False
    return match.group("body"), True


def _expand_scientific(answer: str) -> str:
    """``1.2e3`` -> ``1.2\\times10^{3}`` (only when the whole answer is such a number)."""
    return _SCIENTIFIC.sub(r"\1\\times10^{\2}", answer.strip())


def _candidate_pairs(prediction: str, gold: str) -> list[tuple[str, str]]:
    """(prediction, gold) forms to compare, implementing the percent rule of the module docstring."""
    prediction, prediction_percent = _split_percent(prediction)
    gold, gold_percent = _split_percent(gold)
    prediction, gold = _expand_scientific(prediction), _expand_scientific(gold)
    if prediction_percent and not gold_percent:
        return [(prediction, gold), (f"\\frac{{{prediction}}}{{100}}", gold)]
    if gold_percent and not prediction_percent:
        return [(prediction, gold), (prediction, f"\\frac{{{gold}}}{{100}}")]
    return [(prediction, gold)]


# ---------------------------------------------------------------- the check


def _parse_boxed(answer: str) -> list:
    """math-verify's parse of a bare answer (wrapped in a box so its boxed-answer normalisation applies)."""
    return parse(f"\\boxed{{{answer}}}", extraction_config=_EXTRACTION, parsing_timeout=None)


def _same(prediction: str, gold: str) -> bool:
    """One comparison: normalised strings first, then math-verify."""
    if _normalise(prediction) == _normalise(gold):
        return True
    gold_parsed = _parse_boxed(gold)
    prediction_parsed = _parse_boxed(prediction) if gold_parsed else []
    if not gold_parsed or not prediction_parsed:
        return False
    return bool(verify(gold_parsed, prediction_parsed, timeout_seconds=None))


def _check(prediction: str, gold: str) -> bool:
    """Equivalence of two bare answers (no ``\\boxed``), untimed; errors count as "not equivalent"."""
    if len(prediction) > MAX_ANSWER_CHARS:
        return _normalise(prediction) == _normalise(gold)
    try:
        return any(_same(p, g) for p, g in _candidate_pairs(prediction, gold))
    except Exception:  # math-verify turns most errors into "no match" itself; anything else is one too
        logger.debug("math-verify failed on %.200r vs %.200r", prediction, gold, exc_info=True)
        return False


def _run_with_deadline(function: Callable[[], T], seconds: float) -> tuple[T | None, bool]:
    """``(function(), False)``, or ``(None, True)`` when it did not finish in ``seconds`` (main thread only)."""
    armed = True

    def on_alarm(signum: int, frame: Any) -> None:
        if armed:
            raise CheckTimeout

    previous = signal.signal(signal.SIGALRM, on_alarm)
    started = time.monotonic()
    other_delay, other_interval = 0.0, 0.0
    try:
        other_delay, other_interval = signal.setitimer(signal.ITIMER_REAL, seconds, _REFIRE_S)
        try:
            return function(), False
        finally:
            armed = False
    except CheckTimeout:
        return None, True
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        # put back whatever used SIGALRM before (a handler installed outside Python reads as None: default then)
        signal.signal(signal.SIGALRM, signal.SIG_DFL if previous is None else previous)
        if other_delay > 0:
            remaining = max(other_delay - (time.monotonic() - started), 0.001)
            signal.setitimer(signal.ITIMER_REAL, remaining, other_interval)


def _check_timed(prediction: str, gold: str, timeout_s: float | None) -> Verdict:
    """:func:`_check` under a deadline when ``timeout_s`` is set (call it on a main thread)."""
    if not timeout_s:
        return Verdict(_check(prediction, gold))
    correct, timed_out = _run_with_deadline(lambda: _check(prediction, gold), timeout_s)
    return Verdict(bool(correct), timed_out)


def _check_in_worker(prediction: str, gold: str, timeout_s: float | None) -> tuple[bool, bool]:
    """Runs in a pool process's main thread, where the signal timer works."""
    return tuple(_check_timed(prediction, gold, timeout_s))


def _get_pool() -> ProcessPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ProcessPoolExecutor(max_workers=POOL_WORKERS, mp_context=multiprocessing.get_context("spawn"))
        return _pool


def _reset_pool() -> None:
    global _pool
    with _pool_lock:
        pool, _pool = _pool, None
    if pool is not None:
        pool.shutdown(wait=False, cancel_futures=True)


def check_answer(prediction: str, gold: str, timeout_s: float | None = DEFAULT_TIMEOUT_S) -> Verdict:
    """Is ``prediction`` mathematically equal to ``gold`` (both bare answers, e.g. the content of a box)?

    ``timeout_s`` bounds the whole check (None or 0: no limit); a check that runs out of time is
    ``Verdict(correct=False, timed_out=True)``. On the main thread the check runs here; on any other
    thread it runs in a process pool (see the module docstring).
    """
    limit = float(timeout_s) if timeout_s else None
    if limit is None or threading.current_thread() is threading.main_thread():
        return _check_timed(prediction, gold, limit)
    # Import by package name so the pool can pickle the function even when verl loaded this file by path (here, not
    # at the top: this module importing itself).
    from gepo_plugin.rewards import math_verify_reward as module

    future = None
    try:
        future = _get_pool().submit(module._check_in_worker, prediction, gold, limit)
        return Verdict(*future.result(timeout=4 * limit + 5))
    except FuturesTimeoutError:
        future.cancel()
        return Verdict(False, timed_out=True)
    except Exception as error:  # a broken pool must not turn every reward into 0: check here, untimed
        _reset_pool()
        logger.warning("math-verify process pool failed (%r); checking in this thread without a timeout", error)
        return Verdict(_check(prediction, gold))


def is_equivalent(prediction: str, gold: str, timeout_s: float | None = DEFAULT_TIMEOUT_S) -> bool:
    """:func:`check_answer` as a bool (a check that ran out of time is False)."""
    return check_answer(prediction, gold, timeout_s).correct


def _warn_timeout_once(timeout_s: float | None) -> None:
    """The first timed-out check of a process says so, and how to raise the limit; later ones only count."""
    global _timeout_warned
    with _warn_lock:
        if _timeout_warned:
            return
        _timeout_warned = True
    logger.warning(
        "math-verify could not finish checking an answer within timeout_s=%s s: the response scored 0 and is "
        "counted in the reward metric 'verify_timeout' (this warning is shown once per process). "
        "Raise the limit with %s=<seconds>.",
        timeout_s,
        TIMEOUT_OPTION,
    )


def _gold_answers(ground_truth: Any) -> list[str]:
    """Ground truth as a list of accepted answers (a string, a number, or a list/array of them)."""
    if ground_truth is None:
        return []
    if isinstance(ground_truth, str) or not isinstance(ground_truth, Iterable):
        items = [ground_truth]
    else:
        items = list(ground_truth)
    answers = []
    for item in items:
        text = str(item).strip()
        if any(command in text for command in BOX_COMMANDS):
            text = last_boxed(text) or text
        if text:
            answers.append(text)
    return answers


def compute_score(
    data_source: str | None,
    solution_str: str | None,
    ground_truth: Any,
    extra_info: dict | None = None,
    timeout_s: float | None = DEFAULT_TIMEOUT_S,
    **kwargs: Any,
) -> dict[str, float]:
    """verl custom reward function: score of one response.

    Returns floats (verl averages every key into its reward metrics)::

        score, acc      1.0 if the last complete box of the response equals an accepted answer, else 0.0
        has_boxed       1.0 if the response has a complete box at all
        verify_timeout  1.0 if the score is 0 because a check ran out of time (the answer could not be verified,
                        which is not the same as a wrong answer), else 0.0

    ``ground_truth`` may be a bare answer, a solution containing ``\\boxed{...}``, or a list of accepted
    answers. ``timeout_s`` (``+reward.custom_reward_function.reward_kwargs.timeout_s=10``) bounds each check.
    """
    answer = last_boxed(solution_str) if isinstance(solution_str, str) else None
    correct = timed_out = False
    if answer is not None:
        for gold in _gold_answers(ground_truth):
            verdict = check_answer(answer, gold, timeout_s)
            if verdict.correct:
                correct = True
                break
            timed_out = timed_out or verdict.timed_out
    timed_out = timed_out and not correct
    if timed_out:
        _warn_timeout_once(timeout_s)
    score = 1.0 if correct else 0.0
    return {
        "score": score,
        "acc": score,
        "has_boxed": 0.0 if answer is None else 1.0,
        "verify_timeout": 1.0 if timed_out else 0.0,
    }
