"""The plugin on a verl it was not written for: refusals stop the run up front, moved names are found, and calls pass
only the keyword arguments the installed verl takes.

A readiness probe of verl's main branch (0.10.0.dev) under the plugin found three ways it failed late: a patch that
refused was only recorded (the run died later in torch: ``Duplicate device type cpu``), ``GlobalRequestLoadBalancer``
was reached through a module the snapshot no longer has, and verl's buffer was handed ``max_off_policy_threshold=None``,
which the snapshot asserts is an int. Each is simulated here on the installed verl.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import logging
import os
import subprocess
import sys

import pytest
from cpu_runs import valid_gepo_command

from gepo_plugin import patching
from gepo_plugin.tiny import write_all
from gepo_plugin.verl_glue import registration, seam

BALANCER = "verl.workers.rollout.llm_server.GlobalRequestLoadBalancer"
BUFFER_INIT = "verl.trainer.ppo.v1.replay_buffer.ReplayBufferAsync.__init__"
ABORT = "verl.checkpoint_engine.base.CheckpointEngineManager.abort_replicas"


@pytest.fixture(autouse=True)
def fresh_checks():
    seam.clear_cache()
    yield
    seam.clear_cache()


@pytest.fixture
def declare(monkeypatch):
    """Declare an extra contact for one test."""

    def add(contact: seam.Contact) -> seam.Contact:
        monkeypatch.setattr(seam, "CONTACTS", (*seam.CONTACTS, contact))
        monkeypatch.setitem(seam.BY_NAME, contact.name, contact)
        for module, qualname in contact.locations:
            monkeypatch.setitem(seam._BY_ANY_NAME, f"{module}.{qualname}", contact)
        return contact

    return add


# ---------------------------------------------------------------- (b) a contact found where verl moved it


def _moved_balancer(fallback: str) -> seam.Contact:
    """verl's load balancer declared where no verl has it, with one fallback location."""
    return seam.Contact(
        "verl.workers.rollout.no_such_module",
        "GlobalRequestLoadBalancer",
        ("learner_placement",),
        "read",
        fallbacks=(fallback,),
    )


def test_a_contact_whose_first_location_is_gone_resolves_through_its_fallback(declare):
    from verl.workers.rollout import router

    contact = declare(_moved_balancer("verl.workers.rollout.router:GlobalRequestLoadBalancer"))
    assert seam.problem(contact.name) is None
    assert seam.resolve(contact.name) is router.GlobalRequestLoadBalancer
    assert seam.resolve("verl.workers.rollout.router.GlobalRequestLoadBalancer") is router.GlobalRequestLoadBalancer
    assert seam.resolved_at(contact.name) == "verl.workers.rollout.router.GlobalRequestLoadBalancer"
    row = next(row for row in seam.report(["learner_placement"]) if row["contact"] == contact.name)
    assert row["status"] == "ok"
    assert row["note"] == "at verl.workers.rollout.router.GlobalRequestLoadBalancer (a fallback)"


def test_a_contact_found_nowhere_names_every_location_tried(declare):
    contact = declare(_moved_balancer("verl.workers.rollout.llm_server:NoSuchBalancer"))
    found = seam.problem(contact.name)
    assert found.startswith("found at none of its 2 locations")
    assert (
        "verl.workers.rollout.no_such_module.GlobalRequestLoadBalancer: module verl.workers.rollout.no_such_module "
        "cannot be imported (ModuleNotFoundError" in found
    )
    assert "verl.workers.rollout.llm_server.NoSuchBalancer: missing" in found
    with pytest.raises(seam.SeamError, match=r"no_such_module\.GlobalRequestLoadBalancer.*llm_server\.NoSuchBalancer"):
        seam.resolve(contact.name)
    assert seam.resolved_at(contact.name) is None


