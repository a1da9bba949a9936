"""RWKV (v4): time mixing (a WKV linear recurrence, served as ``linear_attn``) and channel mixing (``mlp``).

``h = x + attention(ln1(x)); y = h + feed_forward(ln2(h))`` on ``rwkv.blocks``, except block 0,
which first normalises its own input, ``x ← pre_ln(x)``: there the stream that enters the block
is not the one its sublayers add to, so block 0's contributions are declined with that equation.
Both sublayers return ``(out, state)`` and mix each token with the previous one (token shift);
the WKV recurrence is channel-wise, with no heads. A block takes ``state=`` and returns
``(hidden, state, attention)``; the model hands each block the state the previous one returned.
In inference, with ``rescale_every > 0``, the model divides the output projections' weights by
``2^(i // rescale_every)`` at its first forward (the model's own doing) and halves the stream after
every ``rescale_every``-th block, between blocks: ``layers[i + 1].layer_input`` is then
``layers[i].layer_output / 2``, and where the last block is such a block (RWKV-4 169M: 12 layers,
``rescale_every=6``) the stream is halved once more before the final norm, ``rwkv.ln_out``, and the
head, ``head``: ``project_on_vocab`` does the same (a ``divide_stream`` step), so the lens on the last
layer's output is the logits. (In training mode the model does not rescale; nncanon serves inference.)
"""

from ..served import Site
from .base import Embeddings, Family, LogitStep, MLPAnatomy

_PRE_LN = (
    "layers[0] normalises its own input before anything else: y = h + feed_forward(ln2(h)), "
    "h = pre_ln(x) + attention(ln1(pre_ln(x))), so x (the stream entering the block) is not what its "
    "contributions add to: layer_input + linear_attention_output + mlp_output != layer_output"
)


def _halved_after_last_block(config) -> int | None:
    """2 where the model halves the stream after its last block too (layers a multiple of rescale_every)"""
    every = config.rescale_every
    return 2 if every > 0 and config.num_hidden_layers % every == 0 else None


def _declines(config, layer: int) -> dict:
    return {"linear_attention_output": _PRE_LN, "mlp_output": _PRE_LN} if layer == 0 else {}


RWKV = Family(
    name="rwkv",
    model_types=("rwkv",),
    embeddings=Embeddings(positions_kind="recurrent"),
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
    logit_steps=(LogitStep("divide_stream", _halved_after_last_block),),
    residual="h = x + attention(ln1(x)); y = h + feed_forward(ln2(h)) (block 0: x = pre_ln(x) first)",
    token_shift_after=("linear_attention_output",),  # the channel mixing shifts tokens
    # The channel mixing: receptance(x) gates value(relu(key(x))²), its neurons the squared ReLU's output.
    mlp_anatomy=MLPAnatomy(down="feed_forward.value", pre="feed_forward.key", activation="relu2"),
)

FAMILIES = [RWKV]
