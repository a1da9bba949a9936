"""Gemma-3n (text, and the text path of the multimodal model): AltUp streams stacked first, ``[k, b, s, d]``.

The model keeps ``k = altup_num_inputs`` streams (the embeddings and ``k - 1`` learned projections of
them, rescaled to their magnitude) and hands each block the stack ``X`` ``[k, b, s, d]``. A block:

``P = X + mix(X)`` (AltUp predict: every stream predicted from all of them, by coefficients routed from
the active stream); ``a = P[active]``; ``n = input_layernorm(a)``;
``h = (a + post_attention_layernorm(attn(n)) + laurel(n)) / sqrt(2)`` (LAuReL: ``n`` plus a low-rank
branch, post-normed); ``act = h + post_feedforward_layernorm(mlp(pre_feedforward_layernorm(h)))``;
``Y = P + c(act) ⊗ (act - a)`` (AltUp correct: the innovation ``act - a`` written into every stream with
coefficients ``c`` routed from ``act`` itself); ``Y[1:] += per_layer_input_term(Y[active])``.

What nncanon serves:

- ``layer_input`` / ``layer_output``: the model's own stream stack, sequence-first with the streams side
  by side, ``[b, s, k·d]`` (stream ``j`` is ``.view(b, s, k, d)[:, :, j]``), as hyper-connected streams
  are served; a copy, whose edits are written back into the stack.
- Heads (``o_proj``'s input), probabilities (eager; also on the blocks that reuse another block's
  keys/values), the lens and skips.
- ``project_on_vocab`` takes the ``[b, s, k·d]`` stream and collapses it as the model does after its
  last block (each non-active stream through its ``altup_unembed_projections``, rescaled to the active
  stream's magnitude, then the mean of the ``k``), before the final norm, head and soft-cap.

What it declines, and why: ``attention_output`` and ``mlp_output``. No additive decomposition of
``Y - X`` into an attention term and an MLP term exists: the prediction ``mix(X)`` belongs to no
sublayer; the active stream is rescaled by ``1/sqrt(2)`` together with LAuReL's branch
(``a·(1/sqrt(2) - 1)`` is part of ``act - a``); the correction coefficients ``c(act)`` depend on the
sublayers' outputs (through a tanh router), so a sublayer's share of ``Y`` is not a fixed function of
its own output; and the per-layer-input term is computed from the corrected stream. ``resume`` is
declined where blocks share keys/values (``num_kv_shared_layers > 0``): the blocks after the sharing
point read keys/values an earlier block stores during the same forward, which a resumed forward never
runs; a skip that would leave such a block without them is refused with that reason.

Attribution graphs (`nncanon.graphs`): the frozen replacement model freezes AltUp's routed coefficients, LAuReL's
post-norm scale and the per-layer-input branch (`nncanon.components.norm_gates.BLOCK_GATES`), the value norm, and
the magnitudes rescaling the stacking and the collapse (``rescale``, with the final norm's scale:
`nncanon.graphs.streams`, `nncanon.graphs.head`); a transcoder writes the MLP module's output.
"""

from __future__ import annotations

from dataclasses import replace
from functools import partial
from typing import Any

import torch

from ..served import Site
from ..versions import transformers_minor
from .base import Family, LogitStep, stranded_readers


