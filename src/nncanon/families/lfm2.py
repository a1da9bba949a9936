"""LFM2, LFM2-MoE and LFM3: short-convolution or attention blocks, each followed by a ``feed_forward``.

The kind of block ``i`` is ``config.layer_types[i]``: ``conv`` (a gated short convolution,
``B, C, x = in_proj(n); y = out_proj(C · conv(B · x))``, channel-wise with no heads, served as
``linear_attn``) or attention (``full_attention``/``sliding_attention``, served as ``self_attn``).
LFM2: ``h = x + op(operator_norm(x)); y = h + feed_forward(ffn_norm(h))``; its attention's output
projection is ``out_proj`` and the final norm is called ``embedding_norm`` (it runs after the last
block). LFM2-MoE's ``feed_forward`` is dense below ``num_dense_layers``, a sigmoid-routed mixture
of experts above (router ``feed_forward.gate``). LFM3 norms each sublayer's output before adding
it (``use_sandwich_norm``): the contributions are ``post_operator_norm``'s and ``post_ffn_norm``'s
outputs (``nn.Identity`` when the sandwich norm is off); its attention gates each head by a scalar
``sigmoid(g_proj(x))`` before ``o_proj``.
"""

from ..served import Site
from .base import Family, MLPAnatomy

_CONV = dict(attention=None, mixer="conv", mixer_output=Site("conv"))
_LFM2_ATTENTION = dict(head_outputs=Site("self_attn.out_proj", key="input"))
_RESIDUAL = "h = x + op(operator_norm(x)); y = h + feed_forward(ffn_norm(h)), op = conv or self_attn"


def _kind(config, layer: int) -> str:
    return "conv" if config.layer_types[layer] == "conv" else "attention"


# ``w2(silu(w1(x)) · w3(x))``: the gate is w1, the activation inline (no module names it).
_SWIGLU = MLPAnatomy(down="feed_forward.w2", pre="feed_forward.w1", linear="feed_forward.w3", activation="silu")

_LFM = dict(
    norm="model.embedding_norm",
    mlp="feed_forward",
    mlp_output=Site("feed_forward"),
    mlp_anatomy=_SWIGLU,
)

LFM2 = Family(
    name="lfm2",
    model_types=("lfm2",),
    residual=_RESIDUAL,
    layouts={"conv": _CONV, "attention": _LFM2_ATTENTION},
    layout_of=_kind,
    **_LFM,
)


def _moe_kinds(config, layer: int) -> tuple[str, str]:
    return _kind(config, layer), "dense" if layer < config.num_dense_layers else "moe"


LFM2_MOE = Family(
    name="lfm2_moe",
    model_types=("lfm2_moe",),
    residual=_RESIDUAL,
    layouts={
        "conv": _CONV,
        "attention": _LFM2_ATTENTION,
        "dense": {},
        "moe": dict(
            router_logits=Site("feed_forward.gate", op="router_logits_0", flat=True),
            expert_weights=Site("feed_forward.gate", index=1, flat=True),
            expert_indices=Site("feed_forward.gate", index=2, flat=True),
        ),
    },
    layout_of=_moe_kinds,
    **_LFM,
)


LFM3 = Family(
    name="lfm3",
    model_types=("lfm3",),
    norm="model.embedding_norm",
    mlp="feed_forward",
    attention_output=Site("post_operator_norm"),
    mlp_output=Site("post_ffn_norm"),
    mlp_anatomy=_SWIGLU,
    residual="h = x + post_operator_norm(op(operator_norm(x))); y = h + post_ffn_norm(feed_forward(ffn_norm(h)))",
    layouts={"conv": dict(attention=None, mixer="conv", mixer_output=Site("post_operator_norm")), "attention": {}},
    layout_of=_kind,
)

FAMILIES = [LFM2, LFM2_MOE, LFM3]
