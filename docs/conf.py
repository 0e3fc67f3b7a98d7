"""Sphinx configuration of gepo-plugin's documentation (MyST Markdown pages, the Furo theme, offline).

Build it with ``bash scripts/docs.sh`` (or ``sphinx-build -W -n --keep-going docs docs/_build/html`` in an
environment with ``gepo-plugin[docs]``). The configuration, metrics and command-line references are generated from
the code at build time by ``docs/_ext/gepo_reference.py``; nothing here reaches the network, at build or view time.
"""

from __future__ import annotations

import sys
from pathlib import Path

from sphinx.ext import napoleon

DOCS = Path(__file__).resolve().parent
sys.path.insert(0, str(DOCS / "_ext"))
sys.path.insert(0, str(DOCS.parent))
sys.path.insert(0, str(DOCS.parent / "sampler"))  # gepo_sampler: the sampler host's distribution

from gepo_plugin import __version__ as release  # noqa: E402

project = "gepo-plugin"
author = "gepo-plugin developers"
copyright = "2026, gepo-plugin developers"
version = release
nitpicky = True  # every cross-reference must resolve (Read the Docs builds with this too)

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.viewcode",
    "sphinxarg.ext",
    "sphinx_copybutton",
    "gepo_reference",
]

source_suffix = {".md": "markdown"}
root_doc = "index"
# docs/ also holds the lab's and the benchmarks' committed results (tables, JSON, logs): pages include or show them,
# they are not pages of their own
exclude_patterns = ["_build", "pypi.md", "lab/**", "bench/**", "relay/**", "screenshots/**", "reference/_generated/**"]

myst_enable_extensions = ["colon_fence", "deflist", "attrs_inline"]
myst_heading_anchors = 4

html_theme = "furo"
html_title = f"gepo-plugin {release}"
html_static_path = ["_static"]
html_theme_options = {"navigation_with_keys": True}

autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_default_options = {"members": True, "show-inheritance": False}
# names the maths' annotations use unqualified (``from __future__ import annotations``)
autodoc_type_aliases = {"GroupIndex": "gepo_plugin.maths.groups.GroupIndex"}


def _google_sections_only(process):
    """Napoleon for functions' and classes' ``Args:``/``Returns:`` sections only: it would read an attribute's
    one-line docstring ("Evictions for staleness: what ...") as ``type: description``."""

    def wrapped(app, what, name, obj, options, lines):
        if what not in ("attribute", "property", "data"):
            process(app, what, name, obj, options, lines)

    return wrapped


napoleon._process_docstring = _google_sections_only(napoleon._process_docstring)

# Nitpicky mode (-n) checks every cross-reference; types from other projects have no inventory offline (no
# intersphinx: the build reaches no network), so their names are accepted as they are
nitpick_ignore_regex = [
    (r"py:.*", r"(torch|numpy|np|pandas|omegaconf|pydantic|fsspec|ray|verl|typing|collections|concurrent|pathlib)\b.*"),
    (r"py:.*", r"(Tensor|DictConfig|BaseModel|Path|Any|Callable|Iterable|Iterator|Mapping|Sequence|Literal)"),
    (r"py:.*", r"(int|float|str|bool|bytes|dict|list|tuple|set|frozenset|object|None|type)"),
    (r"py:.*", r"(enum|types|annotated_types)\..*"),
    # the constraints of the wire's Annotated integers and counters, as autodoc prints them (pydantic, annotated_types)
    (r"py:class", r"(FieldInfo|AllowInfNan|Ge|Gt|Le|Lt|MaxLen|MinLen)"),
    # pydantic fields' constraints, as autodoc prints them in a model's signature
    (r"py:class", r"\w+=.*"),
    # the verl glue and the tools are not part of the Python API pages; their names in docstrings stay text
    (r"py:.*", r"gepo_plugin\.(verl_glue|lab|cpu_backend)\..*"),
    (r"py:.*", r"gepo_sampler\.host\b.*"),
]
