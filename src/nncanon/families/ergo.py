"""Ergo: sandwich-norm blocks whose residual stream is mixed with each sublayer by learned gates.

``h = r_a ⊙ x + b_a ⊙ post_attention_layernorm(self_attn(input_layernorm(x)))`` and
``y = r_m ⊙ h + b_m ⊙ post_feedforward_layernorm(mlp(pre_feedforward_layernorm(h)))``, where each
``*_residual_gate`` module holds one weight ``w`` per channel and computes ``b = sigmoid(w)`` and
``r = sqrt(1 + b) · exp(-softplus(w) / 2)`` (``r = 0.866`` at ``w = 0``). The stream itself is rescaled at
every sublayer, so the block's update is not a sum of what attention and the MLP add: ``attention_output``
and ``mlp_output`` are declined, as Beam's (whose rotary embedding Ergo reuses) are.

Attention has one fused ``qkv_proj`` and per-head query/key norms; every ``global_attention_every_n_layers``-th
block attends to the whole context with no position embedding (its queries and keys multiplied by
``sqrt(global_attention_scale)`` where set), the others to a ``sliding_window``. The MLP is dense (ReLU²) on the
first ``num_dense_blocks`` blocks (``mlp_layer_types``), elsewhere a mixture of experts: a sigmoid top-k router
``mlp.gate`` (its logits are its ``linear``'s output, fp32), each chosen expert's output normed by that expert's
own RMSNorm gain before the weighted sum, plus a shared expert with its own norm. The sum is normed again
(``post_feedforward_layernorm``) before the gate adds it, so the shared expert has no additive part of any
contribution: ``shared_expert_output`` is declined. Norms, gates, the embedding, the router and the head's
logits are kept in fp32 by transformers (``_keep_in_fp32_modules_strict``): the stream is fp32 in a bf16 model.
"""

from ..served import Site
from .base import Family

_REASON = (
    "Ergo mixes the residual stream with each sublayer by learned per-channel gates (h = r ⊙ x + b ⊙ "
    "post_norm(sublayer), attention_residual_gate / feedforward_residual_gate), rescaling the stream itself, "
    "so the block's update is not attention's plus the MLP's contribution; read layer_input/layer_output, or "
    "post_attention_layernorm / post_feedforward_layernorm outputs natively"
)

_SHARED = (
    "Ergo norms its mixture of experts' output (routed plus shared experts) with post_feedforward_layernorm "
    "and gates it before it joins the stream, so the shared expert has no additive part of the contribution; "
    "read mlp.shared_experts.output for its raw output"
)


def _kind(config, layer: int) -> str:
    return "moe" if config.mlp_layer_types[layer] == "sparse" else "dense"


def _declines(config, layer: int) -> dict:
    declines = {"attention_output": _REASON, "mlp_output": _REASON}
    if _kind(config, layer) == "moe":
        declines["shared_expert_output"] = _SHARED
    return declines


ERGO = Family(
    name="ergo",
    model_types=("ergo",),
    residual=(
        "h = r_a ⊙ x + b_a ⊙ post_attention_layernorm(attn(input_layernorm(x))); "
        "y = r_m ⊙ h + b_m ⊙ post_feedforward_layernorm(mlp(pre_feedforward_layernorm(h)))"
    ),
    layouts={
        "moe": dict(
            router_logits=Site("mlp.gate.linear", flat=True),
            expert_weights=Site("mlp.gate", index=1, flat=True),
            expert_indices=Site("mlp.gate", index=2, flat=True),
        ),
        "dense": {},
    },
    layout_of=_kind,
    declines=_declines,
)

FAMILIES = [ERGO]
