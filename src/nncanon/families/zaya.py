"""ZAYA1: a pre-norm block whose residual is rescaled at each sublayer, and a router with memory.

Each sublayer joins the stream through ``ZayaResidualScaling``: ``h = (attn(norm(x)) + b_h) ⊙ s_h +
(x + b_r) ⊙ s_r``, with learned per-channel ``hidden_states_bias``/``hidden_states_scale`` on the
sublayer's output and ``residual_bias``/``residual_scale`` on the stream itself (likewise after the
MLP). The sublayer's scale could be served as part of its contribution, as Granite's multiplier is;
the stream's own scale cannot: ``(x + b_r) ⊙ s_r − x`` belongs to neither sublayer, so no attention
or MLP contribution satisfies ``layer_input + attention_output + mlp_output == layer_output``, and
they are declined (as Gemma-4's ``layer_scalar`` is). The stream is kept in fp32, and the embeddings
are scaled and shifted (``input_hidden_states_scale``/``_bias``) before block 0.

Attention's query/key/value come from a convolutional projection (``qkv_proj``, CCA) and its heads
are ``o_proj``'s input, as in Llama. The MLP is a mixture of experts whose router reads the previous
block's router state: blocks take it as their second positional argument and return it updated
(``passes_state``). The router picks among ``num_experts + 1`` classes, the last a skip expert that computes nothing;
it returns the skip picks re-labelled as expert 0 with weight 0, so ``expert_indices`` are its
top-k's own indices (before that re-labelling: ``num_experts`` names the skip expert, which the
experts pass over) and ``expert_weights`` the weights the experts run with (0 for a skip). Its
logits (``[b, s, num_experts + 1]``) are served where the router binds them, so a write reroutes.
"""

import torch

from ..served import Site
from .base import Embeddings, Family

_RESIDUAL = (
    "a ZAYA block rescales the residual stream itself at each sublayer, h = (sublayer + b_h)·s_h + "
    "(x + b_r)·s_r with learned residual_bias/residual_scale (ZayaResidualScaling): the term (x + b_r)·s_r − x "
    "belongs to neither sublayer, so no attention or MLP contribution satisfies layer_input + attention_output "
    "+ mlp_output == layer_output"
)
def _declines(config, layer: int) -> dict:
    return {"attention_output": _RESIDUAL, "mlp_output": _RESIDUAL}


def _entering(model, tokens, positions):
    """``((tokens + input_hidden_states_bias) · input_hidden_states_scale)`` in fp32, as ZAYA's forward makes it."""
    inner = model.model
    return ((tokens + inner.input_hidden_states_bias) * inner.input_hidden_states_scale).to(torch.float32)


ZAYA = Family(
    name="zaya",
    model_types=("zaya",),
    embeddings=Embeddings(combine=_entering),
    mlp_output=Site("mlp", index=0),
    router_logits=Site("mlp.gate", op="router_logits_0"),
    expert_weights=Site("mlp.gate", index=1, flat=True),
    expert_indices=Site("mlp.gate", op="torch_topk_0", index=1),
    block_extras=1,
    passes_state=True,
    declines=_declines,
    model_declines={"resume": (
        "ZAYA's router reads the previous block's router state (each block returns it for the next), and a "
        "forward resumed at layers[L] from the recorded stream starts block L without it, so it is not the "
        "forward; skip_layers hands a skipped block's state through, as the model would without that block"
    )},
    residual=(
        "h = (attn(input_layernorm(x)) + b_h)·s_h + (x + b_r)·s_r; "
        "y = (mlp(post_attention_layernorm(h)) + b_h')·s_h' + (h + b_r')·s_r'"
    ),
)

FAMILIES = [ZAYA]
