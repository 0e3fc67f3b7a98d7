"""The plugin reaches every verl process through the entry point, and says so when it does not."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest

from gepo_plugin.names import expected_names


@pytest.mark.ray
def test_a_fresh_ray_actor_has_everything_registered_after_a_plain_import_verl():
    from gepo_plugin.doctor import probe_ray_actor

    report = probe_ray_actor()
    assert report["pid"] != os.getpid()
    assert report["entry_point_loaded"] is True
    assert report["status"]["registered"] is True
    assert report["registered"] == expected_names()


def _doctor(env_extra):
    env = {**os.environ, **env_extra}
    return subprocess.run(
        [sys.executable, "-m", "gepo_plugin", "doctor", "--no-ray"], capture_output=True, text=True, env=env
    )


def test_doctor_passes_here_and_fails_when_verl_plugins_are_disabled():
    ok = _doctor({})
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "policy losses:        gepo" in ok.stdout
    disabled = _doctor({"VERL_USE_EXTERNAL_PLUGINS": "none"})
    assert disabled.returncode == 1
    assert "did not load the plugin's entry point" in disabled.stdout


def test_registration_failure_is_logged_as_a_warning(monkeypatch, caplog):
    import verl  # noqa: F401

    from gepo_plugin.verl_glue import plugin

    monkeypatch.setattr(plugin, "registered_names", lambda: {k: [] for k in expected_names()})
    with caplog.at_level(logging.WARNING, logger="gepo_plugin"):
        assert plugin.register() is False
    assert "failed to register" in caplog.text and "gepo" in caplog.text
    assert "not registered after import" in plugin.STATUS["error"]
    monkeypatch.undo()
    assert plugin.register() is True


def test_unsupported_verl_versions_are_detected():
    from gepo_plugin.names import verl_version_supported

    assert verl_version_supported("0.9.1") and verl_version_supported("0.9.7")
    assert not verl_version_supported("0.9.0") and not verl_version_supported("0.10.0")


def test_demo_cli_runs_and_checks_group_semantics():
    result = subprocess.run(
        [sys.executable, "-m", "gepo_plugin", "demo", "--prompts", "3", "--micro-batches", "3"],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "OK: per-prompt group expectation is preserved" in result.stdout


def test_cli_help_explains_every_option():
    result = subprocess.run([sys.executable, "-m", "gepo_plugin", "demo", "--help"], capture_output=True, text=True)
    for option in ("--prompts", "--responses", "--micro-batches", "--seed"):
        assert option in result.stdout
    bad = subprocess.run(
        [sys.executable, "-m", "gepo_plugin", "demo", "--responses", "1"], capture_output=True, text=True
    )
    assert bad.returncode != 0 and "--responses >= 2" in bad.stderr + bad.stdout
