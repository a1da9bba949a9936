"""LongCat-Flash: two attention-plus-MLP sublayers and a shortcut mixture of experts per block.

``h1 = x + self_attn[0](input_layernorm[0](x)); m = mlp(n); h2 = h1 + mlps[0](n)`` with
``n = post_attention_layernorm[0](h1)``, then ``h3 = h2 + self_attn[1](input_layernorm[1](h2));
y = h3 + mlps[1](post_attention_layernorm[1](h3)) + m``. The block's update is the sum of two
attention outputs, two dense MLP outputs and the MoE's output: no single tensor is attention's or
the MLP's contribution, so ``attention_output`` and ``mlp_output`` are declined.

``layers[i].self_attn`` is the block's first attention sublayer (multi-head latent attention; its
per-head outputs and probabilities are served); the second is ``layers[i]._module.self_attn[1]``.
``layers[i].mlp`` is the shortcut MoE: its router ``mlp.router`` scores the routed experts and
``zero_expert_num`` zero-computation (identity) experts, which the indices can name
(``n_routed_experts`` and above). The served indices and weights are the router's: before transformers
5.25 the experts module runs the identity experts itself; from 5.25 the MoE adds them around it and
hands the experts module dummy routed indices with weight 0 in their place (what a hook on
``mlp.experts`` sees is not the routing).

Attribution graphs: a transcoder maps the shortcut MoE (``mlp_input`` to the MoE module's output); the block's second
half is frozen after the MoE (`nncanon.components.norm_gates.BLOCK_GATES`: the second norms' scales, the second
attention's latent norm and pattern), and the dense MLPs' outputs are leaves folded into the block's error node
(``frozen_sublayers``; docs/graphs.md, "Several sublayers beside the MLP").
"""

from ..served import Site
from .base import Family

_REASON = (
    "LongCat-Flash blocks run two attention and two dense MLP sublayers plus a shortcut mixture of experts "
    "(y = x + attn0 + mlp0 + attn1 + mlp1 + moe), so no single tensor is the block's {what}; read the "
    "sublayers' outputs natively (layers[i]._module.self_attn[j], .mlps[j], .mlp)"
)


def _declines(config, layer: int) -> dict:
    return {
        "attention_output": _REASON.format(what="attention contribution"),
        "mlp_output": _REASON.format(what="MLP contribution"),
    }


LONGCAT_FLASH = Family(
    name="longcat_flash",
    model_types=("longcat_flash",),
    attention="self_attn.0",
    attention_output=Site("self_attn.0", index=0),
    head_outputs=Site("self_attn.0.o_proj", key="input"),
    router_logits=Site("mlp.router", op="router_logits_0", flat=True),
    expert_weights=Site("mlp.router", index=1, flat=True),
    expert_indices=Site("mlp.router", index=2, flat=True),
    declines=_declines,
    # (lists of norms, one per sublayer: the first attention's, and the one the shortcut MoE reads)
    norms={"attention_norm": "input_layernorm.0", "mlp_norm": "post_attention_layernorm.0"},
    # (no transcoder maps the dense MLPs: an attribution graph folds their outputs into the block's error node)
    frozen_sublayers=("mlps.0", "mlps.1"),
    residual=(
        "h1 = x + attn0(n0(x)); h2 = h1 + mlp0(p0(h1)); h3 = h2 + attn1(n1(h2)); y = h3 + mlp1(p1(h3)) + moe(p0(h1))"
    ),
)

FAMILIES = [LONGCAT_FLASH]
