"""verl's step counter as the weight versions HeteroRL reasons in, named once.

verl tags every token with the ``global_steps`` its rollout server was given with the weights (``update_weights(
global_steps=v)`` publishes version ``v``: 0 at start, ``g`` after step ``g``), and its trainer trains step ``g``
(``sample(global_steps=g)``, ``self.global_steps == g``) as the update from version ``g - 1`` to ``g``. The
learner's version while it trains step ``g``, against which every lag is measured, is therefore ``g - 1``.
"""

from __future__ import annotations


def learner_version(global_steps: int) -> int:
    """The weight version the learner holds while it trains step ``global_steps`` (the lag reference)."""
    return int(global_steps) - 1
