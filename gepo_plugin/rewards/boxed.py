"""The answer of a math solution: the content of its last ``\\boxed{...}`` (or ``\\fbox{...}``).

One implementation for both sides of the reward: ``examples/data/prepare_math.py`` takes the ground truth
of a reference solution with it, and the math-verify reward takes the model's answer with it. If the two
parsed boxes differently (say, one gave up on ``\\fbox`` or on escaped braces and the other did not), a
correct response could never match its own ground truth. This module imports nothing beyond the standard
library so that preparing data does not need math-verify (or verl).

Rules:

* the last ``\\boxed`` / ``\\fbox`` command of the text counts (for a box inside a box that is the inner one);
* nested braces are followed; ``\\{`` and ``\\}`` (and any other backslash escape) do not count for nesting;
* a last box that is never closed (a truncated response) gives None, i.e. "no answer";
* ``\\boxed 5`` (LaTeX's brace-less form) gives ``"5"`` (everything up to the next space or ``$``);
* a longer command that only starts like one (``\\boxedsymbol``) is not a box.
"""

from __future__ import annotations

import re

__all__ = ["BOX_COMMANDS", "last_boxed"]

BOX_COMMANDS = ("\\boxed", "\\fbox")
_BRACELESS_ARGUMENT = re.compile(r"\s+([^\s$]+)")


def last_boxed(text: str | None) -> str | None:
    """Content of the last ``\\boxed{...}`` / ``\\fbox{...}`` of ``text`` (stripped, inner braces kept), or None.

    None when there is no box or when the last one is never closed. See the module docstring for the rules.
    """
    if not text:
        return None
    end = len(text)
    while True:
        start, command = max((text.rfind(name, 0, end), name) for name in BOX_COMMANDS)
        if start < 0:
            return None
        after = start + len(command)
        if not text[after : after + 1].isalpha():
            return _argument(text, after)
        end = start  # e.g. "\boxedsymbol": another command; look further left (a loop: no recursion limit)


def _argument(text: str, position: int) -> str | None:
    """The argument of a box command whose name ends at ``position`` (see :func:`last_boxed`)."""
    brace = position
    while brace < len(text) and text[brace].isspace():
        brace += 1
    if brace == len(text) or text[brace] != "{":
        match = _BRACELESS_ARGUMENT.match(text, position)
        return match.group(1) if match else None
    depth, begin, index = 1, brace + 1, brace + 1
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
