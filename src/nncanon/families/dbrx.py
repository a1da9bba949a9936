"""DBRX: ``transformer.blocks``, attention inside ``norm_attn_norm``, a mixture of experts ``ffn``.

``norm_attn_norm`` returns ``(h, norm_2(h))`` with ``h = x + attn(norm_1(x))``; the block then
adds ``ffn(norm_2(h))``. The router ``ffn.router`` returns the logits; ``ffn`` takes the top-k
(``route_tokens_to_experts``), so a write to the router's output changes the routing.
"""

from ..served import Site
from .base import Family

_ROUTE = "self_route_tokens_to_experts_0"

DBRX = Family(
    name="dbrx",
    model_types=("dbrx",),
    layers="transformer.blocks",
    embed_tokens="transformer.wte",
    norm="transformer.norm_f",
    attention="norm_attn_norm.attn",
    attention_output=Site("norm_attn_norm.attn", index=0),
    head_outputs=Site("norm_attn_norm.attn.out_proj", key="input"),
    mlp="ffn",
    mlp_output=Site("ffn"),
    router_logits=Site("ffn.router", flat=True),
    expert_weights=Site("ffn", op=_ROUTE, index=0, flat=True),
    expert_indices=Site("ffn", op=_ROUTE, index=1, flat=True),
    residual="h = x + attn(norm_1(x)); y = h + ffn(norm_2(h))",
    norms={"attention_norm": "norm_attn_norm.norm_1", "mlp_norm": "norm_attn_norm.norm_2"},  # (inside a module)
)

FAMILIES = [DBRX]