def test_the_load_balancer_is_declared_where_verl_keeps_it_with_the_old_module_as_fallback(monkeypatch):
    """verl 0.9.1 defines it in ``router`` and re-exports it from ``llm_server``; verl's main has no ``router``."""
    from verl.workers.rollout import llm_server, router

    for name in (BALANCER, f"{BALANCER}.remove_servers", f"{BALANCER}.add_servers"):
        assert name in seam.BY_NAME and seam.BY_NAME[name].fallbacks
        assert seam.resolved_at(name) == name
    assert seam.resolve(BALANCER) is router.GlobalRequestLoadBalancer
    # the snapshot's opposite case: the name gone from the declared module, still in the fallback's
    monkeypatch.delattr(llm_server, "GlobalRequestLoadBalancer")
    seam.clear_cache()
    assert seam.resolve(f"{BALANCER}.remove_servers") is router.GlobalRequestLoadBalancer.remove_servers
    assert seam.resolved_at(BALANCER) == "verl.workers.rollout.router.GlobalRequestLoadBalancer"
    seam.require("elastic_samplers", "learner_placement")
    # and gone from both: the feature refuses, naming both places
    monkeypatch.setitem(sys.modules, "verl.workers.rollout.router", None)  # as if the module did not exist
    seam.clear_cache()
    with pytest.raises(seam.SeamError) as refused:
        seam.require("elastic_samplers")
    assert "llm_server.GlobalRequestLoadBalancer.remove_servers: missing" in str(refused.value)
    assert "module verl.workers.rollout.router cannot be imported" in str(refused.value)


def test_replace_sets_the_name_where_it_resolved(declare, monkeypatch):
    from verl.workers.rollout import router

    monkeypatch.setattr(router, "DEFAULT_ROUTING_CACHE_SIZE", router.DEFAULT_ROUTING_CACHE_SIZE)  # restored after
    contact = declare(
        seam.Contact(
            "verl.workers.rollout.no_such_module",
            "DEFAULT_ROUTING_CACHE_SIZE",
            ("learner_placement",),
            "replace",
            fallbacks=("verl.workers.rollout.router:DEFAULT_ROUTING_CACHE_SIZE",),
        )
    )
    original = seam.replace(contact.name, 7)
    assert original == 10000 and router.DEFAULT_ROUTING_CACHE_SIZE == 7


# ---------------------------------------------------------------- (c) only the keyword arguments verl takes


def test_the_installed_verl_takes_both_optional_keywords():
    assert seam.accepted_kwargs(BUFFER_INIT, max_off_policy_threshold=seam.NO_BOUND) == {
        "max_off_policy_threshold": None  # 0.9.1: None switches verl's own bound off
    }
    assert seam.accepted_kwargs(ABORT, reject_request=True) == {"reject_request": True}
    assert seam.kwargs_note(BUFFER_INIT) == "takes max_off_policy_threshold"


def test_a_parameter_that_wants_an_int_gets_a_bound_no_run_reaches(monkeypatch):
    """verl's main: ``max_off_policy_threshold: int``, asserted positive (and compared with step spans)."""
    from verl.trainer.ppo.v1.replay_buffer import ReplayBuffer

    original = ReplayBuffer.__init__
    seen = []

    def snapshot_init(
        self,
        trainer_mode,
        trainer_config,
        max_off_policy_threshold: int,
        max_off_policy_strategy,
        sampler_kwargs,
        **rest,
    ):
        assert isinstance(max_off_policy_threshold, int) and max_off_policy_threshold > 0
        seen.append(max_off_policy_threshold)
        original(
            self,
            trainer_mode,
            trainer_config,
            max_off_policy_threshold,
            max_off_policy_strategy,
            sampler_kwargs,
            **rest,
        )

    monkeypatch.setattr(ReplayBuffer, "__init__", snapshot_init)
    assert seam.accepted_kwargs(BUFFER_INIT, max_off_policy_threshold=seam.NO_BOUND) == {
        "max_off_policy_threshold": seam.UNREACHED_BOUND
    }
    from conftest import hetero_buffer

    buffer = hetero_buffer()  # verl's trainer passes max_off_policy_threshold=8; verl is handed the unreached bound
    assert seen == [seam.UNREACHED_BOUND] and buffer.max_off_policy_threshold == seam.UNREACHED_BOUND


def test_on_the_tested_verl_the_buffer_still_switches_verls_bound_off_with_none():
    from conftest import hetero_buffer

    assert hetero_buffer().max_off_policy_threshold is None  # verl's trainer passed 8


