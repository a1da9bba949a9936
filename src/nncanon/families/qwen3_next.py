"""Qwen3-Next and Qwen3.5: gated DeltaNet (``linear_attn``) and gated softmax attention blocks.

Both kinds are pre-norm (``h = x + mixer(norm(x)); y = h + mlp(norm(h))``); the MLP is a sparse
MoE with a gated shared expert, or dense. The kind of each block is ``config.layer_types[i]``.
"""

from ..served import Site
from .base import Family


def _layer_type(config, layer: int) -> str:
    return config.layer_types[layer]


_DELTANET = dict(
    attention=None,
    mixer="linear_attn",
    mixer_output=Site("linear_attn"),
    mixer_head_outputs=Site("linear_attn.out_proj", key="input"),
    mixer_heads="linear_num_value_heads",
    residual="h = x + linear_attn(norm1(x)); y = h + mlp(norm2(h))",
)

QWEN3_NEXT = Family(
    name="qwen3_next",
    model_types=("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text"),
    layouts={"linear_attention": _DELTANET, "full_attention": {}},
    layout_of=_layer_type,
)

FAMILIES = [QWEN3_NEXT]
