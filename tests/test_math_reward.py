"""The math-verify reward (gepo_plugin.rewards.math_verify_reward) on realistic responses, with the real math-verify.

Every case goes through ``compute_score``, verl's entry point, and asserts the whole result dict. The slow paths
(the time limit, the process pool off the main thread) use inputs that genuinely take long to parse; nothing of
math-verify is mocked. Also here: ground truth extraction by ``examples/data/prepare_math.py`` and the reward
parse boxes with one function, so they agree.
"""

from __future__ import annotations

import importlib.util
import logging
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import ModuleType

import pytest

pytest.importorskip("math_verify")

from gepo_plugin.rewards import boxed
from gepo_plugin.rewards import math_verify_reward as reward

ROOT = Path(__file__).resolve().parents[1]
PREPARE_MATH = ROOT / "examples/data/prepare_math.py"
# parsing {{{...{4}...}}} with math-verify's LaTeX grammar takes seconds already at this depth: a genuinely slow input
SLOW_ANSWER = "\\boxed{" + "{" * 14 + "4" + "}" * 14 + "}"
TINY_TIMEOUT_S = 0.2


def score(response: str | None, truth, **kwargs) -> dict[str, float]:
    return reward.compute_score("math", response, truth, extra_info={"split": "test", "index": 0}, **kwargs)


def expected(value: float, boxed_answer: float = 1.0, timed_out: float = 0.0) -> dict[str, float]:
    return {"score": value, "acc": value, "has_boxed": boxed_answer, "verify_timeout": timed_out}


