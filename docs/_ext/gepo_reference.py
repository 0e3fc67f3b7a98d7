"""The docs' reference pages generated from the code at build time, so they cannot drift from it.

Three Markdown fragments are written to ``docs/reference/_generated/`` when the build starts (the pages include
them): every option of the plugin's typed config blocks with its type, default, limits and meaning (read from the
pydantic models that define and validate them), what the plugin fills in for each named thing (``algorithm.loss``,
HeteroRL, the CPU backend: read from the functions the launcher applies), the config keys it reads or writes (the
key table, :mod:`gepo_plugin.config_keys`), and every metric it logs (:data:`gepo_plugin.metric_names.METRICS`).
The command-line references use sphinx-argparse on the tools' own parsers. ``tests/test_docs.py`` counts the rows
against the code.
"""

from __future__ import annotations

import types
import typing
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import annotated_types
from pydantic import BaseModel
from pydantic.fields import FieldInfo

GENERATED = Path(__file__).resolve().parent.parent / "reference" / "_generated"


# ---------------------------------------------------------------- the typed option blocks


def option_surfaces() -> dict[str, type[BaseModel]]:
    """Config key of each typed block the plugin adds to verl's tree -> the model that defines it."""
    from gepo_plugin import config_keys as keys
    from gepo_plugin.cpu_backend.rollout.options import HFRolloutOptions
    from gepo_plugin.hetero.settings import HeteroConfig
    from gepo_plugin.maths.options import BNPOOptions, DeltaLOptions, PolicyLossOptions

    return {
        keys.POLICY_LOSS: PolicyLossOptions,
        keys.BNPO_OPTIONS: BNPOOptions,
        keys.DELTA_L_OPTIONS: DeltaLOptions,
        keys.HETERO: HeteroConfig,
        keys.HF_ROLLOUT_OPTIONS: HFRolloutOptions,
    }


@dataclass(frozen=True)
class OptionRow:
    """One documented option: its full key and what a reader needs to set it."""

    key: str
    type: str
    default: str
    limits: str
    meaning: str


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [model for arg in typing.get_args(annotation) for model in _models_in(arg)]


def type_text(annotation: Any) -> str:
    """A field's type as a user writes it on the command line."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        inner = [type_text(arg) for arg in args if arg is not type(None)]
        text = " or ".join(inner)
        return f"{text} or null" if type(None) in args else text
    if origin is Literal:
        return "one of " + ", ".join(f"`{value}`" for value in args)
    if origin in (list, tuple):
        return f"list of {type_text(args[0]) if args else 'values'}"
    if origin is dict:
        return "mapping"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "block"
    name = getattr(annotation, "__name__", str(annotation))
    return {"StrictInt": "int", "StrictBool": "bool", "StrictFloat": "float", "StrictStr": "str"}.get(name, name)


_BOUNDS = (
    (annotated_types.Ge, "ge", "≥"),
    (annotated_types.Gt, "gt", ">"),
    (annotated_types.Le, "le", "≤"),
    (annotated_types.Lt, "lt", "<"),
)


def limits_text(info: FieldInfo) -> str:
    """The field's validated limits (bounds, lengths, pattern)."""
    parts = []
    for item in info.metadata:
        for kind, attribute, sign in _BOUNDS:
            if isinstance(item, kind):
                parts.append(f"{sign} {getattr(item, attribute)}")
        if isinstance(item, annotated_types.MinLen):
            parts.append(f"at least {item.min_length} item(s)")
        if isinstance(item, annotated_types.MaxLen):
            parts.append(f"at most {item.max_length} item(s)")
        pattern = getattr(item, "pattern", None)
        if pattern:
            parts.append(f"matches `{pattern}`")
    return ", ".join(parts)


def default_text(info: FieldInfo) -> str:
    """The default as a command line writes it (the launcher's own spelling of override values)."""
    if info.is_required():
        return "(required)"
    value = info.get_default(call_default_factory=True)
    return "(block)" if isinstance(value, BaseModel) else f"`{_value(value)}`"


def option_rows(
    prefix: str, model: type[BaseModel], documented: set[type[BaseModel]] | None = None
) -> Iterator[OptionRow]:
    """Every field of ``model`` under ``prefix``, a block's fields after the block's own row (depth first).

    A list of blocks (``hetero.relay.links``) documents its entries' fields as ``<key>[].<field>``, unless that block
    is documented already (``hetero.group_delays`` entries are ``hetero.delay`` blocks: its row says so)."""
    documented = set() if documented is None else documented
    documented.add(model)
    for name, info in model.model_fields.items():
        key = f"{prefix}.{name}"
        nested = _models_in(info.annotation)
        block = nested[0] if nested else None
        listed = _is_list_of(info)
        meaning = info.description or ""
        if block is not None and listed and block in documented:
            meaning += f" (each entry: the options of a `{block.__name__}` block, listed above)"
        yield OptionRow(key, type_text(info.annotation), default_text(info), limits_text(info), meaning)
        if block is not None and not (listed and block in documented):
            yield from option_rows(f"{key}[]" if listed else key, block, documented)


def _is_list_of(info: FieldInfo) -> bool:
    annotation = info.annotation
    candidates = [annotation, *typing.get_args(annotation)]
    return any(typing.get_origin(candidate) is list for candidate in candidates)


