"""verl's Megatron engine on the CPU backend: its settings, its start-up checks and its patches, on the real
megatron-core 0.16.1 and mbridge 0.15.1 (the ``[megatron-cpu]`` extra). The end-to-end runs through verl's real
trainer are in ``test_cpu_megatron_e2e.py``.

The patch tests run megatron-core in a subprocess (``VERL_PLATFORM=cpu``, a one-rank gloo group, megatron's
``initialize_model_parallel(1, 1)``), because the patches change process-wide state and must not leak into the
rest of the suite.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from free_ports import free_port
from omegaconf import OmegaConf

from gepo_plugin.cpu_backend.megatron.settings import MODEL_REQUIREMENTS, ROLE_REQUIREMENTS, requirements
from gepo_plugin.launch import compose_config, settled_config
from gepo_plugin.patches.cuda_as_cpu import cuda_as_cpu, is_cuda_device, under_cuda_as_cpu
from gepo_plugin.patches.mbridge_local_weight_names import te_name
from gepo_plugin.verl_glue.errors import PluginConfigError

MICRO = [
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2",
    "actor_rollout_ref.rollout.n=4",
    "algorithm.loss=gepo",
]
CPU_MEGATRON = ["trainer.device=cpu", "model_engine=megatron", *MICRO]
ACTOR = "actor_rollout_ref.actor.megatron"


# ---------------------------------------------------------------- settings and start-up checks
def test_a_cpu_megatron_run_gets_every_setting_it_needs():
    config = settled_config(CPU_MEGATRON)
    assert config.actor_rollout_ref.actor.strategy == "megatron"
    keys = {r.key for r in requirements(config)}
    assert f"{ACTOR}.use_mbridge" in keys and "actor_rollout_ref.model.use_remove_padding" in keys
    for requirement in requirements(config):
        assert OmegaConf.select(config, requirement.key) == requirement.value, requirement.key
    # verl's defaults for these are what a CPU cannot run: the launcher really changed them
    composed = compose_config(CPU_MEGATRON)
    changed = {r.key for r in requirements(config) if OmegaConf.select(composed, r.key) != r.value}
    assert {f"{ACTOR}.override_transformer_config.use_cpu_initialization", f"{ACTOR}.vanilla_mbridge"} <= changed


def test_a_user_value_that_agrees_is_kept_and_fsdp_runs_get_no_megatron_setting():
    config = settled_config([*CPU_MEGATRON, f"{ACTOR}.dtype=bfloat16", f"{ACTOR}.use_distributed_optimizer=true"])
    assert config.actor_rollout_ref.actor.megatron.dtype == "bfloat16"
    fsdp = settled_config(["trainer.device=cpu", *MICRO])
    assert fsdp.actor_rollout_ref.actor.strategy == "fsdp2"
    assert OmegaConf.select(fsdp, f"{ACTOR}.use_mbridge", default=None) is None  # no megatron subtree at all


def test_a_gpu_host_sees_no_change_from_the_cpu_backend():
    """Without ``trainer.device=cpu``, a Megatron config runs exactly as Hydra composed it, Megatron keys and all."""
    overrides = ["model_engine=megatron", *MICRO]
    composed, settled = compose_config(overrides), settled_config(overrides)
    for key in ("actor_rollout_ref.actor.megatron", "actor_rollout_ref.ref.megatron", "actor_rollout_ref.model"):
        assert OmegaConf.to_container(OmegaConf.select(settled, key)) == OmegaConf.to_container(
            OmegaConf.select(composed, key)
        ), key
    assert settled.actor_rollout_ref.actor.megatron.use_distributed_optimizer is True  # verl's default, untouched
    assert settled.actor_rollout_ref.actor.megatron.override_transformer_config.get("attention_backend") != "local"


@pytest.mark.parametrize(
    ("override", "key"),
    [
        (f"{ACTOR}.tensor_model_parallel_size=2", f"{ACTOR}.tensor_model_parallel_size"),
        (f"{ACTOR}.pipeline_model_parallel_size=2", f"{ACTOR}.pipeline_model_parallel_size"),
        ("actor_rollout_ref.model.use_remove_padding=true", "actor_rollout_ref.model.use_remove_padding"),
        (f"{ACTOR}.override_transformer_config.attention_backend=flash", "attention_backend"),
        (f"{ACTOR}.use_distributed_optimizer=false", f"{ACTOR}.use_distributed_optimizer"),
        (f"{ACTOR}.dtype=float16", f"{ACTOR}.dtype"),
    ],
)
def test_a_setting_a_cpu_cannot_run_stops_at_start_up_naming_the_key_and_the_fix(override, key):
    with pytest.raises(PluginConfigError) as error:
        settled_config([*CPU_MEGATRON, override])
    assert key in str(error.value) and "Fix:" in str(error.value)


@pytest.mark.parametrize(
    ("versions", "named"),
    [({"megatron-core": None}, "megatron-core"), ({"mbridge": "0.15.2"}, "mbridge 0.15.2")],
)
def test_a_missing_or_other_extra_stops_at_start_up_with_the_pip_command(installed_versions, versions, named):
    installed_versions(**versions)
    with pytest.raises(PluginConfigError) as error:
        settled_config(CPU_MEGATRON)
    message = str(error.value)
    assert named in message and "pip install 'gepo-plugin[megatron-cpu]'" in message
    settled_config(["trainer.device=cpu", *MICRO])  # an FSDP2 run does not need the extra


def test_every_requirement_explains_itself():
    for requirement in (*ROLE_REQUIREMENTS, *MODEL_REQUIREMENTS):
        assert len(requirement.why) > 20, requirement.key


# ---------------------------------------------------------------- the CUDA-to-CPU mode (in process: it is scoped)
def test_the_cuda_as_cpu_mode_maps_cuda_placements_inside_its_block_only():
    assert is_cuda_device("cuda:1") and is_cuda_device(0) and is_cuda_device(torch.device("cuda"))
    assert not is_cuda_device("cpu") and not is_cuda_device(True)
    x = torch.ones(3)
    with cuda_as_cpu():
        made = torch.zeros(2, device="cuda")
        moved = x.to("cuda:0")
        assert made.device.type == "cpu" and moved.device.type == "cpu"
        assert x.cuda() is x and x.pin_memory() is x
        assert x.type() == "torch.cuda.FloatTensor"  # megatron's optimizer accepts only CUDA type names
        assert torch.empty(2, pin_memory=True).device.type == "cpu"
    assert x.type() == "torch.FloatTensor"
    if not torch.cuda.is_available():
        with pytest.raises((RuntimeError, AssertionError)):
            torch.zeros(2, device="cuda")  # outside the block, torch's own behaviour


def test_generators_returned_by_a_wrapped_method_step_under_the_mode():
    """verl's ``get_per_tensor_param`` returns a generator that runs later, during the weight sync."""

    def per_tensor():
        for _ in range(2):
            yield torch.zeros(1, device="cuda")

    def pair():
        return per_tensor(), "meta"

    wrapped = under_cuda_as_cpu(per_tensor)
    assert [t.device.type for t in wrapped()] == ["cpu", "cpu"]
    generator, meta = under_cuda_as_cpu(pair)()
    assert meta == "meta" and [t.device.type for t in generator] == ["cpu", "cpu"]
    assert under_cuda_as_cpu(wrapped) is wrapped


