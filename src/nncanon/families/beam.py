"""Beam: sandwich-norm blocks whose residual stream is rescaled at every sublayer.

``h = a·x + b·post_attention_layernorm(self_attn(input_layernorm(x)))`` and
``y = a'·h + b'·post_feedforward_layernorm(mlp(pre_feedforward_layernorm(h)))``, with depth-scaled
constants (``b = 1/√k``, ``a = √((k-1)/k)``, ``k = 2(i+1)`` for attention, ``k + 1`` for the MLP).
The block's update ``y - x`` rescales the stream itself, so it is not a sum of what attention and
the MLP add: ``attention_output`` and ``mlp_output`` are declined. The MLP is dense or (on the
``mlp_layer_types[i] == "sparse"`` layers) a mixture of experts with a sigmoid, group-limited
router ``mlp.gate``; the MoE multiplies the routed sum by ``routed_scaling_factor``. The logits are
softcapped (``final_logit_softcapping``).
"""

from .base import Family, LogitStep
from .qwen3_next import TOPK_ROUTER

_REASON = (
    "Beam rescales the residual stream at every sublayer (depth-scaled residual: h = a·x + b·norm(sublayer)), "
    "so the block's update is not a sum of attention's and the MLP's contributions; read layer_input/"
    "layer_output, or post_attention_layernorm / post_feedforward_layernorm outputs natively"
)

BEAM = Family(
    name="beam",
    model_types=("beam",),
    logit_steps=(LogitStep("softcap", "final_logit_softcapping"),),
    residual=(
        "h = a·x + b·post_attention_layernorm(attn(input_layernorm(x))); "
        "y = a'·h + b'·post_feedforward_layernorm(mlp(pre_feedforward_layernorm(h)))"
    ),
    layouts={"moe": TOPK_ROUTER, "dense": {}},
    layout_of=lambda config, layer: "moe" if config.mlp_layer_types[layer] == "sparse" else "dense",
    declines=lambda config, layer: {"attention_output": _REASON, "mlp_output": _REASON},
)

FAMILIES = [BEAM]