# (response, ground truth, score, has_boxed)
CASES = {
    # fractions and equivalent forms
    "frac = decimal": ("so the answer is $\\boxed{\\frac{1}{2}}$.", "0.5", 1.0, 1.0),
    "decimal = frac": ("\\boxed{0.5}", "\\frac{1}{2}", 1.0, 1.0),
    "slash = frac": ("\\boxed{1/2}", "\\frac{1}{2}", 1.0, 1.0),
    "dfrac = decimal": ("\\boxed{\\dfrac{1}{2}}", "0.5", 1.0, 1.0),
    "frac12 shorthand": ("\\boxed{\\frac12}", "0.5", 1.0, 1.0),
    "unreduced frac": ("\\boxed{\\frac{2}{6}}", "\\frac{1}{3}", 1.0, 1.0),
    "rationalised root": ("\\boxed{\\dfrac{\\sqrt{2}}{2}}", "\\frac{1}{\\sqrt{2}}", 1.0, 1.0),
    "simplified root": ("\\boxed{\\sqrt{8}}", "2\\sqrt{2}", 1.0, 1.0),
    "rounded decimal is not the frac": ("\\boxed{0.67}", "\\frac{2}{3}", 0.0, 1.0),
    "pi is not 3.14": ("\\boxed{3.14}", "\\pi", 0.0, 1.0),
    "commuted polynomial": ("\\boxed{1 + x^2}", "x^2+1", 1.0, 1.0),
    "wrong integer": ("\\boxed{5}", "4", 0.0, 1.0),
    # LaTeX formatting
    "left right": ("\\boxed{\\left( 1, 2 \\right)}", "(1,2)", 1.0, 1.0),
    "thin space thousands": ("\\boxed{1\\,000}", "1000", 1.0, 1.0),
    "comma thousands": ("\\boxed{1,000}", "1000", 1.0, 1.0),
    "text number": ("\\boxed{\\text{5}}", "5", 1.0, 1.0),
    "displaystyle": ("\\boxed{\\displaystyle \\frac{3}{4}}", "0.75", 1.0, 1.0),
    "word answer": ("\\boxed{\\text{Monday}}", "Monday", 1.0, 1.0),
    "other word": ("\\boxed{\\text{Monday}}", "Tuesday", 0.0, 1.0),
    "dollar sign": ("\\boxed{\\$5}", "5", 1.0, 1.0),
    # units
    "unit cm": ("\\boxed{5\\text{ cm}}", "5", 1.0, 1.0),
    "unit with wrong number": ("\\boxed{5\\text{ cm}}", "6", 0.0, 1.0),
    "degrees in answer": ("\\boxed{90^\\circ}", "90", 1.0, 1.0),
    "degrees in truth": ("\\boxed{90}", "90^{\\circ}", 1.0, 1.0),
    # percent: the sign is a unit (50% = 50) and a scale (50% = 0.5), whichever side carries it
    "percent answer, plain truth": ("\\boxed{50\\%}", "50", 1.0, 1.0),
    "plain answer, percent truth": ("\\boxed{50}", "50\\%", 1.0, 1.0),
    "fraction answer, percent truth": ("\\boxed{0.5}", "50\\%", 1.0, 1.0),
    "percent answer, fraction truth": ("\\boxed{50\\%}", "0.5", 1.0, 1.0),
    "bare % sign": ("\\boxed{50%}", "\\frac{1}{2}", 1.0, 1.0),
    "decimal percent": ("\\boxed{12.5\\%}", "0.125", 1.0, 1.0),
    "percent in words": ("\\boxed{50\\text{ percent}}", "50\\%", 1.0, 1.0),
    "percent on both sides": ("\\boxed{50\\%}", "50\\%", 1.0, 1.0),
    "different percents": ("\\boxed{5\\%}", "50\\%", 0.0, 1.0),
    "no sign, no scaling": ("\\boxed{50}", "0.5", 0.0, 1.0),
    "scaled the wrong way": ("\\boxed{0.5\\%}", "50", 0.0, 1.0),
    # sets, intervals, tuples
    "set order": ("\\boxed{\\{1,2\\}}", "\\{2,1\\}", 1.0, 1.0),
    "escaped braces are not nesting": ("\\boxed{\\{1, 2\\}}", "\\{1,2\\}", 1.0, 1.0),
    "subset": ("\\boxed{\\{1,2\\}}", "\\{1,2,3\\}", 0.0, 1.0),
    "interval ends differ": ("\\boxed{(0,1]}", "[0,1)", 0.0, 1.0),
    "same interval": ("\\boxed{\\left[ 0, 1 \\right)}", "[0,1)", 1.0, 1.0),
    "infinite interval": ("\\boxed{(-\\infty, 2]}", "(-\\infty,2]", 1.0, 1.0),
    "tuple": ("\\boxed{(1,2,3)}", "(1, 2, 3)", 1.0, 1.0),
    "tuple order": ("\\boxed{(3,2,1)}", "(1,2,3)", 0.0, 1.0),
    "pair order": ("\\boxed{(1,2)}", "(2,1)", 0.0, 1.0),
    # which box counts
    "last of several boxes": ("first \\boxed{3}, finally \\boxed{5}", "5", 1.0, 1.0),
    "earlier box does not count": ("first \\boxed{5}, finally \\boxed{3}", "5", 0.0, 1.0),
    "no box": ("the answer is 4", "4", 0.0, 0.0),
    "unclosed last box": ("\\boxed{3}, no wait: \\boxed{\\frac{1}{", "3", 0.0, 0.0),
    "fbox": ("\\fbox{7}", "7", 1.0, 1.0),
    "brace-less box": ("so \\boxed 9", "9", 1.0, 1.0),
    "box inside a box": ("\\boxed{\\boxed{4}}", "4", 1.0, 1.0),
    # malformed LaTeX: never raises, scores 0
    "empty sqrt": ("\\boxed{\\sqrt{}}", "1", 0.0, 1.0),
    "broken frac": ("\\boxed{\\frac{\\frac{}}}", "0", 0.0, 1.0),
    "mismatched environment": ("\\boxed{\\begin{pmatrix} 1 \\end{bmatrix}}", "1", 0.0, 1.0),
    "operator soup": ("\\boxed{1 +* 2}", "3", 0.0, 1.0),
    "only carets": ("\\boxed{^^}", "1", 0.0, 1.0),
    "empty box": ("\\boxed{}", "0", 0.0, 1.0),
    # signs and scientific notation
    "negative": ("\\boxed{-3}", "-3", 1.0, 1.0),
    "sign matters": ("\\boxed{-3}", "3", 0.0, 1.0),
    "negative fraction": ("\\boxed{-\\frac{1}{2}}", "-0.5", 1.0, 1.0),
    "times ten": ("\\boxed{1.2\\times 10^{3}}", "1200", 1.0, 1.0),
    "times ten, wrong power": ("\\boxed{1.2\\times10^{3}}", "120", 0.0, 1.0),
    "e notation": ("\\boxed{1.2e3}", "1200", 1.0, 1.0),
    "negative exponent": ("\\boxed{2E-3}", "0.002", 1.0, 1.0),
    # equations
    "equation vs value": ("\\boxed{x=3}", "3", 1.0, 1.0),
    "value vs equation": ("\\boxed{3}", "x=3", 1.0, 1.0),
    "wrong equation": ("\\boxed{x = 4}", "x=3", 0.0, 1.0),
    # multiple choice
    "letter": ("\\boxed{B}", "B", 1.0, 1.0),
    "letter in text with parentheses": ("\\boxed{\\text{(B)}}", "B", 1.0, 1.0),
    "bold letter": ("\\boxed{\\textbf{(C)}}", "C", 1.0, 1.0),
    "other letter": ("\\boxed{C}", "B", 0.0, 1.0),
    # forms of the ground truth
    "truth is a boxed solution": ("\\boxed{5}", "Hence \\boxed{5}.", 1.0, 1.0),
    "several accepted answers": ("\\boxed{5}", ["4", "5"], 1.0, 1.0),
    "numeric truth": ("\\boxed{5}", 5, 1.0, 1.0),
    "no truth": ("\\boxed{5}", None, 0.0, 1.0),
    # pathological inputs
    "empty response": ("", "4", 0.0, 0.0),
    "None response": (None, "4", 0.0, 0.0),
    "100 kB of reasoning, then the box": ("x" * 100_000 + " \\boxed{4}", "4", 1.0, 1.0),
    "100 kB inside the box": ("\\boxed{" + "1+" * 50_000 + "1}", "50001", 0.0, 1.0),
    "deeply nested braces, over the length cap": ("\\boxed{" + "{" * 5_000 + "4" + "}" * 5_000 + "}", "4", 0.0, 1.0),
    "deeply unbalanced braces": ("\\boxed{" + "{" * 5_000, "4", 0.0, 0.0),
}


