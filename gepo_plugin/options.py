"""Typed option blocks: one pydantic model per config surface, its defaults defined once, its errors naming the key.

Each of the plugin's config surfaces (GEPO's loss options, the BNPO and ΔL estimators, the ``hetero`` block, the
lab) is a pydantic model. The model is the only place a default is written: the Hydra node a user overrides is
built from it (:func:`defaults_of`, registered by :mod:`gepo_plugin.config`), the code reads the parsed model,
and :func:`parse_options` turns a mapping into the model or raises an error that names every bad key with the
value given and what is accepted. Booleans are strict (``hetero.enable=no`` is refused, not read as true),
numbers must be finite unless a field says otherwise, unknown keys are refused with the nearest valid name.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from gepo_sampler.blocks import STRICT_BLOCK

__all__ = ["STRICT_BLOCK", "OptionsError", "defaults_of", "did_you_mean", "format_validation_error", "parse_options"]

M = TypeVar("M", bound=BaseModel)


class OptionsError(ValueError):
    """A setting is impossible; the message names the key, the value given and what is accepted."""


def did_you_mean(given: object, choices: Iterable[str], before: str = " (", after: str = ")") -> str:
    """The one "did you mean" of every message: `` (did you mean 'x'?)`` for the choice nearest ``given`` (difflib's
    closest match), or ``""`` when none is near; ``before``/``after`` frame it (e.g. ``"; "`` and ``""``)."""
    close = difflib.get_close_matches(str(given), list(choices), n=1)
    return f"{before}did you mean {close[0]!r}?{after}" if close else ""


_FIXES = {
    "bool_type": "write true or false",
    "int_type": "write a whole number",
    "int_from_float": "write a whole number",
    "float_type": "write a number",
    "string_type": "write a string",
    "list_type": "write a list, e.g. [1, 2]",
    "missing": "set it",
}


def _key(prefix: str, loc: tuple) -> str:
    out = prefix
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _message(model: type[BaseModel], error: dict[str, Any], prefix: str) -> str:
    key = _key(prefix, error["loc"])
    kind = error["type"]
    if kind == "extra_forbidden":
        owner = _model_at(model, error["loc"][:-1])
        valid = sorted(owner.model_fields) if owner is not None else []
        hint = did_you_mean(error["loc"][-1], valid, before="; ", after="")
        return f"{key}: unknown option{hint} Valid options here: {', '.join(valid)}"
    if kind == "value_error":  # a cross-field rule of the model: its own message says what to change
        message = error["msg"].removeprefix("Value error, ")
        return f"{key}: {message}" if key else message
    given = error.get("input")
    fix = _FIXES.get(kind)
    text = f"{key}={given!r}: {error['msg'][0].lower()}{error['msg'][1:]}"
    if kind == "literal_error" and isinstance(given, str):
        choices = [c.strip("' ") for c in error["msg"].split("Input should be ", 1)[-1].replace(" or ", ",").split(",")]
        text += did_you_mean(given, choices)
    return text + (f" ({fix})" if fix else "")


def _model_at(model: type[BaseModel], loc: tuple) -> type[BaseModel] | None:
    """The nested model class at ``loc`` (None when it is not a model)."""
    current: Any = model
    for part in loc:
        if isinstance(part, int):
            continue
        if not (isinstance(current, type) and issubclass(current, BaseModel)) or part not in current.model_fields:
            return None
        annotation = current.model_fields[part].annotation
        candidates = [annotation, *getattr(annotation, "__args__", ())]
        nested = [c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)]
        if not nested:
            args = [a for c in candidates for a in getattr(c, "__args__", ())]
            nested = [a for a in args if isinstance(a, type) and issubclass(a, BaseModel)]
        if not nested:
            return None
        current = nested[0]
    return current if isinstance(current, type) and issubclass(current, BaseModel) else None


def format_validation_error(model: type[BaseModel], error: ValidationError, prefix: str) -> str:
    """One line per problem, each naming the full config key."""
    return "\n".join(_message(model, item, prefix) for item in error.errors())


def parse_options(
    model: type[M], values: Mapping[str, Any] | None, prefix: str, error: type[Exception] = OptionsError
) -> M:
    """``model`` from a plain mapping (an OmegaConf node converted with ``to_container``), or ``error``."""
    try:
        return model.model_validate(dict(values or {}))
    except ValidationError as problem:
        raise error(format_validation_error(model, problem, prefix)) from None


def defaults_of(model: type[BaseModel]) -> dict[str, Any]:
    """The model's defaults as a plain dict (the Hydra node users override)."""
    return model().model_dump(mode="python")