def test_local_layer_norm_names_map_to_the_fused_names_mbridge_knows():
    assert (
        te_name("decoder.layers.3.input_layernorm.weight")
        == "decoder.layers.3.self_attention.linear_qkv.layer_norm_weight"
    )
    assert te_name("decoder.layers.0.pre_mlp_layernorm.weight") == "decoder.layers.0.mlp.linear_fc1.layer_norm_weight"
    assert te_name("decoder.final_layernorm.weight") == "decoder.final_layernorm.weight"
    assert te_name("embedding.word_embeddings.weight") == "embedding.word_embeddings.weight"


# ---------------------------------------------------------------- the patches on real megatron-core (subprocess)
PATCH_PROBE = r"""
import json, os, warnings
warnings.filterwarnings("ignore")
os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ["PROBE_PORT"])
import torch
torch.distributed.init_process_group("gloo")
from megatron.core import parallel_state, tensor_parallel
parallel_state.initialize_model_parallel(1, 1)
from gepo_plugin.cpu_backend.megatron.engines import PATCH_NAMES, apply_megatron_cpu_patches
from gepo_plugin.patches.cuda_as_cpu import cuda_as_cpu
out = {"applied": apply_megatron_cpu_patches(), "patch_names": list(PATCH_NAMES)}
out["current_device"] = torch.cuda.current_device()

# RNG tracker: verl's seeding path, then a fork draws from the named CPU state and leaves the outer stream alone
tensor_parallel.model_parallel_cuda_manual_seed(1234)
tracker = tensor_parallel.get_cuda_rng_tracker()
out["tracker"] = type(tracker).__name__
tracker.add("probe", 77)
torch.manual_seed(5)
with tracker.fork("probe"):
    forked = torch.rand(4)
outer = torch.rand(4)
torch.manual_seed(5)
out["outer_untouched"] = torch.equal(outer, torch.rand(4))
out["fork_is_seeded_state"] = torch.equal(forked, torch.rand(4, generator=torch.Generator().manual_seed(77)))
saved = tracker.get_states()
with tracker.fork("probe"):
    a = torch.rand(3)
tracker.set_states(saved)
with tracker.fork("probe"):
    b = torch.rand(3)
out["states_round_trip"] = torch.equal(a, b)

# padding-aware local attention == causal attention over the real keys, computed by hand
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.enums import AttnMaskType
from gepo_plugin.patches.mbridge_local_layer_spec import padding_aware_attention_class
config = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=2, use_cpu_initialization=True,
                           attention_backend="local", masked_softmax_fusion=False, attention_dropout=0.0)
s, b, h, d = 5, 2, 2, 8
torch.manual_seed(0)
q, k, v = (torch.randn(s, b, h, d) for _ in range(3))
real = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]], dtype=torch.bool)
with cuda_as_cpu():
    attention = padding_aware_attention_class()(config, layer_number=1, attn_mask_type=AttnMaskType.causal,
                                                 attention_type="self")
    got = attention(q, k, v, real).reshape(s, b, h, d)
scores = torch.einsum("sbhd,tbhd->bhst", q, k) / d ** 0.5
masked = torch.ones(s, s, dtype=torch.bool).triu(1)[None, None] | ~real[:, None, None, :]
expected = torch.einsum("bhst,tbhd->sbhd", scores.masked_fill(masked, float("-inf")).softmax(-1), v)
out["attention_max_error"] = float((got - expected)[real.T].abs().max())
out["attention_plain_causal_error"] = float((got[:, 0] - expected[:, 0]).abs().max())
print(json.dumps(out))
"""


