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

Only the LAST ``\\boxed{...}`` (or ``\\fbox{...}``) of the response counts; nested braces are handled
and an unclosed last box (a truncated response) counts as "no answer". Equivalence is decided by
``math_verify.verify`` (``\\frac{1}{2}`` = ``0.5`` = ``1/2``; ``x^2+1`` = ``1+x^2``), with a
normalised string comparison as a fall-back for answers math-verify cannot parse (e.g. a letter).

Timeouts: math-verify bounds parsing and comparison with ``signal.alarm``, which only works in a
process's main thread. verl's reward managers call a synchronous reward function from a thread
pool, so off the main thread the check runs in a small process pool (as verl's own
``verl.utils.reward_score.math_verify`` does), and a check that exceeds its time limit scores 0.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import re
import threading
from collections.abc import Iterable
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures import TimeoutError as FuturesTimeoutError
from typing import Any

INSTALL_HINT = 'pip install "math-verify>=0.9"  (or: pip install "gepo-plugin[math]")'

try:
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify
except ImportError as error:  # pragma: no cover - exercised only where math-verify is missing
    raise ImportError(
        f"gepo_plugin.rewards.math_verify_reward needs the math-verify package, which is not installed: {INSTALL_HINT}"
    ) from error

__all__ = ["compute_score", "is_equivalent", "last_boxed"]

logger = logging.getLogger(__name__)

BOX_COMMANDS = ("\\boxed", "\\fbox")
DEFAULT_TIMEOUT_S = 5
# Process pool for checks requested off the main thread (signal-based timeouts need a main thread).
POOL_WORKERS = int(os.environ.get("GEPO_MATH_VERIFY_WORKERS", "4"))

_pool: ProcessPoolExecutor | None = None
_pool_lock = threading.Lock()


def last_boxed(text: str | None) -> str | None:
    """Content of the last ``\\boxed{...}`` / ``\\fbox{...}`` in ``text`` (nested braces kept), or None.

    None when there is no box or when the last one is never closed (a truncated answer). ``\\{`` and
    ``\\}`` inside the box are literal braces and do not count for nesting. ``\\boxed 5`` (a box without
    braces) gives ``"5"``.
    """
    if not text:
        return None
    start, command = max((text.rfind(name), name) for name in BOX_COMMANDS)
    if start < 0:
        return None
    position = start + len(command)
    rest = text[position:]
    if rest[:1].isalpha():
        # e.g. "\boxedfoo": another command that only starts like \boxed; look further left
        return last_boxed(text[:start])
    stripped = rest.lstrip()
    if not stripped.startswith("{"):
        match = re.match(r"\s+([^\s$]+)", rest)
        return match.group(1) if match else None
    position += len(rest) - len(stripped) + 1
    depth, begin, index = 1, position, position
    while index < len(text):
        char = text[index]
        if char == "\\":
            index += 2
            continue
        if char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                return text[begin:index].strip()
        index += 1
    return None


def _normalise(answer: str) -> str:
    answer = answer.strip().strip("$").strip()
    answer = answer.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    for token in ("\\left", "\\right", "\\displaystyle", "\\!", "\\,", "\\;", "\\ "):
        answer = answer.replace(token, "")
    answer = re.sub(r"\\text\{\s*([^{}]*?)\s*\}", r"\1", answer)
    answer = re.sub(r"\s+", "", answer)
    return answer.rstrip(".").lower()


def _parse_boxed(answer: str, timeout_s: int | None):
    return parse(
        f"\\boxed{{{answer}}}",
        extraction_config=[LatexExtractionConfig(), ExprExtractionConfig()],
        parsing_timeout=timeout_s,
    )


def _check(prediction: str, gold: str, timeout_s: int | None) -> bool:
    """math-verify equivalence of two bare answers (no ``\\boxed``), string match as fall-back."""
    if _normalise(prediction) == _normalise(gold):
        return True
    gold_parsed = _parse_boxed(gold, timeout_s)
    prediction_parsed = _parse_boxed(prediction, timeout_s)
    if not gold_parsed or not prediction_parsed:
        return False
    return bool(verify(gold_parsed, prediction_parsed, timeout_seconds=timeout_s))


def _check_in_worker(prediction: str, gold: str, timeout_s: int | None) -> bool:
    """Runs in a pool process's main thread, where math-verify's signal timeouts work."""
    try:
        return _check(prediction, gold, timeout_s)
    except Exception:
        return False


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


def is_equivalent(prediction: str, gold: str, timeout_s: float | None = DEFAULT_TIMEOUT_S) -> bool:
    """Is ``prediction`` mathematically equal to ``gold`` (both bare answers, e.g. the content of a box)?

    ``timeout_s``: limit for each parse/compare step (None or 0: no limit). On the main thread the
    check runs here with math-verify's own timeouts; on any other thread it runs in a process pool
    and a check that does not finish in time is False.
    """
    limit = int(max(1, round(timeout_s))) if timeout_s else None
    if limit is None:
        try:
            return _check(prediction, gold, None)
        except Exception:
            return False
    if threading.current_thread() is threading.main_thread():
        try:
            return _check(prediction, gold, limit)
        except Exception:
            return False
    # Import by package name so the pool can pickle the function even when verl loaded this file by path.
    from gepo_plugin.rewards import math_verify_reward as module

    try:
        future = _get_pool().submit(module._check_in_worker, prediction, gold, limit)
        return bool(future.result(timeout=4 * limit + 5))
    except FuturesTimeoutError:
        future.cancel()
        return False
    except Exception as error:  # a broken pool must not turn every reward into 0: check here, untimed
        _reset_pool()
        logger.warning("math-verify process pool failed (%r); checking in this thread without a timeout", error)
        try:
            return _check(prediction, gold, None)
        except Exception:
            return False


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
        if "\\boxed" in text or "\\fbox" in text:
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

    Returns ``{"score": 1.0 or 0.0, "acc": same, "has_boxed": 1.0 if a complete \\boxed{} answer was found}``
    (floats, so verl can average every key into its reward metrics). ``ground_truth`` may be a bare
    answer, a solution containing ``\\boxed{...}``, or a list of accepted answers. ``timeout_s`` (pass it
    with ``+reward.custom_reward_function.reward_kwargs.timeout_s=10``) bounds each math-verify step.
    """
    answer = last_boxed(solution_str)
    correct = answer is not None and any(is_equivalent(answer, gold, timeout_s) for gold in _gold_answers(ground_truth))
    score = 1.0 if correct else 0.0
    return {"score": score, "acc": score, "has_boxed": 0.0 if answer is None else 1.0}
