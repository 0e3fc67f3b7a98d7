"""The base of every typed option block, here so that the sampler host's settings and the learner's share it."""

from __future__ import annotations

from pydantic import ConfigDict

#: Base settings of every option model: unknown keys are errors, defaults are validated too.
STRICT_BLOCK = ConfigDict(extra="forbid", validate_default=True, frozen=True)