@pytest.mark.parametrize(("response", "truth", "value", "boxed_answer"), CASES.values(), ids=CASES.keys())
def test_compute_score(response, truth, value, boxed_answer):
    assert score(response, truth) == expected(value, boxed_answer)


def test_a_deeply_nested_answer_is_bounded_by_the_time_limit():
    """Malformed enough to be slow: the call returns (no exception, no hang) with a score of 0, flagged."""
    response = "\\boxed{" + "{" * 200 + "4" + "}" * 200 + "}"
    start = time.monotonic()
    result = score(response, "4", timeout_s=TINY_TIMEOUT_S)
    assert time.monotonic() - start < 5 * TINY_TIMEOUT_S + 1
    assert result == expected(0.0, timed_out=1.0)


def test_a_timeout_is_counted_warned_once_and_told_apart_from_a_wrong_answer(monkeypatch, caplog):
    monkeypatch.setattr(reward, "_timeout_warned", False)
    handler, timer = signal.getsignal(signal.SIGALRM), signal.getitimer(signal.ITIMER_REAL)
    with caplog.at_level(logging.WARNING, logger=reward.__name__):
        first = score(SLOW_ANSWER, "4", timeout_s=TINY_TIMEOUT_S)
        second = score(SLOW_ANSWER, "5", timeout_s=TINY_TIMEOUT_S)
        wrong = score("\\boxed{5}", "4", timeout_s=TINY_TIMEOUT_S)
    assert first == second == expected(0.0, timed_out=1.0)
    assert wrong == expected(0.0)  # a wrong answer is not a timeout
    warnings = [record for record in caplog.records if record.name == reward.__name__]
    assert len(warnings) == 1, [record.getMessage() for record in warnings]
    message = warnings[0].getMessage()
    assert "timeout_s=0.2" in message and "+reward.custom_reward_function.reward_kwargs.timeout_s=" in message
    assert "verify_timeout" in message
    # the deadline timer is gone and the previous SIGALRM handler is back
    assert signal.getsignal(signal.SIGALRM) is handler and signal.getitimer(signal.ITIMER_REAL) == timer