def _run_probe(code: str, port: int) -> dict:
    env = {**os.environ, "VERL_PLATFORM": "cpu", "PROBE_PORT": str(port), "PYTHONWARNINGS": "ignore"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_the_megatron_patches_on_real_megatron_core():
    report = _run_probe(PATCH_PROBE, free_port())
    assert report["applied"] == report["patch_names"]
    assert report["current_device"] == "cpu"
    assert report["tracker"] == "CPURNGStatesTracker"
    assert report["outer_untouched"] and report["fork_is_seeded_state"] and report["states_round_trip"]
    assert report["attention_max_error"] < 1e-5, report
    assert report["attention_plain_causal_error"] < 1e-5, report


def test_a_megatron_patch_refuses_another_megatron_core(installed_versions):
    from gepo_plugin.patches.megatron_rng_tracker import PATCH
    from gepo_plugin.patching import APPLIED, PatchVersionError, apply

    installed_versions(**{"megatron-core": "0.17.0"})
    before = list(APPLIED)
    with pytest.raises(PatchVersionError, match=r"megatron-core ==0\.16\.1 but megatron-core 0\.17\.0"):
        apply(PATCH)
    assert before == APPLIED


def test_the_megatron_patches_refuse_a_process_not_on_the_cpu_platform(monkeypatch):
    from gepo_plugin.cpu_backend.megatron.engines import apply_megatron_cpu_patches

    monkeypatch.delenv("VERL_PLATFORM", raising=False)
    with pytest.raises(RuntimeError, match="VERL_PLATFORM=cpu"):
        apply_megatron_cpu_patches()
