"""The documentation site: it builds offline with warnings as errors, its generated references cover every key,
metric and option of the code, and what its pages show (commands, file paths, Python) is true.

Every ``python -m gepo_plugin.main_ppo ...`` command on a page or in the README is resolved with the real CLI's
``--cfg job`` (shell variables stand for data paths and buckets); a command that stops resolving fails here.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import cfg_job
import pytest

# The site and the commands are session fixtures: each xdist worker that runs these tests builds and resolves them
# once (a module fixture was torn down and redone whenever xdist ran another module's test in between).
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
sys.path.insert(0, str(DOCS / "_ext"))

import gepo_reference  # noqa: E402  (docs/_ext: the generator the build runs)

#: Folders of docs/ that hold committed results the pages show, not pages.
DATA_FOLDERS = ("lab", "bench", "relay", "screenshots", "_build", "reference/_generated")
PAGES = sorted(
    path
    for path in DOCS.rglob("*.md")
    if not any(path.relative_to(DOCS).as_posix().startswith(folder + "/") for folder in DATA_FOLDERS)
    and path.name != "pypi.md"
)
SHOWN = [*PAGES, ROOT / "README.md"]
FENCE = re.compile(
    r"^(?P<indent> *)(?P<fence>```+|~~~+)(?P<info>[^\n]*)\n(?P<body>.*?)^(?P=indent)(?P=fence)\s*$", re.M | re.S
)
SHELL = {"bash", "sh", "shell", "console"}


def code_blocks(path: Path, languages: set[str]) -> Iterator[tuple[int, str]]:
    """(line number, body) of every fenced block in ``languages``."""
    text = path.read_text()
    for match in FENCE.finditer(text):
        if match["info"].strip().split(" ")[0] in languages:
            yield text.count("\n", 0, match.start()) + 2, match["body"]


# ---------------------------------------------------------------- the build


@pytest.fixture(scope="session")
def site(tmp_path_factory) -> Path:
    """The site, built as CI and Read the Docs build it (a fresh build: warnings are re-emitted)."""
    out = tmp_path_factory.mktemp("html")
    result = subprocess.run(
        [sys.executable, "-m", "sphinx", "-E", "-W", "-n", "--keep-going", "-q", str(DOCS), str(out)],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    assert "WARNING" not in result.stderr and "ERROR" not in result.stderr, result.stderr[-6000:]
    return out


def test_the_site_builds_with_every_page(site):
    for page in PAGES:
        html = site / page.relative_to(DOCS).with_suffix(".html")
        assert html.is_file(), html
    assert (site / "searchindex.js").is_file()  # the theme's search, offline
    assert (site / "_static" / "hetero.svg").is_file()
    assert "<img" in (site / "hetero.html").read_text()


def test_the_site_reaches_no_network_when_viewed(site):
    """Offline: no page loads a script, style sheet, font or image from another host."""
    remote = re.compile(r"""<(?:script|link|img)\b[^>]*(?:src|href)=["'](?:https?:)?//""", re.I)
    for html in site.rglob("*.html"):
        assert not remote.search(html.read_text()), html


# ---------------------------------------------------------------- generated references


def schema_keys(model, prefix: str) -> list[str]:
    """Every option under ``prefix``, walked from pydantic's JSON schema (independently of the generator): a block's
    options under its key, a list of blocks' under ``<key>[]`` unless that block was walked already."""
    schema = model.model_json_schema()
    definitions = schema.get("$defs", {})
    walked = {schema.get("title")}

    def block_of(prop: dict) -> tuple[str | None, bool]:
        for ref in [prop, *prop.get("anyOf", []), *prop.get("allOf", [])]:
            if "$ref" in ref:
                return ref["$ref"].split("/")[-1], False
            if ref.get("type") == "array" and "$ref" in ref.get("items", {}):
                return ref["items"]["$ref"].split("/")[-1], True
        return None, False

    def walk(node: dict, path: str) -> Iterator[str]:
        for name, prop in node.get("properties", {}).items():
            key = f"{path}.{name}"
            yield key
            block, listed = block_of(prop)
            if block is not None and not (listed and block in walked):
                walked.add(block)
                yield from walk(definitions[block], f"{key}[]" if listed else key)

    return list(walk(schema, prefix))


