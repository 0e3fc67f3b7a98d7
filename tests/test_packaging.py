"""What `pip install gepo-plugin` users get: their own description, the licence, and an sdist whose tests run."""

from __future__ import annotations

import re
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
