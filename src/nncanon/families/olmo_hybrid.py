"""OLMo-Hybrid: gated DeltaNet blocks (pre-norm) and OLMo-2 attention blocks (post-norm).

The kind of block ``i`` is ``config.layer_types[i]``, and they are two block classes:
``linear_attention``: ``h = x + linear_attn(input_layernorm(x)); y = h + mlp(post_attention_layernorm(h))``
(the DeltaNet's gated per-head RMSNorm ``o_norm`` feeds ``o_proj``: its input is per value head);
``full_attention``: ``h = x + post_attention_layernorm(self_attn(x)); y = h + post_feedforward_layernorm(mlp(h))``,
so there the contributions are the post-norms' outputs. ``post_attention_layernorm`` is the pre-MLP
norm in one kind of block and the norm of attention's output in the other.
"""

from ..served import Site
from .base import Family

OLMO_HYBRID = Family(
    name="olmo_hybrid",
    model_types=("olmo_hybrid",),
    residual=(
        "linear: h = x + linear_attn(input_layernorm(x)); y = h + mlp(post_attention_layernorm(h)); "
        "attention: h = x + post_attention_layernorm(self_attn(x)); y = h + post_feedforward_layernorm(mlp(h))"
    ),
    layouts={
        "linear_attention": dict(
            attention=None,
            mixer="linear_attn",
            mixer_output=Site("linear_attn"),
            mixer_head_outputs=Site("linear_attn.o_proj", key="input"),
            mixer_heads="linear_num_value_heads",
        ),
        "full_attention": dict(
            attention_output=Site("post_attention_layernorm"),
            mlp_output=Site("post_feedforward_layernorm"),
        ),
    },
    layout_of=lambda config, layer: config.layer_types[layer],
)

FAMILIES = [OLMO_HYBRID]
