"""HY-V4 and DeepSeek-V4: blocks on ``k = hc_mult`` hyper-connection streams, kept as ``[b, s, k, d]``.

The model's stream tensor is ``[b, s, k, d]`` (the embeddings repeated ``k`` times enter block 0); like
every multi-stream family's, ``layer_input`` and ``layer_output`` serve it merged, the ``k`` streams side by
side, ``[b, s, k·d]`` (a view; ``.view(b, s, k, d)`` gives the stream axis; `Family.merged_streams`). Each
sublayer reads a learned mix of the streams (``pre``, from its hyper-connection module ``attn_hc`` /
``ffn_hc``) and writes its output ``out`` (``[b, s, d]``) into every stream with a learned per-stream weight
``post`` (``[b, s, k]``), in one expression of the block's forward: ``post[..., None] · out[..., None, :] +
streams``. That product is what the sublayer adds to each stream, ``[b, s, k, d]``, served merged like the
stream, ``[b, s, k·d]``; it is no operation, so it is served as a ``weighted`` site
(`nncanon.served.Site.weighted`): read as the model's own product of its two operands, written by adding it
to the streams in the model's own sum.

- HY-V4 adds it to the streams as they are: ``h = x + post_a ⊗ attn``, ``y = h + post_m ⊗ mlp``, so
  ``layer_input + attention_output + mlp_output == layer_output`` stream by stream.
- DeepSeek-V4 first mixes the streams by ``comb`` (a ``k × k`` doubly stochastic matrix computed from
  them by each hyper-connection): ``h = combₐᵀ·x + post_a ⊗ attn``, ``y = combₘᵀ·h + post_m ⊗ mlp``.
  The MLP's write is additive on ``layer_output`` and is served; attention's is mixed by ``combₘ`` (a
  function of ``h`` itself) before it reaches ``layer_output``, so ``attention_output`` is declined,
  naming that mixing.

HY-V4's blocks return the top-k keys their sparse-attention indexer picked, and a block whose indexer is
``"shared"`` (``config.indexer_types``) attends to the picks it is handed: a skipped block hands on the picks it
was given. A ``"shared"`` block cannot run without them, so a skip of a ``"full"`` block followed by a
``"shared"`` one fails in the model, and a forward resumed at a later block is declined.

DeepSeek-V4's heads are the input of its grouped output projection (``o_a_proj``: ``o_groups`` groups of heads,
each projected on its own, then ``o_b_proj``), ``[b, s, H, head_dim]``; each reaches the stream through its
slice of its group's block and that group's columns of ``o_b_proj`` (the family's head totals). Its
probabilities on a compressed-attention block (``compressed_sparse_attention``, ``heavily_compressed_attention``)
run over the sequence's keys and then the compressor's entries, ``[b, H, q, s + compressed]``; like gpt-oss's,
they leave out the learned sink, so a row sums to less than one.

The final collapse of the streams (``model.hc_head``: a learned mix, ``[b, s, k, d] → [b, s, d]``) and
the norm after it are the model's final norm, so ``project_on_vocab`` takes the served ``[b, s, k·d]`` stream.
"""

from __future__ import annotations

from typing import Any

import torch

from ..quantization import dense_weight
from ..served import Site
from .base import Family
from .moe import DEEPSEEK_MOE, _mlp_layer_types

_SHARED_TOPK = (
    "a block whose indexer is 'shared' (config.indexer_types) reuses the top-k keys the previous 'full' block "
    "returns (prev_topk_indices), which a forward resumed at a later block does not have"
)

HY_V4 = Family(
    name="hy_v4",
    model_types=("hy_v4",),
    casts_head_input=True,
    norm="model.hc_head",
    before_head=("model.norm",),
    final_norm="model.norm",
    attention_output=Site(op="residual_float_0", weighted=("unsqueeze_0", "unsqueeze_1"), merge=True),
    mlp_output=Site(op="residual_float_1", weighted=("unsqueeze_2", "unsqueeze_3"), merge=True),
    head_shape=lambda config, layer: (config.num_attention_heads, config.v_head_dim),
    block_extras=1,
    passes_state="prev_topk_indices",
    merged_streams=True,
    residual=(
        "(post_a, u) = attn_hc(x); h = x + post_a ⊗ attn(norm1(u)); "
        "(post_m, v) = ffn_hc(h); y = h + post_m ⊗ mlp(norm2(v)), on [b, s, k, d] streams"
    ),
    layouts={"moe": DEEPSEEK_MOE, "dense": {}},
    layout_of=_mlp_layer_types,
    model_declines={"resume": _SHARED_TOPK},
)


