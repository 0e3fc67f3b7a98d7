"""The layout shows the architecture: components, verl glue, tools, the app; dependencies one way; no cycles.

Read from the source (every ``import`` statement, function-level ones included), so an import added anywhere in the
wrong direction fails here, not in a user's process.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: the two distributions' packages: the learner's, and the sampler host's (sampler/), which it imports
PACKAGES = (ROOT / "gepo_plugin", ROOT / "sampler" / "gepo_sampler")

#: Framework-free components: the maths and HeteroRL's core, plain torch/numpy/pydantic; and the wire both sides of
#: a remote sampler share (the relay, the remote protocol), shipped in the sampler host's distribution.
COMPONENTS = (
    "gepo_sampler.blocks",
    "gepo_sampler.relay",
    "gepo_sampler.remote",
    "gepo_plugin.maths",
    "gepo_plugin.hetero",
    "gepo_plugin.options",
    "gepo_plugin.names",
    "gepo_plugin.config_keys",
    "gepo_plugin.config_tree",
    "gepo_plugin.versions",
    "gepo_plugin.metric_names",
)
#: The thin verl glue (with the patches it applies and the config it declares).
GLUE = ("gepo_plugin.verl_glue", "gepo_plugin.patches", "gepo_plugin.patching", "gepo_plugin.config")
#: Recipes and tools built on the components and the glue.
TOOLS = (
    "gepo_plugin.cpu_backend",
    "gepo_plugin.lab",
    "gepo_plugin.fleet_sim",
    "gepo_plugin.rewards",
    "gepo_plugin.tiny",
    "gepo_plugin.synthetic",
    "gepo_plugin.demo",
    "gepo_plugin.options_cli",
    "gepo_sampler.host",
)
#: The application layer: entry point, launcher, CLIs.
APP = (
    "gepo_plugin.entry_point",
    "gepo_plugin.launch",
    "gepo_plugin.main_ppo",
    "gepo_plugin.doctor",
    "gepo_plugin.__main__",
    "gepo_sampler.__main__",
)
FRAMEWORKS = ("verl", "ray", "transfer_queue", "hydra", "megatron", "mbridge")


def layer(module: str) -> int:
    if module in ("gepo_plugin", "gepo_sampler"):  # the packages themselves: only their versions
        return 0
    for rank, group in enumerate((COMPONENTS, GLUE, TOOLS, APP)):
        if any(module == name or module.startswith(name + ".") for name in group):
            return rank
    raise AssertionError(f"{module} belongs to no layer: add it to tests/test_layout.py")


def modules() -> dict[str, Path]:
    found = {}
    for path in (path for package in PACKAGES for path in package.rglob("*.py")):
        parts = path.relative_to(package_root(path)).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    for path in (ROOT / "patches").glob("*.py"):
        stem = path.stem
        found["gepo_plugin.patches" + ("" if stem == "__init__" else f".{stem}")] = path
    return found


def package_root(path: Path) -> Path:
    """The folder a module's import name is relative to: the repository root, or sampler/."""
    return ROOT / "sampler" if path.is_relative_to(ROOT / "sampler") else ROOT


def imports(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
            out.update(f"{node.module}.{alias.name}" for alias in node.names)
    return out


def graph() -> dict[str, set[str]]:
    known = modules()
    edges = {}
    for name, path in known.items():
        targets = set()
        for target in imports(path):
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name and not name.startswith(target + "."):  # a package's own __init__
                targets.add(target)
        edges[name] = targets
    return edges


def test_every_module_has_a_layer():
    for name in modules():
        layer(name)


def test_dependencies_run_one_way():
    wrong = [
        f"{source} ({layer(source)}) imports {target} ({layer(target)})"
        for source, targets in graph().items()
        for target in targets
        if layer(target) > layer(source)
    ]
    assert wrong == []


def test_the_components_import_no_framework_at_module_level():
    for name, path in modules().items():
        if layer(name) != 0:
            continue
        tree = ast.parse(path.read_text())
        top = [n for n in tree.body if isinstance(n, ast.Import | ast.ImportFrom)]
        used = {alias.name for n in top if isinstance(n, ast.Import) for alias in n.names}
        used |= {n.module for n in top if isinstance(n, ast.ImportFrom) and n.module}
        assert not {u for u in used if u.split(".")[0] in FRAMEWORKS}, name


def test_there_is_no_import_cycle():
    edges = graph()
    state: dict[str, int] = {}
    cycles = []

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for target in sorted(edges.get(node, ())):
            if state.get(target) == 1:
                cycles.append([*stack[stack.index(target) :], target])
            elif target not in state:
                visit(target, [*stack, target])
        state[node] = 2

    for node in sorted(edges):
        if node not in state:
            visit(node, [node])
    assert cycles == []


def _importers_of(targets: tuple[str, ...], sources: tuple[str, ...]) -> list[str]:
    """``source -> target`` edges from a module under ``sources`` to one under ``targets``."""

    def under(name: str, prefixes: tuple[str, ...]) -> bool:
        return any(name == prefix or name.startswith(prefix + ".") for prefix in prefixes)

    return sorted(
        f"{source} -> {target}"
        for source, found in graph().items()
        if under(source, sources)
        for target in found
        if under(target, targets)
    )


def test_the_sampler_hosts_distribution_imports_nothing_of_the_learners():
    """gepo-sampler installs beside a vLLM without gepo-plugin: no module of it may import one of gepo_plugin or a
    framework of the learner's stack, at any level (function-level imports included)."""
    for name, path in modules().items():
        if name.split(".")[0] == "gepo_sampler":
            roots = {target.split(".")[0] for target in imports(path)}
            assert not roots & {"gepo_plugin", *FRAMEWORKS}, (name, roots & {"gepo_plugin", *FRAMEWORKS})


def test_the_glue_imports_no_patch():
    """A patch is deletable when verl fixes its gap: names it shares with the glue live in the glue."""
    assert _importers_of(("gepo_plugin.patches",), ("gepo_plugin.verl_glue", "gepo_plugin.config")) == []


def test_the_patch_framework_imports_no_glue_and_no_patch():
    """The framework is handed the seam's check by each patch, so it sits below the glue (no arrow back up)."""
    assert _importers_of(("gepo_plugin.verl_glue", "gepo_plugin.patches"), ("gepo_plugin.patching",)) == []
