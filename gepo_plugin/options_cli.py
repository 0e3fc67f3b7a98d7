"""A command line generated from an option model: one ``--flag`` per field, its help the field's description.

A tool's options are defined once, as a :mod:`pydantic` model (:mod:`gepo_plugin.options`); this module turns the
model into ``argparse`` options and the parsed values back into the model, so the command line, the defaults
and the validation can never drift apart. Every generated option defaults to "not given" (the model's or a
preset's value applies), and its help ends with the model's default.
"""

from __future__ import annotations

import argparse
import types
import typing
from collections.abc import Iterable
from typing import Any, Literal

from pydantic import BaseModel


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _unwrap_optional(annotation: Any) -> Any:
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return annotation


def _argument(annotation: Any) -> dict[str, Any]:
    """argparse keyword arguments for a field's type."""
    annotation = _unwrap_optional(annotation)
    origin = typing.get_origin(annotation)
    if origin is Literal:
        return {"choices": list(typing.get_args(annotation))}
    if origin in (list, tuple):
        (item, *_) = typing.get_args(annotation) or (str,)
        item = _unwrap_optional(item)
        if typing.get_origin(item) is Literal:
            return {"nargs": "+", "choices": list(typing.get_args(item))}
        return {"nargs": "+", "type": item if item in (int, float, str) else str}
    if annotation is bool:
        return {"action": argparse.BooleanOptionalAction}
    if annotation in (int, float, str):
        return {"type": annotation}
    return {"type": str}


def _default_text(value: Any) -> str:
    if isinstance(value, list | tuple):
        return " ".join(str(v) for v in value)
    return str(value)


def add_model_arguments(
    parser: argparse.ArgumentParser, model: type[BaseModel], exclude: Iterable[str] = (), defaults_from: str = ""
) -> argparse.ArgumentParser:
    """One option per field of ``model`` (``--field-name``), help from its description and default."""
    skip = set(exclude)
    for name, info in model.model_fields.items():
        if name in skip:
            continue
        default = info.get_default(call_default_factory=True)
        source = f"{defaults_from}; otherwise " if defaults_from else ""
        help_text = f"{info.description or name} (default: {source}{_default_text(default)})"
        parser.add_argument(_flag(name), dest=name, default=None, help=help_text, **_argument(info.annotation))
    return parser


def given_values(args: argparse.Namespace, model: type[BaseModel]) -> dict[str, Any]:
    """The model fields set on the command line (not ``None``)."""
    return {name: getattr(args, name) for name in model.model_fields if getattr(args, name, None) is not None}
