"""What `pip install gepo-plugin` and `pip install gepo-sampler` users get: their own description, the licence, an sdist
whose tests run, and two wheels that share no file."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tarfile
from email.parser import Parser
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_sdist_carries_the_licence_the_test_helpers_and_a_pip_users_description(tmp_path):
    from setuptools import build_meta

    archive = tmp_path / build_meta.build_sdist(str(tmp_path))
    with tarfile.open(archive) as tar:
        names = {name.split("/", 1)[1] for name in tar.getnames() if "/" in name}
        info = Parser().parsestr(
            tar.extractfile(next(n for n in tar.getnames() if n.endswith("/PKG-INFO"))).read().decode()
        )
    test_files = {name for name in names if name.startswith("tests/")}
    imported = {
        f"tests/{module}.py"
        for path in (ROOT / "tests").glob("*.py")
        for module in re.findall(r"^from (\w+) import", path.read_text(), re.M)
        if (ROOT / "tests" / f"{module}.py").exists()
    }
    assert {"tests/conftest.py", "tests/reference.py"} | imported <= test_files  # the tests' own helpers
    assert {"LICENSE", "gepo_plugin/config/gepo_trainer.yaml"} <= names
    # the documentation site's sources, so tests/test_docs.py builds it from the sdist too; no build output
    assert {"docs/conf.py", "docs/_ext/gepo_reference.py", "docs/index.md", "ARCHITECTURE.md"} <= names
    assert not any(name.startswith(("docs/_build/", "docs/reference/_generated/")) for name in names)
    assert info["License-Expression"] == "Apache-2.0" and "Apache License" in (ROOT / "LICENSE").read_text()
    description = info.get_payload()
    assert not description.lstrip().startswith("```") and "bash run.sh" not in description  # not the repo README
    assert 'pip install "gepo-plugin[math]"' in description and "python -m gepo_plugin doctor" in description
    assert not re.search(r"\]\((?!https?://)[^)]+\)", description), "links must be absolute for PyPI"


def test_the_wheel_carries_every_module_of_the_package_and_the_patches(tmp_path):
    import zipfile

    from setuptools import build_meta

    wheel = tmp_path / build_meta.build_wheel(str(tmp_path))
    with zipfile.ZipFile(wheel) as archive:
        shipped = {name for name in archive.namelist() if name.endswith(".py")}
    expected = {str(path.relative_to(ROOT)) for path in (ROOT / "gepo_plugin").rglob("*.py")}
    expected |= {f"gepo_plugin/patches/{path.name}" for path in (ROOT / "patches").glob("*.py")}
    assert expected - shipped == set(), "list the missing packages in pyproject.toml [tool.setuptools] packages"


#: what the learner's stack brings, which a sampler host beside a user's vLLM must not
LEARNER_STACK = {
    "verl",
    "ray",
    "hydra-core",
    "transferqueue",
    "transfer-queue",
    "megatron-core",
    "mbridge",
    "omegaconf",
}


def _wheel(project: Path, out: Path) -> tuple[set[str], list[str]]:
    """Build ``project``'s wheel into ``out`` (its own process: setuptools keeps state between builds in one) and
    return its files (dist-info aside) and its Requires-Dist lines."""
    import zipfile

    code = "import sys; from setuptools import build_meta; print(build_meta.build_wheel(sys.argv[1]))"
    done = subprocess.run(
        [sys.executable, "-c", code, str(out)], cwd=project, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    with zipfile.ZipFile(out / done.stdout.strip().splitlines()[-1]) as archive:
        names = archive.namelist()
        metadata = archive.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    files = {name for name in names if ".dist-info/" not in name}
    return files, Parser().parsestr(metadata).get_all("Requires-Dist") or []


def test_the_sampler_hosts_wheel_ships_its_package_and_nothing_of_the_learners(tmp_path):
    """Two distributions from one repository, no file in both: gepo-sampler ships every module of gepo_sampler, the
    learner's wheel none of them; the host's requirements hold nothing of the learner's stack and pin nothing vLLM
    chooses, and the learner requires this very version of it."""
    (tmp_path / "host").mkdir()
    (tmp_path / "learner").mkdir()
    # built from a copy: test.sh installs sampler/ (editable, its egg-info in place) while this phase runs
    source = shutil.copytree(
        ROOT / "sampler", tmp_path / "sampler", ignore=shutil.ignore_patterns("build", "*.egg-info")
    )
    host_files, host_requires = _wheel(source, tmp_path / "host")
    learner_files, learner_requires = _wheel(ROOT, tmp_path / "learner")
    expected = {str(path.relative_to(ROOT / "sampler")) for path in (ROOT / "sampler/gepo_sampler").rglob("*.py")}
    assert expected <= host_files and all(name.startswith("gepo_sampler/") for name in host_files), host_files
    assert host_files & learner_files == set()
    assert not any(name.startswith("gepo_sampler/") for name in learner_files)
    names = {re.split(r"[\s<>=!~;\[(]", line, maxsplit=1)[0].lower() for line in host_requires}
    assert names & LEARNER_STACK == set(), names
    assert next(line for line in host_requires if line.split(";")[0].strip().lower() == "torch")  # never pinned
    assert "transformers" not in names
    version = re.search(r'^version = "([^"]+)"', (ROOT / "sampler/pyproject.toml").read_text(), re.M).group(1)
    assert f"gepo-sampler=={version}" in learner_requires
