"""RWKV (v4): time mixing (a WKV linear recurrence, served as ``linear_attn``) and channel mixing (``mlp``).

``h = x + attention(ln1(x)); y = h + feed_forward(ln2(h))`` on ``rwkv.blocks``, except block 0,
which first normalises its own input, ``x ← pre_ln(x)``: there the stream that enters the block
is not the one its sublayers add to, so block 0's contributions are declined with that equation.
Both sublayers return ``(out, state)`` and mix each token with the previous one (token shift);
the WKV recurrence is channel-wise, with no heads. A block takes ``state=`` and returns
``(hidden, state, attention)``; the model hands each block the state the previous one returned.
In inference, with ``rescale_every > 0``, the model divides the output projections' weights by
``2^(i // rescale_every)`` at its first forward (the model's own doing) and halves the stream after
every ``rescale_every``-th block, between blocks. The final norm is ``rwkv.ln_out``, the head ``head``.
"""

from ..served import Site
from .base import Family

_PRE_LN = (
    "layers[0] normalises its own input before anything else: y = h + feed_forward(ln2(h)), "
    "h = pre_ln(x) + attention(ln1(pre_ln(x))), so x (the stream entering the block) is not what its "
    "contributions add to: layer_input + linear_attention_output + mlp_output != layer_output"
)


def _declines(config, layer: int) -> dict:
    return {"linear_attention_output": _PRE_LN, "mlp_output": _PRE_LN} if layer == 0 else {}


RWKV = Family(
    name="rwkv",
    model_types=("rwkv",),
    layers="rwkv.blocks",
    embed_tokens="rwkv.embeddings",
    norm="rwkv.ln_out",
    lm_head="head",
    attention=None,
    mixer="attention",
    mixer_output=Site("attention", index=0),
    mlp="feed_forward",
    mlp_output=Site("feed_forward", index=0),
    block_extras=2,
    passes_state="state",
    declines=_declines,
    residual="h = x + attention(ln1(x)); y = h + feed_forward(ln2(h)) (block 0: x = pre_ln(x) first)",
)

FAMILIES = [RWKV]
