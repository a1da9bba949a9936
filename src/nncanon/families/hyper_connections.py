"""HY-V4 and DeepSeek-V4: blocks on ``k = hc_mult`` hyper-connection streams, kept as ``[b, s, k, d]``.

``layer_input`` and ``layer_output`` are the model's own stream tensor, ``[b, s, k, d]`` (axis 2: the
stream; the embeddings repeated ``k`` times enter block 0). Each sublayer reads a learned mix of the
streams (``pre``, from its hyper-connection module ``attn_hc`` / ``ffn_hc``) and writes its output ``out``
(``[b, s, d]``) into every stream with a learned per-stream weight ``post`` (``[b, s, k]``), in one
expression of the block's forward: ``post[..., None] · out[..., None, :] + streams``. That product is
what the sublayer adds to each stream, ``[b, s, k, d]``; it is no operation, so it is served as a
``weighted`` site (`nncanon.served.Site.weighted`): read as the model's own product of its two
operands, written by adding it to the streams in the model's own sum.

- HY-V4 adds it to the streams as they are: ``h = x + post_a ⊗ attn``, ``y = h + post_m ⊗ mlp``, so
  ``layer_input + attention_output + mlp_output == layer_output`` stream by stream.
- DeepSeek-V4 first mixes the streams by ``comb`` (a ``k × k`` doubly stochastic matrix computed from
  them by each hyper-connection): ``h = combₐᵀ·x + post_a ⊗ attn``, ``y = combₘᵀ·h + post_m ⊗ mlp``.
  The MLP's write is additive on ``layer_output`` and is served; attention's is mixed by ``combₘ`` (a
  function of ``h`` itself) before it reaches ``layer_output``, so ``attention_output`` is declined,
  naming that mixing.

The final collapse of the streams (``model.hc_head``: a learned mix, ``[b, s, k, d] → [b, s, d]``) and
the norm after it are the model's final norm, so ``project_on_vocab`` takes a ``[b, s, k, d]`` stream.
"""

from __future__ import annotations

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
    norm="model.hc_head",
    before_head=("model.norm",),
    attention_output=Site(op="residual_float_0", weighted=("unsqueeze_0", "unsqueeze_1")),
    mlp_output=Site(op="residual_float_1", weighted=("unsqueeze_2", "unsqueeze_3")),
    head_shape=lambda config, layer: (config.num_attention_heads, config.v_head_dim),
    block_extras=1,
    residual=(
        "(post_a, u) = attn_hc(x); h = x + post_a ⊗ attn(norm1(u)); "
        "(post_m, v) = ffn_hc(h); y = h + post_m ⊗ mlp(norm2(v)), on [b, s, k, d] streams"
    ),
    layouts={"moe": DEEPSEEK_MOE, "dense": {}},
    layout_of=_mlp_layer_types,
    model_declines={"resume": _SHARED_TOPK},
)

FAMILIES = [HY_V4]
