"""GPT-NeoX (Pythia): ``gpt_neox.layers`` blocks, parallel or sequential by ``use_parallel_residual``.

GPT-NeoX-Japanese: sequential blocks returning ``(hidden, attn_weights)``; attention is inline in
``_attn``. Its last block's attention returns its output bias apart (``(out, weights, dense_bias)``)
and the block adds it, so attention's contribution is ``out + dense_bias`` there (``Site.bias``).
The kernel's per-head inputs are those ``_attn`` is called with (after rotary and the cache); it scales
``q·kᵀ`` by ``1 / norm_factor``.
"""

from typing import Any

from ..components.kernel import method_kernel
from ..served import Site
from .base import Family

GPT_NEOX = Family(
    name="gpt_neox",
    model_types=("gpt_neox",),
    layers="gpt_neox.layers",
    embed_tokens="gpt_neox.embed_in",
    norm="gpt_neox.final_layer_norm",
    attention="attention",
    attention_output=Site("attention", index=0),
    head_outputs=Site("attention.dense", key="input"),
    residual=(
        "parallel: y = x + attention(input_layernorm(x)) + mlp(post_attention_layernorm(x)); "
        "sequential: h = x + attention(input_layernorm(x)); y = h + mlp(post_attention_layernorm(h))"
    ),
)

def _japanese_scale(module: Any, kwargs: dict, head_dim: int) -> float:
    """``1 / norm_factor`` (the ``alpha`` of its ``baddbmm``)."""
    return 1.0 / module.norm_factor


GPT_NEOX_JAPANESE = Family(
    name="gpt_neox_japanese",
    model_types=("gpt_neox_japanese",),
    layers="gpt_neox_japanese.layers",
    embed_tokens="gpt_neox_japanese.embed_in",
    norm="gpt_neox_japanese.final_layer_norm",
    lm_head="embed_out",
    attention="attention",
    attention_output=Site("attention", index=0, bias=2),
    head_outputs=Site("attention.dense", key="input"),
    probabilities=("self__attn_0", "torch_matmul_0"),
    kernel=method_kernel(_japanese_scale),
    block_extras=1,
    residual="h = x + (attention(input_layernorm(x)) + dense_bias); y = h + mlp(post_attention_layernorm(h))",
)

FAMILIES = [GPT_NEOX, GPT_NEOX_JAPANESE]