def _grouped_head_totals(model: Any, layer: int, heads: torch.Tensor, inputs: dict
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V4's heads (the input of its grouped projection, ``[b, s, H, head_dim]``), each through its slice
    of its group's block of ``o_a_proj`` and that group's columns of ``o_b_proj``, summed; and the attention's
    output, from a plain forward of the unwrapped model on ``inputs`` with a hook."""
    attention = model._module.get_submodule(model.family.layers)[layer].self_attn
    seen = {}
    hook = attention.register_forward_hook(lambda module, args, out: seen.__setitem__("out", out[0].clone()))
    try:
        with torch.no_grad():
            model._module(**inputs)
    finally:
        hook.remove()
    groups, (b, s, count, width) = attention.config.o_groups, heads.shape
    first = dense_weight(attention.o_a_proj).reshape(groups, -1, count // groups, width)  # [G, r, heads/group, hd]
    second = dense_weight(attention.o_b_proj)
    second = second.reshape(second.shape[0], groups, -1)  # [d, G, r]
    with torch.no_grad():
        per_head = torch.einsum("bsgjh,grjh->bsgjr", heads.view(b, s, groups, -1, width), first)
        total = torch.einsum("bsgjr,dgr->bsgjd", per_head, second).sum(dim=(2, 3))
    return total, seen["out"]


def _deepseek_v4_declines(config, layer: int) -> dict:
    declines = {
        "attention_output": (
            "DeepSeek-V4 writes attention into the streams (post ⊗ attn) after mixing them by attn_hc's comb, and "
            "ffn_hc then mixes the streams again by its own comb (a k × k doubly stochastic matrix computed from "
            "them): attention reaches layer_output as combₘᵀ·(post ⊗ attn), through a mixing that depends on it, "
            "not as an additive term, and layer_input reaches it as combₘᵀ·combₐᵀ·x"
        ),
        **dict.fromkeys(("key_states", "value_states"), (
            "DeepSeek-V4's attention hands one tensor, kv, to the kernel as both its keys and its values: "
            "key_states and value_states would be one tensor, so a write to either (or its gradient) is "
            "also the other's"
        )),
    }
    if config.mlp_layer_types[layer] == "hash_moe":
        reason = (
            "a hash-routed block (config.mlp_layer_types): each token's experts are a fixed table of its token id "
            "(mlp.gate.tid2eid), not chosen from the router logits, so a write to the logits does not reroute"
        )
        declines.update({name: reason for name in ("router_logits", "expert_weights", "expert_indices")})
    return declines


DEEPSEEK_V4 = Family(
    name="deepseek_v4",
    model_types=("deepseek_v4",),
    norm="model.hc_head",
    before_head=("model.norm",),
    final_norm="model.norm",
    attention_output=Site(op="torch_matmul_0", weighted=("unsqueeze_0", "attn_output_unsqueeze_0"),
                          merge=True),
    mlp_output=Site(op="torch_matmul_1", weighted=("unsqueeze_1", "mlp_output_unsqueeze_0"), merge=True),
    head_outputs=Site("self_attn.o_a_proj", key="input", merge=True),
    head_totals=_grouped_head_totals,
    router_logits=Site("mlp.gate", op="logits_0", flat=True),
    expert_weights=Site("mlp.gate", index=1, flat=True),
    expert_indices=Site("mlp.gate", index=2, flat=True),
    shared_expert_output=Site("mlp.shared_experts"),
    merged_streams=True,
    residual=(
        "(post_a, comb_a, u) = attn_hc(x); h = comb_aᵀ·x + post_a ⊗ attn(norm1(u)); "
        "(post_m, comb_m, v) = ffn_hc(h); y = comb_mᵀ·h + post_m ⊗ mlp(norm2(v)), on [b, s, k, d] streams"
    ),
    declines=_deepseek_v4_declines,
    layouts={"hash_moe": {}, "moe": {}},
    layout_of=lambda config, layer: config.mlp_layer_types[layer],
)

FAMILIES = [HY_V4, DEEPSEEK_V4]
