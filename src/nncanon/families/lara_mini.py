"""Lara-Mini: Qwen3-Next's block with sliding and full attention, and an ungated shared expert.

``h = x + mixer(input_layernorm(x)); y = h + mlp(post_attention_layernorm(h))``; the mixer is a
gated DeltaNet (``linear_attention``, served as ``linear_attn``), or softmax attention with a
sliding window (``sliding_attention``) or without (``full_attention``). Every MLP is a mixture of
experts (router ``mlp.gate`` on flattened tokens) plus a shared expert added without a gate.
"""

from ..served import Site
from .base import Family
from .qwen3_next import DELTANET, TOPK_ROUTER

LARA_MINI = Family(
    name="lara_mini",
    model_types=("lara_mini",),
    shared_expert_output=Site("mlp.shared_expert", flat=True),
    layouts={"linear_attention": DELTANET, "sliding_attention": {}, "full_attention": {}},
    layout_of=lambda config, layer: config.layer_types[layer],
    **TOPK_ROUTER,
)

FAMILIES = [LARA_MINI]
