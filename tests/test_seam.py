"""The guarded seam: every private verl name the plugin touches is declared, checked, and fails only its feature."""

from __future__ import annotations

import importlib.util
import inspect
import logging

import pytest

from gepo_plugin.verl_glue import seam


@pytest.fixture(autouse=True)
def fresh_checks():
    seam.clear_cache()
    yield
    seam.clear_cache()


#: The features whose contacts live in verl's vLLM modules (they import only where a vLLM is installed).
VLLM_FEATURES = {"vllm_cpu", "vllm_engine_health"}
HAS_VLLM = importlib.util.find_spec("vllm") is not None


@pytest.fixture(autouse=True, scope="module")
def _verls_vllm_modules_import():
    """As in a CPU run with vLLM's CPU build: verl's vLLM modules then import, and their names can be checked."""
    from gepo_plugin.cpu_backend.vllm.install import answer_version_lookup

    answer_version_lookup()


def test_every_contact_has_the_expected_shape_in_the_installed_verl():
    rows = seam.report()
    assert {row["contact"] for row in rows} == set(seam.BY_NAME)
    checkable = [row for row in rows if HAS_VLLM or not VLLM_FEATURES & set(row["features"].split(", "))]
    assert [row for row in checkable if row["status"] != "ok"] == []
    for feature in seam.FEATURES:
        if HAS_VLLM or feature not in VLLM_FEATURES:
            seam.require(feature)


def test_every_feature_has_contacts_and_every_contact_a_known_feature():
    used = {feature for contact in seam.CONTACTS for feature in contact.features}
    assert used == set(seam.FEATURES)


def test_an_untested_version_gives_one_warning_naming_the_features(monkeypatch, caplog):
    monkeypatch.setattr(seam, "installed_version", lambda package: "0.9.9" if package == "verl" else None)
    monkeypatch.setattr(seam, "_WARNED", False)
    message = seam.untested_warning()
    assert "verl 0.9.9 (tested: 0.9.1)" in message
    for feature in ("hetero", "cpu_backend", "group_term"):
        assert feature in message
    with caplog.at_level(logging.WARNING, logger="gepo_plugin"):
        seam.warn_if_untested()
        seam.warn_if_untested()
    assert caplog.text.count("was not tested with") == 1


def test_the_tested_version_gives_no_warning():
    assert seam.untested_warning() is None


def test_a_missing_private_method_refuses_only_its_feature(monkeypatch):
    from verl.trainer.ppo.v1.replay_buffer import ReplayBuffer, ReplayBufferAsync

    monkeypatch.delattr(ReplayBuffer, "_select_prompt_uids")
    problems = seam.feature_problems("hetero")
    assert problems == {"verl.trainer.ppo.v1.replay_buffer.ReplayBufferAsync._select_prompt_uids": "missing"}
    with pytest.raises(seam.SeamError, match=r"hetero .*ReplayBufferAsync\._select_prompt_uids: missing"):
        seam.require("hetero")
    seam.require("group_term", "cpu_backend", "metric_aggregation")  # the other features still start
    assert not hasattr(ReplayBufferAsync, "_select_prompt_uids")


def test_the_hetero_replay_buffer_refuses_to_start_without_its_contacts(monkeypatch):
    from verl.trainer.ppo.v1.replay_buffer import ReplayBuffer

    from gepo_plugin.verl_glue.hetero.replay_buffer import HeteroReplayBuffer

    monkeypatch.delattr(ReplayBuffer, "_materialize_batch", raising=True)  # not a contact: no effect
    seam.require("hetero")
    monkeypatch.delattr(ReplayBuffer, "_wait_for_next_poll")
    seam.clear_cache()
    with pytest.raises(seam.SeamError, match="_wait_for_next_poll"):
        HeteroReplayBuffer(
            trainer_mode="separate_async",
            trainer_config=None,
            max_off_policy_threshold=None,
            max_off_policy_strategy="wait",
            sampler_kwargs={"enable": True},
        )


def test_a_changed_signature_or_tuple_layout_is_caught(monkeypatch):
    from verl.trainer.ppo.v1.replay_buffer import ReplayBufferAsync

    def changed(self, global_steps, partition_id, batch_size, sampleable_keys, extra): ...

    monkeypatch.setattr(ReplayBufferAsync, "_has_enough_samples", changed)
    name = "verl.trainer.ppo.v1.replay_buffer.ReplayBufferAsync._has_enough_samples"
    assert seam.feature_problems("hetero") == {}  # a prefix of the parameters is what the plugin relies on
    seam.clear_cache()

    def renamed(self, steps, partition_id, batch_size, sampleable_keys): ...

    monkeypatch.setattr(ReplayBufferAsync, "_has_enough_samples", renamed)
    assert "parameters changed" in seam.feature_problems("hetero")[name]
    seam.clear_cache()

    def new_layout(self, global_steps: int, partition_id: str) -> tuple[set[str], set[str]]: ...

    monkeypatch.setattr(ReplayBufferAsync, "_terminal_eviction_reasons", new_layout)
    layout = "verl.trainer.ppo.v1.replay_buffer.ReplayBufferAsync._terminal_eviction_reasons"
    assert "return layout changed" in seam.feature_problems("hetero")[layout]