def test_a_keyword_the_installed_version_does_not_take_is_left_out_and_recorded(monkeypatch, caplog):
    from verl.checkpoint_engine.base import CheckpointEngineManager

    async def abort_replicas(self): ...  # verl's main: no reject_request there

    monkeypatch.setattr(CheckpointEngineManager, "abort_replicas", abort_replicas)
    monkeypatch.setattr(seam, "LEFT_OUT", {})
    with caplog.at_level(logging.DEBUG, logger="gepo_plugin"):
        assert seam.accepted_kwargs(ABORT, reject_request=True) == {}
        assert seam.accepted_kwargs(ABORT, reject_request=False) == {}
    assert dict(seam.LEFT_OUT) == {ABORT: {"reject_request"}}
    assert caplog.text.count("takes no reject_request=") == 1
    assert seam.kwargs_note(ABORT) == "leaves out reject_request"


def test_a_callable_with_var_keywords_takes_every_keyword(monkeypatch):
    from verl.checkpoint_engine.base import CheckpointEngineManager

    async def abort_replicas(self, **kwargs): ...

    monkeypatch.setattr(CheckpointEngineManager, "abort_replicas", abort_replicas)
    assert seam.accepted_kwargs(ABORT, reject_request=True) == {"reject_request": True}


def test_no_bound_follows_the_parameters_annotation():
    def fn(a: int | None, b: int, c: float, d, e: str, f: int = None, g: "Optional[int]" = 3): ...  # noqa: F821, UP037, RUF013

    parameters = inspect.signature(fn).parameters
    expected = {"a": None, "b": seam.UNREACHED_BOUND, "c": float("inf"), "d": None, "e": None, "f": None, "g": None}
    assert {name: seam._no_bound(parameters[name]) for name in expected} == expected
    assert seam._no_bound(None) is None  # reached through **kwargs


def test_only_declared_keywords_are_filtered():
    with pytest.raises(ValueError, match=r"not declared in its Contact\.optional_kwargs"):
        seam.accepted_kwargs(ABORT, reject_requests=True)
    with pytest.raises(KeyError, match="not a contact declared"):
        seam.accepted_kwargs("verl.no.such.name", x=1)


# ---------------------------------------------------------------- (a) a needed patch that refuses stops the run


def _bad_pin(patch: patching.Patch) -> patching.Patch:
    return dataclasses.replace(patch, versions={"verl": "==0.0.1"})


def test_every_patch_belongs_to_a_seam_feature():
    patches = patching.all_patches()
    assert {"gloo_process_group", "server_identity", "vllm_cpu_version"} <= {patch.name for patch in patches}
    assert {patch.feature for patch in patches} <= set(seam.FEATURES)


def test_the_patches_of_the_needed_features_are_checked(installed_versions, monkeypatch):
    patching.require_patches(["cpu_backend", "hetero", "group_term"])  # the installed versions: nothing refuses
    installed_versions(verl="0.10.0.dev0")  # the probe's snapshot
    refused = {patch.name for patch, _ in patching.refusing_patches(["cpu_backend"])}
    assert refused == {"gloo_process_group"}
    with pytest.raises(patching.PatchVersionError) as stop:
        patching.require_patches(["cpu_backend", "group_term"])
    message = str(stop.value)
    assert "gloo_process_group (feature cpu_backend): it was written for verl ==0.9.1 but verl 0.10.0.dev0" in message
    assert "duplicate device type" in message  # what it fixes
    assert "pip install 'verl==0.9.1'" in message and "GEPO_SKIP_PATCHES=gloo_process_group" in message
    patching.require_patches(["group_term", "metric_aggregation"])  # GEPO on GPUs needs no patch
    assert "the patch 'gloo_process_group'" in patching.first_version_problem(["gloo_process_group"])
    monkeypatch.setenv(patching.SKIP_ENV, "gloo_process_group")  # left out by request: nothing to refuse
    patching.require_patches(["cpu_backend"])
    assert patching.first_version_problem(["gloo_process_group"]) is None  # the Megatron and vLLM checks' helper


def test_a_needed_patch_refusing_at_run_time_is_raised_not_only_recorded(monkeypatch):
    from gepo_plugin.patches.gloo_process_group import PATCH

    monkeypatch.setattr(registration, "ERRORS", {})
    with pytest.raises(patching.PatchVersionError, match="gloo_process_group"):
        registration.run_recorded("apply the gloo patch", lambda: patching.apply(_bad_pin(PATCH)))
    assert "PatchVersionError" in registration.ERRORS["apply the gloo patch"]
    # a patch applied beyond its feature's processes (the vLLM version answer) is only recorded
    beyond = dataclasses.replace(_bad_pin(PATCH), name="answer", applied_beyond_feature=True)
    registration.run_recorded("answer", lambda: patching.apply(beyond))
    assert "PatchVersionError" in registration.ERRORS["answer"]
    registration.run_recorded("register", lambda: __import__("gepo_plugin.no_such_module"))  # as before: recorded
    assert "ModuleNotFoundError" in registration.ERRORS["register"]