def test_the_deadline_timer_leaves_the_callers_own_alarm_in_place():
    calls: list[int] = []

    def callers_handler(signum, frame) -> None:
        calls.append(signum)

    previous = signal.signal(signal.SIGALRM, callers_handler)
    try:
        signal.setitimer(signal.ITIMER_REAL, 30.0)
        assert score(SLOW_ANSWER, "4", timeout_s=TINY_TIMEOUT_S)["verify_timeout"] == 1.0
        assert signal.getsignal(signal.SIGALRM) is callers_handler
        delay, _ = signal.getitimer(signal.ITIMER_REAL)
        assert 20.0 < delay < 30.0  # still pending, less the time the check took
        assert calls == []  # the check's own alarm did not reach the caller's handler
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def test_check_answer_and_is_equivalent():
    assert reward.check_answer("\\frac{1}{2}", "50\\%") == reward.Verdict(correct=True, timed_out=False)
    assert reward.check_answer("2", "3", timeout_s=None) == reward.Verdict(correct=False, timed_out=False)
    assert reward.check_answer(SLOW_ANSWER[7:-1], "4", timeout_s=TINY_TIMEOUT_S) == reward.Verdict(False, True)
    assert reward.is_equivalent("0.5", "\\frac{1}{2}") and not reward.is_equivalent("0.5", "2")


def test_off_the_main_thread_checks_run_in_a_process_pool_with_the_same_limit():
    # verl's reward managers may call a synchronous reward function from a thread pool, where signal timers
    # cannot run: the check then goes through a process pool whose workers time it in their main thread
    results: list[dict[str, float]] = []

    def run() -> None:
        results.append(score("\\boxed{\\frac{1}{2}}", "0.5"))
        results.append(score("\\boxed{2}", "0.5"))
        results.append(score("\\boxed{50\\%}", "0.5"))
        results.append(score(SLOW_ANSWER, "4", timeout_s=TINY_TIMEOUT_S))

    worker = threading.Thread(target=run)
    worker.start()
    worker.join(timeout=120)
    assert results == [expected(1.0), expected(0.0), expected(1.0), expected(0.0, timed_out=1.0)]


# ------------------------------------------------------------ one box parser for ground truth and reward


def load_prepare_math() -> ModuleType:
    spec = importlib.util.spec_from_file_location("prepare_math", PREPARE_MATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# solution text -> the answer both sides must take from it (None: no complete box)
TRICKY_SOLUTIONS = {
    "So $x = \\boxed{\\frac{a}{\\sqrt{b^{2}}}}$ here.": "\\frac{a}{\\sqrt{b^{2}}}",
    "The area is \\fbox{7}.": "7",
    "The set is \\boxed{\\{1, 2\\}}.": "\\{1, 2\\}",
    "A literal brace: \\boxed{\\text{\\}}": None,  # \\} is no closing brace: this box never closes
    "first \\boxed{1} then \\boxed 5": "5",
    "spaced \\boxed {42}": "42",
    "\\boxed{3} and a lookalike \\boxedsymbol{2}": "3",
    "outer \\boxed{\\boxed{4}}": "4",
    "\\fbox{1} then \\boxed{2} then \\fbox{3}": "3",
    "truncated \\boxed{3} then \\boxed{\\frac{1}{": None,
    "\\boxed 5 then some {braces}": "5",
}


@pytest.mark.parametrize(("solution", "answer"), TRICKY_SOLUTIONS.items())
def test_prepare_math_ground_truth_and_the_reward_parse_boxes_alike(solution, answer):
    prepare_math = load_prepare_math()
    assert prepare_math.last_boxed is boxed.last_boxed is reward.last_boxed  # one implementation
    assert boxed.last_boxed(solution) == answer
    rows = [{"question": "q?", "answer": solution}]
    common = {"data_source": "t", "split_name": "train", "question_key": "question", "answer_key": "answer"}
    if answer is None:
        with pytest.raises(SystemExit, match="has no"):
            list(prepare_math.convert(rows, **common, instruction="", extract_boxed="always"))
        assert score(solution, "4")["has_boxed"] == 0.0
        return
    (row,) = prepare_math.convert(rows, **common, instruction="", extract_boxed="always")
    truth = row["reward_model"]["ground_truth"]
    assert truth == answer
    # a response written like the reference solution earns the reward against the extracted ground truth,
    # and so does one that boxes the answer plainly
    assert score(solution, truth) == expected(1.0)
    assert score(f"Thus \\boxed{{{answer}}}.", truth)["score"] == 1.0


def test_prepare_math_needs_neither_math_verify_nor_verl():
    code = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('prepare_math', {str(PREPARE_MATH)!r})\n"
        "module = importlib.util.module_from_spec(spec); spec.loader.exec_module(module)\n"
        "assert module.last_boxed('\\\\boxed{1}') == '1'\n"
        "print(sorted(name for name in ('math_verify', 'verl', 'sympy') if name in sys.modules))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