def test_the_config_reference_has_every_option_of_every_typed_block(site):
    rows = gepo_reference.all_option_rows()
    expected = [key for prefix, model in gepo_reference.option_surfaces().items() for key in schema_keys(model, prefix)]
    assert [row.key for row in rows] == expected
    assert len(expected) >= 60  # GEPO's, BNPO's, ΔL's, hetero.* (relay, guard, health, delay) and the CPU rollout's
    assert {
        "hetero.relay.url",
        "hetero.relay.links[].bandwidth_mbps",
        "hetero.guard.enable",
        "actor_rollout_ref.rollout.engine_kwargs.hf.latency.decode_tokens_per_s",
    } <= {row.key for row in rows}
    page = (site / "reference" / "config.html").read_text()
    for row in rows:
        assert row.key in page, row.key
        assert row.meaning, f"{row.key} has no description in its model"


def test_the_config_reference_has_every_preset_every_fill_in_and_every_key(site):
    from gepo_plugin.verl_glue.presets import PRESETS

    page = (site / "reference" / "config.html").read_text()
    for preset in PRESETS.values():
        assert f"algorithm.loss={preset.name}</span>" in page
        for key in preset.settings:
            assert key in page, (preset.name, key)
    for _, overrides in gepo_reference.SCENARIOS:
        fills = gepo_reference.scenario_fill_ins(overrides)
        assert fills, overrides
        for key in fills:
            assert key in page, (overrides, key)
    keys = gepo_reference.key_table()
    assert len(keys) >= 60
    for name, key in keys.items():
        assert key in page and name in page, name


def test_the_fill_ins_are_the_launchers():
    """The reference shows what the launcher writes: with a key set by the user it shows no fill-in for that key."""
    user = gepo_reference.scenario_fill_ins(("trainer.device=cpu", "actor_rollout_ref.actor.strategy=fsdp"))
    silent = gepo_reference.scenario_fill_ins(("trainer.device=cpu",))
    assert silent["actor_rollout_ref.actor.strategy"] == "fsdp2"
    assert "actor_rollout_ref.actor.strategy" not in user


def test_the_metrics_reference_has_every_declared_metric(site):
    from gepo_plugin.metric_names import METRICS

    fragment = gepo_reference.metrics_markdown()
    rows = [line for line in fragment.splitlines() if line.startswith("| `")]
    assert len(rows) == len(METRICS) >= 100
    page = (site / "reference" / "metrics.html").read_text()
    for metric in METRICS:
        assert metric.key in page, metric.key


def _options(parser: argparse.ArgumentParser) -> Iterator[str]:
    for action in parser._actions:
        yield from (option for option in action.option_strings if option not in ("-h", "--help"))
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _options(sub)


def test_the_command_line_reference_has_every_option(site):
    from gepo_plugin.__main__ import build_parser as plugin_parser
    from gepo_plugin.doctor import build_parser as doctor_parser
    from gepo_plugin.fleet_sim.__main__ import build_parser as fleet_parser
    from gepo_plugin.lab.cli import build_parser as lab_parser
    from gepo_sampler.host.cli import build_parser as sampler_parser

    page = (site / "reference" / "cli.html").read_text()
    parsers = (plugin_parser(), doctor_parser(), lab_parser(), sampler_parser(), fleet_parser())
    options = [option for parser in parsers for option in _options(parser)]
    assert len(options) >= 50
    for option in options:
        assert option in page, option
    for command in ("stability", "variance", "paired", "doctor", "demo", "presets"):
        assert command in page


# ---------------------------------------------------------------- what the pages show


def shown_commands() -> list[tuple[str, list[str]]]:
    """(page:line, overrides) of every ``python -m gepo_plugin.main_ppo`` command in a shell block."""
    placeholders = {"HOME": "/home/user"}
    commands = []
    for path in SHOWN:
        for line_number, body in code_blocks(path, SHELL):
            logical = body.replace("\\\n", " ").splitlines()
            for offset, line in enumerate(logical):
                if "gepo_plugin.main_ppo" not in line:
                    continue
                text = re.sub(r"\$\{?(\w+)\}?", lambda m: placeholders.get(m[1], f"/placeholder/{m[1].lower()}"), line)
                words = shlex.split(text, comments=True)
                if "gepo_plugin.main_ppo" not in words:
                    continue
                overrides = []
                for word in words[words.index("gepo_plugin.main_ppo") + 1 :]:
                    if word in {"|", "&&", ";", ">", "||"}:
                        break
                    overrides.append(word)
                for flag in ("--cfg", "-c"):
                    while flag in overrides:
                        at = overrides.index(flag)
                        del overrides[at : at + 2]
                overrides = [word for word in overrides if word != "--resolve"]
                commands.append((f"{path.relative_to(ROOT)}:{line_number + offset}", overrides))
    return commands


