"""MiniMax: Lightning (linear) attention or softmax attention, both kept as ``self_attn``; a MoE MLP.

MiniMax blocks are not additive. The raw stream enters only through the first norm and is
re-normalised inside the block:
``u = input_layernorm(x); h = α_a·u + β_a·self_attn(u); v = post_attention_layernorm(h); y = α_m·v + β_m·mlp(v)``
with ``(α_a, β_a)`` = ``linear_attn_{alpha,beta}_factor`` or ``full_attn_{alpha,beta}_factor`` by
block kind and ``(α_m, β_m)`` = ``mlp_{alpha,beta}_factor``. No attention, linear-attention or MLP
value satisfies ``layer_input + contributions == layer_output``, so the contributions are declined
with that equation; the mixers' per-head values and the router's values are served.

Lightning attention (``linear_attention`` blocks, served as ``linear_attn``) normalises all heads
jointly (RMSNorm over ``heads × head_dim``), gates elementwise by ``sigmoid(output_gate(u))`` and
projects with ``out_proj``: its input is served per head. It returns ``(out, kv_state)``.
"""

from ..served import Site
from .base import Family

_EQUATION = (
    "MiniMax blocks are not additive: y = α_m·n2(h) + β_m·MoE(n2(h)), h = α_a·n1(x) + β_a·A(n1(x)) "
    "(n1 = input_layernorm, n2 = post_attention_layernorm; α, β = the config's *_alpha_factor / "
    "*_beta_factor); the stream x enters only through n1, so no value satisfies "
    "layer_input + attention_output + mlp_output == layer_output"
)


def _declines(config, layer: int) -> dict:
    return {name: _EQUATION for name in ("attention_output", "linear_attention_output", "mlp_output")}


MINIMAX = Family(
    name="minimax",
    model_types=("minimax",),
    router_logits=Site("mlp.gate", op="router_logits_0", flat=True),
    expert_weights=Site("mlp.gate", index=1, flat=True),
    expert_indices=Site("mlp.gate", index=2, flat=True),
    declines=_declines,
    residual="u = n1(x); h = α_a·u + β_a·self_attn(u); v = n2(h); y = α_m·v + β_m·mlp(v)",
    layouts={
        "linear_attention": dict(
            attention=None,
            mixer="self_attn",
            mixer_output=Site("self_attn", index=0),
            mixer_head_outputs=Site("self_attn.out_proj", key="input"),
            mixer_heads="num_attention_heads",
        ),
        "full_attention": {},
    },
    layout_of=lambda config, layer: config.layer_types[layer],
)

FAMILIES = [MINIMAX]