def all_option_rows() -> list[OptionRow]:
    return [row for prefix, model in option_surfaces().items() for row in option_rows(prefix, model)]


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def options_markdown() -> str:
    """One section per block; each option a definition: its key, then type, default and limits, then its meaning."""
    lines = []
    for prefix, model in option_surfaces().items():
        doc = (model.__doc__ or "").strip().splitlines()[0]
        lines += [
            f"### `{prefix}`",
            "",
            f"{doc} Defined, validated and defaulted by `{model.__module__}.{model.__name__}`.",
            "",
        ]
        for row in option_rows(prefix, model):
            facts = [f"type: {row.type}", f"default: {row.default}"] + ([f"limits: {row.limits}"] if row.limits else [])
            lines += [f"`{row.key}`", f": {' · '.join(facts)}", "", f"  {row.meaning}", ""]
    return "\n".join(lines)


# ---------------------------------------------------------------- what the plugin fills in


def preset_markdown() -> str:
    from gepo_plugin.verl_glue.presets import PRESETS

    lines = []
    for preset in PRESETS.values():
        lines += [f"### `algorithm.loss={preset.name}`", "", _cell(preset.summary), "", "| key | value |", "|---|---|"]
        lines += [f"| `{key}` | `{_value(value)}` |" for key, value in preset.settings.items()]
        if preset.needs_response_terms:
            note = "the plugin's trainer hands the loss per-response terms"
            lines.append(f"| `trainer.v1.trainer_mode` | `gepo_<mode>` ({note}) |")
        lines.append("")
    return "\n".join(lines)


def _value(value: Any) -> str:
    from gepo_plugin.launch import format_value

    return _cell(str(format_value(value)))


#: Representative command lines whose fill-ins the reference shows: (title, overrides).
SCENARIOS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("`algorithm.loss=gepo` (GEPO on verl's default `sync` trainer)", ("algorithm.loss=gepo",)),
    ("`trainer.device=cpu` (FSDP2 and the transformers rollout)", ("trainer.device=cpu",)),
    (
        "`trainer.device=cpu actor_rollout_ref.rollout.name=vllm` (vLLM's CPU build)",
        ("trainer.device=cpu", "actor_rollout_ref.rollout.name=vllm"),
    ),
    (
        "`trainer.device=cpu model_engine=megatron` (verl's Megatron engine)",
        ("trainer.device=cpu", "model_engine=megatron"),
    ),
    (
        "`hetero.enable=true` (HeteroRL on verl's `separate_async` trainer)",
        ("hetero.enable=true", "trainer.v1.trainer_mode=separate_async"),
    ),
    (
        "`hetero.enable=true hetero.transport=relay` (the weight relay)",
        (
            "hetero.enable=true",
            "trainer.v1.trainer_mode=separate_async",
            "hetero.transport=relay",
            "hetero.relay.url=/shared/relay",
        ),
    ),
)


def scenario_fill_ins(overrides: tuple[str, ...]) -> dict[str, Any]:
    """What the launcher fills in for ``overrides`` (its own :func:`gepo_plugin.launch.fill_in`, before the checks)."""
    from gepo_plugin.launch import changed_keys, compose_config, explicit_keys, fill_in

    before = compose_config(overrides)
    after, _ = fill_in(before, explicit_keys(overrides))
    return changed_keys(before, after)


def fill_in_markdown() -> str:
    lines = []
    for title, overrides in SCENARIOS:
        lines += [f"### {title}", "", "| key | value filled in |", "|---|---|"]
        for key, value in sorted(scenario_fill_ins(overrides).items()):
            lines.append(f"| `{key}` | `{_value(value)}` |")
        lines.append("")
    return "\n".join(lines)


# ---------------------------------------------------------------- the key table


def key_table() -> dict[str, str]:
    """Constant name -> config key, every dotted key of :mod:`gepo_plugin.config_keys`."""
    from gepo_plugin import config_keys

    return {
        name: value
        for name, value in vars(config_keys).items()
        if name.isupper() and isinstance(value, str) and not name.startswith("_")
    }


def keys_markdown() -> str:
    lines = ["| config key | name in `gepo_plugin/config_keys.py` |", "|---|---|"]
    lines += [f"| `{key}` | `{name}` |" for name, key in sorted(key_table().items(), key=lambda item: item[1])]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- metrics


def metrics_markdown() -> str:
    from gepo_plugin import metric_names

    lines = []
    for namespace in metric_names.NAMESPACES:
        rows = [metric for metric in metric_names.METRICS if _namespace_of(metric.key) == namespace]
        lines += [f"## `{namespace}`", "", "| key | meaning |", "|---|---|"]
        lines += [f"| `{metric.key}` | {_cell(metric.meaning)} |" for metric in rows]
        lines.append("")
    return "\n".join(lines)


def _namespace_of(key: str) -> str:
    from gepo_plugin.metric_names import NAMESPACES

    return max((ns for ns in NAMESPACES if key.startswith(ns)), key=len)


# ---------------------------------------------------------------- Sphinx


FRAGMENTS = {
    "options.md": options_markdown,
    "presets.md": preset_markdown,
    "fill_ins.md": fill_in_markdown,
    "keys.md": keys_markdown,
    "metrics.md": metrics_markdown,
}


def write_fragments(target: Path = GENERATED) -> dict[str, str]:
    """Write every generated fragment; returns name -> text (unchanged files are not rewritten)."""
    target.mkdir(parents=True, exist_ok=True)
    texts = {name: make() for name, make in FRAGMENTS.items()}
    for name, text in texts.items():
        path = target / name
        if not path.exists() or path.read_text() != text:
            path.write_text(text)
    return texts


def _on_builder_inited(app: Any) -> None:
    write_fragments()


def setup(app: Any) -> Mapping[str, Any]:
    app.connect("builder-inited", _on_builder_inited)
    return {"parallel_read_safe": True, "parallel_write_safe": True, "version": "1"}
