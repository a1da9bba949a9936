"""Qwen3-Next and Qwen3.5: gated DeltaNet (``linear_attn``) and gated softmax attention blocks.

Both kinds are pre-norm (``h = x + mixer(norm(x)); y = h + mlp(norm(h))``). The kind of a block's
mixer is ``config.layer_types[i]``; its MLP is a sparse MoE with a sigmoid-gated shared expert, or
dense (``mlp_only_layers``, ``decoder_sparse_step`` in Qwen3-Next; always dense in Qwen3.5, always
sparse in Qwen3.5-MoE).
"""

from ..served import Site
from .base import Family


def _kinds(config, layer: int) -> tuple[str, str]:
    experts = getattr(config, "num_experts", 0) or 0
    sparse = (
        layer not in (getattr(config, "mlp_only_layers", None) or [])
        and experts > 0
        and (layer + 1) % getattr(config, "decoder_sparse_step", 1) == 0
    )
    return config.layer_types[layer], "moe" if sparse else "dense"


DELTANET = dict(
    attention=None,
    mixer="linear_attn",
    mixer_output=Site("linear_attn"),
    mixer_head_outputs=Site("linear_attn.out_proj", key="input"),
    mixer_heads="linear_num_value_heads",
    residual="h = x + linear_attn(norm1(x)); y = h + mlp(norm2(h))",
)

#: A top-k router module ``mlp.gate`` returning ``(logits, weights, indices)`` on flattened tokens.
TOPK_ROUTER = dict(
    router_logits=Site("mlp.gate", op="router_logits_0", flat=True),
    expert_weights=Site("mlp.gate", index=1, flat=True),
    expert_indices=Site("mlp.gate", index=2, flat=True),
)

QWEN_MOE = dict(TOPK_ROUTER, shared_expert_output=Site("mlp", op="shared_expert_output_1", flat=True))

QWEN3_NEXT = Family(
    name="qwen3_next",
    model_types=("qwen3_next",),
    layouts={"linear_attention": DELTANET, "full_attention": {}, "moe": QWEN_MOE, "dense": {}},
    layout_of=_kinds,
)

QWEN3_5 = Family(
    name="qwen3_5",
    model_types=("qwen3_5_text", "qwen3_5"),
    layouts={"linear_attention": DELTANET, "full_attention": {}},
    layout_of=lambda config, layer: config.layer_types[layer],
)

QWEN3_5_MOE = Family(
    name="qwen3_5_moe",
    model_types=("qwen3_5_moe_text", "qwen3_5_moe"),
    layouts={"linear_attention": DELTANET, "full_attention": {}, "moe": QWEN_MOE},
    layout_of=lambda config, layer: (config.layer_types[layer], "moe"),
)

FAMILIES = [QWEN3_NEXT, QWEN3_5, QWEN3_5_MOE]
