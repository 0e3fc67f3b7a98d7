"""Plain config trees: their leaves, and which keys a user's command line set (one definition for every caller).

The launcher compares configs leaf by leaf, the start-up checks scan every leaf, and the presets, the HeteroRL
wiring and the CPU backend fill in a key only where the user set nothing. Framework-free: plain dicts and lists
(``OmegaConf.to_container``) in.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any


def leaves(node: Any, prefix: str = "", into_lists: bool = False) -> Iterator[tuple[str, Any]]:
    """``(dotted key, value)`` of every leaf of a plain tree.

    A non-empty dict is descended into; an empty one is a leaf (a config that gains ``{}`` has changed). Lists are
    leaves unless ``into_lists``, which descends into them with ``key[index]`` (a NaN inside a list is a NaN).
    """
    if isinstance(node, dict) and node:
        for key, value in node.items():
            yield from leaves(value, f"{prefix}.{key}" if prefix else str(key), into_lists)
    elif into_lists and isinstance(node, list) and node:
        for index, value in enumerate(node):
            yield from leaves(value, f"{prefix}[{index}]", into_lists)
    else:
        yield prefix, node


class UserKeys(frozenset):
    """The config keys a user set (``a.b=1``, ``+a.b=1``, ``++a.b=1``, ``~a.b`` on the command line).

    The launcher parses them (:func:`gepo_plugin.launch.explicit_keys`); everything that fills in defaults asks
    :meth:`covers` so that a user's value always wins.
    """

    def __new__(cls, keys: Iterable[str] = ()) -> UserKeys:
        return super().__new__(cls, keys)

    def covers(self, key: str) -> bool:
        """Did the user set ``key`` or one of its parents (setting ``a`` sets ``a.b`` too)?"""
        return any(key == given or key.startswith(given + ".") for given in self)

    def under(self, prefix: str) -> list[str]:
        """The keys the user set that start with ``prefix``, sorted."""
        return sorted(key for key in self if key.startswith(prefix))


#: A command line that set nothing (the default of every default-filler).
NO_USER_KEYS = UserKeys()
