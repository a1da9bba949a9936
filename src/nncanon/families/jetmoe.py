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

from ..served import Site
from .base import Family

_ROUTER = "mlp.router"

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
)

FAMILIES = [JETMOE]
