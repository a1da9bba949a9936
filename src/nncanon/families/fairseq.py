"""Fairseq-style decoders, XGLM and BioGPT: ``self_attn`` and an inline ``fc1``/``fc2`` MLP on the block.

XGLM computes attention inline (``bmm`` over ``(b·H, q, k)``); its probabilities are read where
they are still ``[b, H, q, k]``, at the assignment ``attn_weights_reshaped = ...``.
"""

from ..served import Site
from .base import Family

_RESIDUAL = "h = x + self_attn(self_attn_layer_norm(x)); y = h + fc2(act(fc1(final_layer_norm(h))))"

XGLM = Family(
    name="xglm",
    model_types=("xglm",),
    norm="model.layer_norm",
    mlp=None,
    mlp_output=Site("fc2"),
    head_outputs=Site("self_attn.out_proj", key="input"),
    probabilities=("attn_weights_reshaped_0",),
    residual=_RESIDUAL,
)

BIOGPT = Family(
    name="biogpt",
    model_types=("biogpt",),
    layers="biogpt.layers",
    embed_tokens="biogpt.embed_tokens",
    norm="biogpt.layer_norm",
    lm_head="output_projection",
    mlp=None,
    mlp_output=Site("fc2"),
    head_outputs=Site("self_attn.out_proj", key="input"),
    residual=_RESIDUAL,
)

FAMILIES = [XGLM, BIOGPT]