COMMANDS = shown_commands()


#: The tiny model's printed commands (Getting started runs them): ``python -m gepo_plugin.tiny`` arguments.
TINY_COMMANDS = {
    "tiny:sync": ["--print-command", "sync"],
    "tiny:separate_async": ["--print-command", "separate_async"],
    "tiny:vllm": ["--print-command", "sync", "--for-vllm"],
}


def printed_tiny_command(out: Path, arguments: list[str]) -> list[str]:
    result = subprocess.run(
        [sys.executable, "-m", "gepo_plugin.tiny", "--out", str(out), *arguments],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    command = result.stdout[result.stdout.index("python -m gepo_plugin.main_ppo") :]
    words = shlex.split(command.replace("\\\n", " "))
    return words[3:]


@pytest.fixture(scope="session")
def resolved(tmp_path_factory):
    tiny = {name: printed_tiny_command(tmp_path_factory.mktemp("tiny"), args) for name, args in TINY_COMMANDS.items()}
    process, collect = cfg_job.start([*COMMANDS, *tiny.items()], tmp_path_factory.mktemp("docs_cfg_job"))
    yield collect
    cfg_job.stop(process)


def test_the_pages_show_commands_to_resolve():
    pages = {name.split(":")[0] for name, _ in COMMANDS}
    assert {"README.md", "docs/getting-started.md", "docs/hetero.md", "docs/relay.md"} <= pages
    assert all("..." not in overrides and overrides for _, overrides in COMMANDS), COMMANDS


@pytest.mark.parametrize("name", [*(name for name, _ in COMMANDS), *TINY_COMMANDS])
def test_every_shown_command_resolves_with_cfg_job(name, resolved):
    results = resolved()
    code, printed = results[name]
    assert code == 0, f"{name}: {printed[-2000:]}\n{results['stderr'][1][-4000:]}"
    assert "actor_rollout_ref:" in printed  # the config that will run, printed


ROOT_FILES = {"run.sh", "test.sh", "pyproject.toml", "ARCHITECTURE.md", "README.md", "LICENSE", ".readthedocs.yaml"}
REPO_PATH = re.compile(r"^(?:gepo_plugin|tests|bench|examples|scripts|patches|docs)/[\w./-]*$")


def named_paths(path: Path) -> Iterator[str]:
    """Repository paths a page names in backticks."""
    text = FENCE.sub("", path.read_text())
    for span in re.findall(r"`([^`\n]+)`", text):
        candidate = span.split("::")[0].split(":")[0].split("#")[0].rstrip("/.,")
        if candidate in ROOT_FILES or REPO_PATH.match(candidate):
            yield candidate


def linked_paths(path: Path) -> Iterator[str]:
    """Local targets of the page's Markdown links and images, relative to the repository root."""
    text = FENCE.sub("", path.read_text())
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"^[a-z]+:", target) or target.startswith("#"):
            continue
        yield os.path.normpath((path.parent / target.split("#")[0]).relative_to(ROOT).as_posix())


@pytest.mark.parametrize("page", SHOWN, ids=lambda page: str(page.relative_to(ROOT)))
def test_every_file_a_page_names_exists(page):
    named = list(named_paths(page)) + list(linked_paths(page))
    missing = [name for name in named if not (ROOT / name).exists()]
    assert not missing, missing


@pytest.mark.parametrize("page", SHOWN, ids=lambda page: str(page.relative_to(ROOT)))
def test_every_python_snippet_compiles(page):
    for line, body in code_blocks(page, {"python", "py"}):
        compile(body, f"{page.relative_to(ROOT)}:{line}", "exec")


def test_the_readme_is_a_front_page():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 160
    first_block = lines[lines.index("```bash") + 1 : lines.index("```", lines.index("```bash"))]
    assert [line.split()[:2] for line in first_block] == [["bash", "run.sh"], ["bash", "test.sh"]]


def test_the_development_page_includes_the_architecture():
    """ARCHITECTURE.md and the Development page agree: the page includes the file."""
    text = (DOCS / "development.md").read_text()
    assert re.search(r"```\{include\} \.\./ARCHITECTURE\.md", text)
