"""Jamba and Bamba: Mamba or attention blocks, each followed by a ``feed_forward``.

Both are pre-norm (``h = x + mixer(input_layernorm(x)); y = h + feed_forward(pre_ff_layernorm(h))``)
with the mixer chosen by ``config.layer_types[i]``: ``mamba`` (served as ``linear_attn``) or
``self_attn`` (NoPE in Jamba). Jamba's are two block classes; its ``feed_forward`` is a mixture
of experts on the layers ``expert_layer_period/offset`` pick (router ``feed_forward.router``),
dense elsewhere. Jamba's Mamba-1 mixer has no heads; Bamba's Mamba-2 mixer is
``mamba_n_heads × mamba_d_head`` at ``out_proj``'s input. A Bamba block returns
``(hidden, attention weights or None)``.
"""

from ..served import Site
from ..versions import transformers_minor
from .base import Embeddings, Family
from .moe import router_sites

_RESIDUAL = "h = x + mixer(input_layernorm(x)); y = h + feed_forward(pre_ff_layernorm(h)), mixer = mamba or self_attn"


#: Jamba's routing. Before transformers 5.21 ``feed_forward.router`` is a ``Linear`` (the logits) and the
#: MoE block takes the top-k in ``self.route_tokens_to_experts`` (returning ``(indices, weights)``); from
#: 5.21 the router is a top-k module returning ``(logits, weights, indices)``.
_JAMBA_ROUTING = dict(
    router_logits=Site("feed_forward.router", flat=True),
    expert_weights=Site("feed_forward", op="self_route_tokens_to_experts_0", index=1, flat=True),
    expert_indices=Site("feed_forward", op="self_route_tokens_to_experts_0", index=0, flat=True),
) if transformers_minor() < (5, 21) else router_sites("feed_forward.router")


def _jamba_kinds(config, layer: int) -> tuple[str, str]:
    return config.layer_types[layer], "moe" if config.layers_num_experts[layer] > 1 else "dense"


JAMBA = Family(
    name="jamba",
    model_types=("jamba",),
    embeddings=Embeddings(positions_kind="nope"),
    norm="model.final_layernorm",
    mlp="feed_forward",
    mlp_output=Site("feed_forward"),
    residual=_RESIDUAL,
    layouts={
        "linear_attention": dict(attention=None, mixer="mamba", mixer_output=Site("mamba")),
        "full_attention": {},
        "moe": _JAMBA_ROUTING,
        "dense": {},
    },
    layout_of=_jamba_kinds,
)

BAMBA = Family(
    name="bamba",
    model_types=("bamba",),
    norm="model.final_layernorm",
    mlp="feed_forward",
    mlp_output=Site("feed_forward"),
    block_extras=1,
    residual=_RESIDUAL,
    layouts={
        "linear_attention": dict(
            attention=None,
            mixer="mamba",
            mixer_output=Site("mamba"),
            mixer_head_outputs=Site("mamba.out_proj", key="input"),
            mixer_heads="mamba_n_heads",
        ),
        "full_attention": {},
    },
    layout_of=lambda config, layer: config.layers_block_type[layer],
)

FAMILIES = [JAMBA, BAMBA]
