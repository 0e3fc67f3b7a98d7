"""mbridge maps the local layer spec's layer-norm weights to Hugging Face names (the CPU Megatron engine).

Transformer Engine fuses each layer norm into the next linear layer (``linear_qkv.layer_norm_weight``,
``linear_fc1.layer_norm_weight``), and mbridge 0.15.1 ``core/bridge.py``
``Bridge._weight_name_mapping_mcore_to_hf`` knows only those names. megatron's local spec, which the CPU backend
builds (``mbridge_local_layer_spec``), keeps them as modules of their own (``input_layernorm``,
``pre_mlp_layernorm``); map those to the fused names first, for every model bridge.
"""

from __future__ import annotations

from gepo_plugin.patching import Patch
from gepo_plugin.verl_glue import seam

#: (the local spec's suffix, the Transformer Engine spec's suffix mbridge maps).
LOCAL_TO_TE_NAMES = (
    (".input_layernorm.weight", ".self_attention.linear_qkv.layer_norm_weight"),
    (".pre_mlp_layernorm.weight", ".mlp.linear_fc1.layer_norm_weight"),
)


def te_name(mcore_weights_name: str) -> str:
    """The Transformer Engine spec's name of a local-spec decoder weight (other names unchanged)."""
    if ".layers." in mcore_weights_name:
        for local, te in LOCAL_TO_TE_NAMES:
            if mcore_weights_name.endswith(local):
                return mcore_weights_name[: -len(local)] + te
    return mcore_weights_name


def _apply() -> None:
    name = "mbridge.core.bridge.Bridge._weight_name_mapping_mcore_to_hf"
    original = seam.resolve(name)

    def _weight_name_mapping_mcore_to_hf(self, mcore_weights_name: str) -> list[str]:
        return original(self, te_name(mcore_weights_name))

    seam.replace(name, _weight_name_mapping_mcore_to_hf)


PATCH = Patch(
    name="mbridge_local_weight_names",
    versions={"mbridge": "==0.15.1"},
    reason="mbridge knows only Transformer Engine's fused layer-norm weight names",
    apply=_apply,
    feature="megatron_cpu",
    check_contacts=seam.require,
)
