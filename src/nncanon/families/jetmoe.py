"""JetMoE: mixtures of experts in both sublayers of a Llama-shaped block.

``h = x + self_attention(input_layernorm(x)); y = h + mlp(post_attention_layernorm(h))``.
Attention is a mixture of attention heads (MoA): each token's router picks ``top_k`` experts, each
a query projection (``experts.input_linear``) and an output projection (``experts.output_linear``)
over shared keys and values, so the model has ``num_key_value_heads × top_k`` query heads per token.
The per-head outputs are the attention's output before the experts' output projections,
``[b, s, top_k, kv_heads·head_dim]`` in the forward, served ``[b, s, heads, head_dim]`` (head
``k·kv_heads + j`` is slot ``k``'s head ``j``). The MLP is a mixture of GLU experts stored as two
parallel linears, with an output bias; its router ``mlp.router`` takes the top-k logits and
softmaxes them: the logits, chosen experts and their weights are read inside the router, where a
write changes the routing.
"""

from typing import Any

import torch

from ..served import Site
from .base import Family

_ROUTER = "mlp.router"

def _moa_head_totals(model: Any, layer: int, heads: torch.Tensor, inputs: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Slot ``k``'s heads through the output projection of the expert the token's attention router put in
    slot ``k``, times its gate, plus the bias, summed; and the attention's output. From a plain forward
    of the unwrapped model on ``inputs`` (the prompt ``heads`` were read on) with hooks."""
    block = model._module.get_submodule(model.family.layers)[layer]
    attention = block.self_attention
    moa, seen = attention.experts, {}

    def keep(name: str, position: int) -> Any:
        def hook(module: torch.nn.Module, args: Any, out: Any) -> None:
            seen[name] = out[position].clone()

        return hook

    hooks = [
        moa.router.register_forward_hook(keep("logits", 4)),
        attention.register_forward_hook(keep("out", 0)),
    ]
    try:
        with torch.no_grad():
            model._module(**inputs)
    finally:
        for hook in hooks:
            hook.remove()
    top_logits, experts = seen["logits"].topk(moa.top_k, dim=1)
    gates = torch.softmax(top_logits, dim=1)
    slots = heads.reshape(-1, moa.top_k, heads.shape[-2] // moa.top_k * heads.shape[-1])  # [tokens, k, kv·hd]
    total = moa.bias.expand(slots.shape[0], -1).clone()
    with torch.no_grad():
        for slot in range(moa.top_k):
            weight = moa.output_linear.weight[experts[:, slot]]  # [tokens, d, kv·hd]
            total += gates[:, slot, None] * torch.einsum("td,tod->to", slots[:, slot], weight)
    return total.view_as(seen["out"]), seen["out"]


JETMOE = Family(
    name="jetmoe",
    model_types=("jetmoe",),
    attention="self_attention",
    attention_output=Site("self_attention", index=0),
    # `attn_output = attn_output.view(*input_shape, self.top_k, -1)` before `experts.reduce`.
    head_outputs=Site("self_attention", op="attn_output_0", merge=True),
    router_logits=Site(_ROUTER, op="logits_0", flat=True),
    expert_weights=Site(_ROUTER, op="top_k_gates_0", flat=True),
    expert_indices=Site(_ROUTER, op="logits_topk_0", index=1, flat=True),
    residual="h = x + self_attention(input_layernorm(x)); y = h + mlp(post_attention_layernorm(h))",
    head_totals=_moa_head_totals,
)

FAMILIES = [JETMOE]