def test_a_patch_refuses_when_its_target_is_gone(monkeypatch):
    import verl.trainer.ppo.v1.trainer_separate_async as module

    from gepo_plugin.patches.hybrid_engine_off import PATCH
    from gepo_plugin.patching import APPLIED, apply

    monkeypatch.delattr(module, "logger")
    before = list(APPLIED)
    with pytest.raises(seam.SeamError, match=r"trainer_separate_async\.logger: missing"):
        apply(PATCH)
    assert before == APPLIED


def test_the_doctor_table_shows_a_missing_contact(monkeypatch, capsys):
    from verl.workers.rollout import base

    from gepo_plugin.doctor import _print_seam

    monkeypatch.delattr(base, "_ROLLOUT_REGISTRY")
    broken = _print_seam()
    out = capsys.readouterr().out
    assert broken == ["cpu_backend"]
    assert "verl.workers.rollout.base._ROLLOUT_REGISTRY" in out and "missing" in out


def _plugin_classes_over_verl():
    """Every plugin class that subclasses a verl class (trainers, sampler, rollout, engines, platform)."""
    import gepo_plugin.cpu_backend.platform as platform
    import gepo_plugin.cpu_backend.ray_mailbox_engine as mailbox
    import gepo_plugin.cpu_backend.rollout.adapter as adapter
    import gepo_plugin.cpu_backend.rollout.replica as replica
    import gepo_plugin.verl_glue.config as config
    import gepo_plugin.verl_glue.hetero.replay_buffer as replay_buffer
    import gepo_plugin.verl_glue.trainers as trainers

    classes = []
    for module in (adapter, replica, platform, mailbox, config, replay_buffer, trainers):
        for value in vars(module).values():
            ours = inspect.isclass(value) and value.__module__ == module.__name__
            if ours and any(base.__module__.startswith("verl.") for base in value.__mro__[1:]):
                classes.append(value)
    return classes


def _declared_methods() -> set[tuple[type, str]]:
    """(verl class, method name) of every declared contact that is a method."""
    import importlib

    out = set()
    for contact in seam.CONTACTS:
        *path, name = contact.qualname.split(".")
        owner = importlib.import_module(contact.module)
        for part in path:
            owner = getattr(owner, part)
        if inspect.isclass(owner):
            out.add((owner, name))
    return out


def test_every_private_verl_method_the_plugin_overrides_is_a_declared_contact():
    """The structural guarantee: a new override of a private verl method cannot slip past the seam. An override
    is covered when a contact names that method on a verl class in the plugin class's MRO."""
    declared = _declared_methods()
    found, undeclared = [], []
    for cls in _plugin_classes_over_verl():
        verl_bases = [b for b in cls.__mro__ if b.__module__.startswith("verl.")]
        for owner in (b for b in cls.__mro__ if b.__module__.startswith("gepo_plugin.")):
            for name, value in vars(owner).items():
                if not name.startswith("_") or name.startswith("__") or not inspect.isfunction(value):
                    continue
                if not any(name in vars(base) for base in verl_bases):
                    continue  # the plugin's own helper
                found.append((cls.__name__, name))
                if not any((base, name) in declared for base in verl_bases):
                    undeclared.append(f"{cls.__name__}.{name}")
    assert ("GEPOTrainerSync", "_compute_advantage") in found and ("HeteroReplayBuffer", "_select_prompt_uids") in found
    assert sorted(set(undeclared)) == []


def test_no_module_reads_a_private_verl_name_except_through_the_seam():
    """Outside the seam, no code touches ``<something imported from verl>._private`` or imports a private name."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    offences = []
    for path in [*(root / "gepo_plugin").rglob("*.py"), *(root / "patches").glob("*.py")]:
        if path.name == "seam.py":
            continue
        tree = ast.parse(path.read_text())
        verl_names = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "verl":
                for alias in node.names:
                    verl_names.add(alias.asname or alias.name)
                    if alias.name.startswith("_"):
                        offences.append(f"{path.name}:{node.lineno} imports {alias.name}")
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.split(".")[0] == "verl":
                        verl_names.add(alias.asname or alias.name.split(".")[0])
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
                and isinstance(node.value, ast.Name)
                and node.value.id in verl_names
            ):
                offences.append(f"{path.relative_to(root)}:{node.lineno} {node.value.id}.{node.attr}")
    assert offences == []
