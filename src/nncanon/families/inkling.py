"""Inkling (text): softmax attention with short convolutions, and a dense MLP or a MoE.

``h = x + attn_sconv(self_attn(input_layernorm(x))); y = h + mlp_sconv(mlp(post_attention_layernorm(h)))``.
Each sublayer's output passes through a causal depthwise short convolution with its own residual
(``sconv(z) = z + conv(z)``, in fp32) before it joins the stream, so the contributions are
``attn_sconv``'s and ``mlp_sconv``'s outputs. ``mlp_sconv`` mixes each MLP output with the previous
tokens': a write to ``attention_output`` at one position moves the later positions of the block's
output. Attention adds a learned relative-position bias and short convolutions on its keys and
values. Sliding layers (``hybrid_sliding``) have their own heads, ``swa_num_attention_heads ×
swa_head_dim``: their per-head values are split that way (``model.num_heads`` and ``head_dim`` are
the full-attention layers'; ``nncanon.tools.head_count`` gives each layer's).
``config.mlp_layer_types[i]`` picks a dense MLP or a sigmoid-routed MoE whose router scores the
routed and the shared experts together (``router_logits`` has ``n_routed_experts + n_shared_experts``
columns; the shared experts' weights are their gammas). The embeddings are normed
(``embed_tokens.embed_norm``); the logits are ``lm_head(norm(h) / logits_mup_width_multiplier)``,
cut to ``unpadded_vocab_size`` when set.
"""

from ..served import Site
from .base import Embeddings, Family, LogitStep


def _sliding_heads(config, layer: int) -> tuple[int, int]:
    """``(swa_num_attention_heads, swa_head_dim)``"""
    return config.swa_num_attention_heads, config.swa_head_dim


def _kinds(config, layer: int) -> tuple[str, str]:
    attention = "sliding" if config.layer_types[layer] == "hybrid_sliding" else "full"
    return attention, "moe" if config.mlp_layer_types[layer] == "sparse" else "dense"


INKLING = Family(
    name="inkling",
    model_types=("inkling_text",),
    embeddings=Embeddings(positions_kind="relative"),
    attention_output=Site("attn_sconv"),
    mlp_output=Site("mlp_sconv"),
    logit_steps=(
        LogitStep("divide_input", "logits_mup_width_multiplier"),
        LogitStep("truncate", "unpadded_vocab_size"),
    ),
    residual="h = x + attn_sconv(self_attn(input_layernorm(x))); y = h + mlp_sconv(mlp(post_attention_layernorm(h)))",
    layouts={
        "sliding": dict(head_shape=_sliding_heads),
        "full": {},
        "dense": {},
        "moe": dict(
            router_logits=Site("mlp.gate", op="router_logits_0", flat=True),
            expert_weights=Site("mlp.gate", index=1, flat=True),
            expert_indices=Site("mlp.gate", index=2, flat=True),
            shared_expert_output=Site("mlp.shared_experts"),
        ),
    },
    layout_of=_kinds,
    # attn_sconv, a short causal convolution, reads the positions before each one
    token_shift_after=("attention_output",),
)

FAMILIES = [INKLING]