def _rescale(text_model: str, model: torch.nn.Module, where: str, stream: torch.Tensor,
             magnitudes: list[torch.Tensor] | None = None) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Gemma-3n's AltUp stacking of the embeddings (``where`` ``"expand"``: ``[b, s, d]`` to the stream entering
    block 0, ``[b, s, k·d]``) or unembedding of the stream (``"collapse"``: ``[b, s, k·d]`` to ``[b, s, d]``, before
    the final norm), as the model computes it: each of the ``k - 1`` projections rescaled to the first stream's
    magnitude, ``current · target / magnitude``. With ``magnitudes`` (``[b or 1, s, 1]`` each: ``target``, then each
    projection's ``magnitude``) those are used instead of the ones computed from ``stream`` (an attribution graph's
    frozen values, the clean run's; the same operations, so the same values where they are the same). Returns the
    result and the magnitudes used."""
    text = model.get_submodule(text_model)
    k = text.config.altup_num_inputs
    projections = text.altup_projections if where == "expand" else text.altup_unembed_projections
    streams = [stream] if where == "expand" else list(stream.unflatten(-1, (k, -1)).unbind(-2))
    first = streams[0].contiguous()
    found = [torch.mean(first**2, dim=-1, keepdim=True) ** 0.5]
    parts = [first]
    for index, projection in enumerate(projections, start=1):
        # (the layer's own computation, a quantized one's kernel included, without the module's hooks: the model
        # has run past it in the trace)
        source = streams[0 if where == "expand" else index].contiguous()
        current = type(projection).forward(projection, source).to(first.dtype)
        found.append(torch.sqrt(torch.mean(current**2, dim=-1, keepdim=True).clamp(min=1e-5)))
        target, magnitude = (found[0], found[index]) if magnitudes is None else (magnitudes[0], magnitudes[index])
        parts.append(current * target.to(current.dtype) / magnitude.to(current.dtype))
    used = found if magnitudes is None else list(magnitudes)
    if where == "expand":
        return torch.stack(parts, dim=-2).flatten(-2), used
    return torch.mean(torch.stack(parts), dim=0), used


_MIXING = (
    "a Gemma-3n block has no additive attention or MLP contribution to its streams: AltUp predicts every "
    "stream from all of them (a term no sublayer owns), the active stream and attention are averaged with "
    "the LAuReL branch and scaled by 1/sqrt(2) (rescaling the stream itself), AltUp's correction writes the "
    "sublayers' result into each stream with coefficients routed from that result (tanh), and a per-layer-"
    "input term is added to the non-active streams: layer_input + attention_output + mlp_output == "
    "layer_output holds for no choice of the two values"
)


def _declines(config: Any, layer: int) -> dict:
    declines = {"attention_output": _MIXING, "mlp_output": _MIXING}
    for store, readers in _shared_kv(config).items():
        if readers and layer in (store, *readers):
            declines.update(dict.fromkeys(("key_states", "value_states"), (
                f"layers[{store}]'s keys and values are also those of layers {readers} (Gemma-3n's KV sharing, "
                f"num_kv_shared_layers={config.num_kv_shared_layers}): the kernel's key and value inputs here are "
                f"one tensor shared by those blocks, so a write to them (or their gradient) is not this block's "
                f"alone")))
    return declines


def _kv_sharing_modes(config: Any) -> list[str | None]:
    """Per block: ``"store"`` (keeps its keys/values for later blocks), ``"reuse"`` or ``None``.

    From transformers 5.23 the config says (``kv_sharing_modes``); before, each attention module works it
    out in its ``__init__`` with the same rule: the last ``num_kv_shared_layers`` blocks reuse, and the last
    block of each layer type before them stores.
    """
    if transformers_minor() >= (5, 23):
        return config.kv_sharing_modes
    if not config.num_kv_shared_layers:
        return [None] * config.num_hidden_layers
    first = config.num_hidden_layers - config.num_kv_shared_layers
    before = config.layer_types[:first]
    modes: list[str | None] = [None] * config.num_hidden_layers
    for layer, kind in enumerate(config.layer_types):
        if layer >= first > 0:
            modes[layer] = "reuse"
        elif layer == len(before) - 1 - before[::-1].index(kind):
            modes[layer] = "store"
    return modes


def _shared_kv(config: Any) -> dict[int, list[int]]:
    """Each block that stores keys/values for later blocks, with the blocks that reuse them."""
    modes = _kv_sharing_modes(config)
    kinds = config.layer_types
    return {
        store: [j for j, mode in enumerate(modes) if mode == "reuse" and kinds[j] == kinds[store]]
        for store, mode in enumerate(modes) if mode == "store"
    }


def _refuse_skip(config: Any, start: int, end: int) -> str | None:
    stranded = stranded_readers(_shared_kv(config), start, end)
    if stranded is None:
        return None
    store, later = stranded
    return (
        f"layers[{store}] stores the {config.layer_types[store]} keys/values that layers {later} reuse "
        f"(Gemma-3n's KV sharing, num_kv_shared_layers={config.num_kv_shared_layers}), and a skipped "
        f"block stores none. Skip through layers[{max(later)}] as well, or leave layers[{store}] running"
    )


def _model_declines(config: Any) -> dict[str, str]:
    if not any(_shared_kv(config).values()):
        return {}
    return {"resume": (
        f"the last {config.num_kv_shared_layers} blocks reuse the keys/values that earlier blocks store during "
        "the same forward (Gemma-3n's KV sharing); a forward resumed past those blocks would run without them"
    )}


_RESIDUAL = (
    "P = X + altup.predict(X); a = P[active]; n = input_layernorm(a); "
    "h = (a + post_attention_layernorm(attn(n)) + laurel(n)) / sqrt(2); "
    "act = h + post_feedforward_layernorm(mlp(pre_feedforward_layernorm(h))); "
    "Y = P + altup.correct_coefs(act) ⊗ (act - a); Y[1:] += per_layer_input_term(Y[active])"
)

GEMMA3N_TEXT = Family(
    name="gemma3n_text",
    model_types=("gemma3n_text",),
    # Where each sublayer's output enters the mixing (post-normed, as Gemma-2's): declined on every block.
    attention_output=Site("post_attention_layernorm"),
    mlp_output=Site("post_feedforward_layernorm"),
    stacked_streams=True,
    rescale=partial(_rescale, "model"),
    refuse_skip=_refuse_skip,
    model_declines=_model_declines,
    declines=_declines,
    logit_steps=(LogitStep("softcap", "final_logit_softcapping"),),
    residual=_RESIDUAL,
)

GEMMA3N = replace(
    GEMMA3N_TEXT,
    name="gemma3n",
    model_types=("gemma3n",),
    layers="model.language_model.layers",
    embed_tokens="model.language_model.embed_tokens",
    norm="model.language_model.norm",
    rescale=partial(_rescale, "model.language_model"),
)

FAMILIES = [GEMMA3N_TEXT, GEMMA3N]
