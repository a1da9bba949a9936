"""Cohere2-MoE: Cohere's parallel block with a mixture of experts for the MLP.

``n = input_layernorm(x); y = x + self_attn(n) + mlp(n)``; ``config.mlp_layer_types[i]`` says
whether the MLP is dense or sparse. The sparse MLP's router ``mlp.gate`` picks the top-k logits
and softmaxes (or sigmoids) them; shared experts (``num_shared_experts``) are combined with the
routed sum by ``shared_expert_combination_strategy``: ``"sum"`` adds them (their output is their
part of the contribution), ``"average"`` takes the mean of the two, where the shared experts' part
is half their output and is not served. The logits are ``lm_head(norm(h)) · logit_scale``.
"""

from ..served import Site
from .base import Family, LogitStep
from .qwen3_next import TOPK_ROUTER

_AVERAGED = (
    "Cohere2-MoE with shared_expert_combination_strategy='average' adds (routed + shared) / 2, so the "
    "shared experts' part of mlp_output is not their output; read mlp.shared_experts.output for it"
)


def _kinds(config, layer: int) -> tuple[str, ...]:
    if config.mlp_layer_types[layer] == "dense":
        return ("dense",)
    return ("moe", "shared") if config.num_shared_experts > 0 else ("moe",)


def _declines(config, layer: int) -> dict:
    shared = "shared" in _kinds(config, layer)
    return (
        {"shared_expert_output": _AVERAGED} if shared and config.shared_expert_combination_strategy == "average" else {}
    )


COHERE2_MOE = Family(
    name="cohere2_moe",
    model_types=("cohere2_moe",),
    logit_steps=(LogitStep("multiply", "logit_scale"),),
    residual="n = input_layernorm(x); y = x + attn(n) + mlp(n)",
    layouts={
        "moe": TOPK_ROUTER,
        "shared": dict(shared_expert_output=Site("mlp.shared_experts", flat=True)),
        "dense": {},
    },
    layout_of=_kinds,
    declines=_declines,
)

FAMILIES = [COHERE2_MOE]
