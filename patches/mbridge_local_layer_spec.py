"""mbridge builds the decoder from megatron's local (non-Transformer-Engine) layer spec (the CPU Megatron engine).

mbridge 0.15.1 ``core/llm_bridge.py`` ``LLMBridge._get_transformer_layer_spec`` asks megatron for the Transformer
Engine spec (``use_transformer_engine=True``), and Transformer Engine needs CUDA. Use megatron's local spec,
with a core attention that reads verl's bshd padding mask (:func:`padding_aware_attention_class`).
"""

from __future__ import annotations

import torch

from gepo_plugin.patching import Patch
from gepo_plugin.verl_glue import seam


def padding_aware_attention_class() -> type:
    """megatron's local ``DotProductAttention`` that also understands verl's ``[batch, seq]`` padding mask.

    verl's bshd path (``verl/models/mcore/model_forward.py``, ``preprocess_bshd_engine``) hands the model a
    ``[batch, seq]`` mask, True on real tokens. Transformer Engine's causal attention ignores it (the padding is on
    the right, so causality already hides it from every real token); megatron's local attention would use it as
    an additive ``[b, heads, sq, sk]`` mask (True = masked out) and fail on its shape. Turn it into that mask:
    causal, plus the padded keys. For every real token this is the attention Transformer Engine computes.
    """
    from megatron.core.transformer.dot_product_attention import DotProductAttention  # optional: megatron-core

    class PaddingAwareDotProductAttention(DotProductAttention):
        def forward(self, query, key, value, attention_mask, *args, **kwargs):
            if attention_mask is not None and attention_mask.dim() == 2:
                sq, sk = query.size(0), key.size(0)
                causal = torch.ones(sq, sk, dtype=torch.bool, device=query.device).triu(diagonal=1)
                attention_mask = causal[None, None] | ~attention_mask.bool()[:, None, None, :]
            return super().forward(query, key, value, attention_mask, *args, **kwargs)

    return PaddingAwareDotProductAttention


def _apply() -> None:
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec  # optional: megatron-core

    attention = padding_aware_attention_class()
    local_attention = attention.__mro__[1]

    def _get_transformer_layer_spec(self, vp_stage=None):
        assert self.config.normalization == "RMSNorm", "only RMSNorm is supported for now"  # as mbridge asserts
        self.has_vp_stage = True
        spec = get_gpt_decoder_block_spec(self.config, use_transformer_engine=False, vp_stage=vp_stage)
        for layer in spec.layer_specs:
            submodules = layer.submodules.self_attention.submodules
            if submodules.core_attention is local_attention:
                submodules.core_attention = attention
        return spec

    seam.replace("mbridge.core.llm_bridge.LLMBridge._get_transformer_layer_spec", _get_transformer_layer_spec)


PATCH = Patch(
    name="mbridge_local_layer_spec",
    versions={"megatron-core": "==0.16.1", "mbridge": "==0.15.1"},
    reason="mbridge builds the decoder with Transformer Engine modules, which need CUDA",
    apply=_apply,
    feature="megatron_cpu",
    check_contacts=seam.require,
)
