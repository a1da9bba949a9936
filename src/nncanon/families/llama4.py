"""Llama-4 (text): a Llama block whose ``feed_forward`` is a mixture of experts on ``moe_layers``.

The MoE runs on the flattened tokens and returns ``(output (b·s, d), router_logits)``; its output
is the shared expert's output onto which the routed sum is added in place, so ``mlp_output`` is
the MoE's first output (the block views it as ``[b, s, d]``) and ``shared_expert_output`` is a copy
of the shared expert's output taken when it returns (a write replaces it before the routed sum is
added). The router ``feed_forward.router`` takes the top-k logits and scales each chosen expert's
*input* by ``sigmoid(logit)`` in a dense ``[tokens, experts]`` score matrix; every expert runs on
every token (unchosen ones on zeros). The chosen experts are the top-k's indices; there is no
``[tokens, k]`` weights tensor. Dense layers use ``Llama4TextMLP``.
"""

from ..served import Site
from .base import Family

_NO_WEIGHTS = (
    "Llama-4 scales each chosen expert's input by sigmoid(router logit) in a dense [tokens, experts] score "
    "matrix (feed_forward.router's first output); it has no [tokens, top_k] weights tensor to serve"
)


def _kind(config, layer: int) -> str:
    return "moe" if layer in (config.moe_layers or []) else "dense"


def _declines(config, layer: int) -> dict:
    return {"expert_weights": _NO_WEIGHTS} if _kind(config, layer) == "moe" else {}


LLAMA4 = Family(
    name="llama4",
    model_types=("llama4_text", "llama4"),
    mlp="feed_forward",
    mlp_output=Site("feed_forward"),
    residual="h = x + attn(input_layernorm(x)); y = h + feed_forward(post_attention_layernorm(h))",
    layouts={
        "moe": dict(
            mlp_output=Site("feed_forward", index=0, flat=True),
            router_logits=Site("feed_forward.router", op="router_logits_0", flat=True),
            expert_indices=Site("feed_forward.router", op="torch_topk_0", index=1, flat=True),
            shared_expert_output=Site("feed_forward.shared_expert", flat=True, clone=True),
        ),
        "dense": {},
    },
    layout_of=_kind,
    declines=_declines,
)

FAMILIES = [LLAMA4]
