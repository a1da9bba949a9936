"""Mixtures of experts in post-norm and sandwich-norm blocks: the contributions are norm outputs.

FlexOlmo is OLMo-2's block (no pre-norm): ``h = x + post_attention_layernorm(self_attn(x));
y = h + post_feedforward_layernorm(mlp(h))``. AFMoE (Arcee Trinity) is a sandwich:
``h = x + post_attention_layernorm(self_attn(input_layernorm(x)));
y = h + post_mlp_layernorm(mlp(pre_mlp_layernorm(h)))``, its MLP dense on the first
``num_dense_layers`` layers and a mixture of experts with shared experts after them; its attention
gates each channel before ``o_proj``. Kolibri-1 is GLM-4's sandwich:
``h = x + post_self_attn_layernorm(self_attn(input_layernorm(x)));
y = h + post_mlp_layernorm(mlp(post_attention_layernorm(h)))``. The MoE's output (routed plus
shared) is normed before it joins the stream, so the shared experts have no additive part of the
contribution.
"""

from ..served import Site
from .base import Family
from .qwen3_next import TOPK_ROUTER

_AFMOE_SHARED = (
    "AFMoE norms its mixture of experts' output (routed plus shared experts) with post_mlp_layernorm before "
    "it joins the stream, so the shared experts have no additive part of mlp_output; read "
    "mlp.shared_experts.output for their raw output"
)


_KOLIBRI_LOGITS = (
    "Kolibri-1's router computes its logits on one of two code paths picked at run time (a fused fp32 matmul "
    "on CUDA without grad, a linear layer otherwise), so no single operation is where a write changes the "
    "routing; expert_weights and expert_indices are served"
)
_KOLIBRI_SHARED = _AFMOE_SHARED.replace("AFMoE", "Kolibri-1")


def _afmoe_kind(config, layer: int) -> str:
    return "moe" if layer >= config.num_dense_layers else "dense"


FLEX_OLMO = Family(
    name="flex_olmo",
    model_types=("flex_olmo",),
    attention_output=Site("post_attention_layernorm"),
    mlp_output=Site("post_feedforward_layernorm"),
    residual="h = x + post_attention_layernorm(attn(x)); y = h + post_feedforward_layernorm(mlp(h))",
    **TOPK_ROUTER,
)

AFMOE = Family(
    name="afmoe",
    model_types=("afmoe",),
    attention_output=Site("post_attention_layernorm"),
    mlp_output=Site("post_mlp_layernorm"),
    residual=(
        "h = x + post_attention_layernorm(attn(input_layernorm(x))); "
        "y = h + post_mlp_layernorm(mlp(pre_mlp_layernorm(h)))"
    ),
    layouts={
        "moe": dict(
            router_logits=Site("mlp.router", op="router_logits_0", flat=True),
            expert_weights=Site("mlp.router", index=1, flat=True),
            expert_indices=Site("mlp.router", index=2, flat=True),
        ),
        "dense": {},
    },
    layout_of=_afmoe_kind,
    declines=lambda config, layer: (
        {"shared_expert_output": _AFMOE_SHARED} if _afmoe_kind(config, layer) == "moe" else {}
    ),
)

KOLIBRI1 = Family(
    name="kolibri1",
    model_types=("kolibri1",),
    attention_output=Site("post_self_attn_layernorm"),
    mlp_output=Site("post_mlp_layernorm"),
    expert_weights=Site("mlp.gate", index=1, flat=True),
    expert_indices=Site("mlp.gate", index=2, flat=True),
    residual=(
        "h = x + post_self_attn_layernorm(attn(input_layernorm(x))); "
        "y = h + post_mlp_layernorm(mlp(post_attention_layernorm(h)))"
    ),
    declines=lambda config, layer: {"router_logits": _KOLIBRI_LOGITS, "shared_expert_output": _KOLIBRI_SHARED},
)

FAMILIES = [FLEX_OLMO, AFMOE, KOLIBRI1]