def test_an_optional_patch_still_only_warns(monkeypatch, caplog):
    from gepo_plugin.patches.server_identity import PATCH

    monkeypatch.setattr(registration, "ERRORS", {})
    bad = _bad_pin(PATCH)
    monkeypatch.setattr(patching, "named_patch", lambda name: bad)
    registration.run_recorded(
        "tag", lambda: patching.apply_optional("server_identity", "metrics lost", logging.getLogger())
    )
    assert registration.ERRORS == {} and "metrics lost" in caplog.text


def test_the_doctor_lists_every_patch_and_whether_it_applies(installed_versions, capsys):
    from gepo_plugin.doctor import _print_patches

    installed_versions(verl="0.10.0.dev0")
    _print_patches()
    out = capsys.readouterr().out
    line = next(line for line in out.splitlines() if "gloo_process_group" in line)
    assert "[cpu_backend]" in line and "written for verl ==0.9.1 but verl 0.10.0.dev0 is installed" in line
    assert "mbridge_local_weight_names" in out  # every patch, not only those of one feature


RUN_WITH_A_REFUSING_PATCH = """
import dataclasses, sys
from gepo_plugin.patches import gloo_process_group as module

module.PATCH = dataclasses.replace(module.PATCH, versions={"verl": "==0.0.1"})
from gepo_plugin import main_ppo

try:
    main_ppo.main(sys.argv[1:])
finally:
    import ray

    print("RAY_STARTED", ray.is_initialized(), file=sys.stderr)
"""


@pytest.fixture(scope="module")
def cpu_command(tmp_path_factory) -> list[str]:
    return [*valid_gepo_command(write_all(tmp_path_factory.mktemp("tiny"))), "trainer.device=cpu"]


def _python(code: str, *args: str, **env: str) -> subprocess.CompletedProcess:
    environment = {key: value for key, value in os.environ.items() if key not in ("VERL_PLATFORM", patching.SKIP_ENV)}
    return subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, env={**environment, **env}, timeout=300
    )


@pytest.mark.slow
def test_the_launcher_refuses_a_cpu_run_whose_gloo_patch_refuses_before_ray(cpu_command):
    result = _python(RUN_WITH_A_REFUSING_PATCH, *cpu_command, "--cfg", "job")
    assert result.returncode == 2, result.stderr[-3000:]
    assert "gepo-plugin: configuration error: the run needs patches that refuse" in result.stderr
    assert "gloo_process_group (feature cpu_backend): it was written for verl ==0.0.1" in result.stderr
    assert "RAY_STARTED False" in result.stderr and result.stdout == ""  # nothing printed, nothing started
    # left out by request, the same command gets through (and prints the config)
    skipped = _python(RUN_WITH_A_REFUSING_PATCH, *cpu_command, "--cfg", "job", GEPO_SKIP_PATCHES="gloo_process_group")
    assert skipped.returncode == 0, skipped.stderr[-3000:]
    assert "device: cpu" in skipped.stdout


@pytest.mark.slow
def test_a_cpu_process_whose_gloo_patch_refuses_fails_at_the_import_that_needs_it():
    """A Ray worker whose versions differ from the launcher's: the import of verl's engine workers raises the patch's
    refusal instead of torch's ``Duplicate device type cpu`` later."""
    code = """
import dataclasses, json
from gepo_plugin.patches import gloo_process_group as module

module.PATCH = dataclasses.replace(module.PATCH, versions={"verl": "==0.0.1"})
import verl

try:
    from verl.workers import engine_workers
    print(json.dumps({"raised": None}))
except Exception as error:
    print(json.dumps({"raised": type(error).__name__, "message": str(error)}))
"""
    result = _python(code, VERL_PLATFORM="cpu")
    assert result.returncode == 0, result.stderr[-3000:]
    found = json.loads(result.stdout.strip().splitlines()[-1])
    assert found["raised"] == "PatchVersionError" and "gloo_process_group" in found["message"], found
