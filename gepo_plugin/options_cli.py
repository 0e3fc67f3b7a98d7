"""A command line generated from an option model: one ``--flag`` per field, its help the field's description.

A tool's options are defined once, as a :mod:`pydantic` model (:mod:`gepo_plugin.options`); this module turns the
model into ``argparse`` options and the parsed values back into the model, so the command line, the defaults
and the validation can never drift apart. Every generated option defaults to "not given" (the model's or a
preset's value applies), and its help ends with the model's default. A field that is itself a model (a block,
e.g. ``guard``) becomes one option per field of it (``--guard-enable``, ``--guard-min-ess``, ...).
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
        if _is_block(info.annotation):  # a block: its own group of options, the block's description on top
            group = parser.add_argument_group(f"{_flag(name)}-* options", info.description)
            for sub, sub_info in info.annotation.model_fields.items():
                default = sub_info.get_default(call_default_factory=True)
                source = f"{defaults_from}; otherwise " if defaults_from else ""
                help_text = f"{sub_info.description or sub} (default: {source}{_default_text(default)})"
                kwargs = _argument(sub_info.annotation)
                group.add_argument(
                    _flag(f"{name}_{sub}"), dest=f"{name}__{sub}", default=None, help=help_text, **kwargs
                )
            continue
        default = info.get_default(call_default_factory=True)
        source = f"{defaults_from}; otherwise " if defaults_from else ""
        help_text = f"{info.description or name} (default: {source}{_default_text(default)})"
        parser.add_argument(_flag(name), dest=name, default=None, help=help_text, **_argument(info.annotation))
    return parser


def _is_block(annotation: Any) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def given_values(args: argparse.Namespace, model: type[BaseModel]) -> dict[str, Any]:
    """The model fields set on the command line (not ``None``); a block's given fields as a dict."""
    out: dict[str, Any] = {}
    for name, info in model.model_fields.items():
        if _is_block(info.annotation):
            block = {
                sub: getattr(args, f"{name}__{sub}")
                for sub in info.annotation.model_fields
                if getattr(args, f"{name}__{sub}", None) is not None
            }
            if block:
                out[name] = block
        elif getattr(args, name, None) is not None:
            out[name] = getattr(args, name)
    return out
