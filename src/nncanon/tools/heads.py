"""Each head's contribution through the attention's output projection."""

from __future__ import annotations

from typing import Any

import torch

from ..errors import ValueNotAvailable
from ..quantization import dense_weight
from ..reading import head_count


def projection_path(model: Any, layer: int) -> str:
    """Where block ``layer``'s output projection is, relative to the block: the module whose input
    ``attention_head_outputs`` is read at, or the family's ``head_projection`` where a norm over the
    heads sits before it (BitNet)."""
    attention = model.layers[layer].self_attn
    binding = attention._nncanon.bindings.get("attention_head_outputs")
    reason = attention._nncanon.reason("attention_head_outputs")
    if binding is None or reason is not None or binding.site.key != "input":
        raise ValueNotAvailable(
            f"layers[{layer}].self_attn has no per-head output projection to split"
            + (f": {reason}" if reason else "")
        )
    spec = model.family.for_layer(model._text_config, layer)[0]
    return spec.head_projection or binding.site.module


def output_projection(model: Any, layer: int) -> torch.nn.Module:
    """The module that maps block ``layer``'s head outputs to the stream (``o_proj``, ``c_proj``, ``dense``...)."""
    return model.layers[layer].get(projection_path(model, layer))._module


def head_norm(model: Any, layer: int) -> torch.nn.Module | None:
    """The norm over all heads between block ``layer``'s heads and its output projection (BitNet), or ``None``."""
    path = model.family.for_layer(model._text_config, layer)[0].head_norm
    return None if path is None else model.layers[layer].get(path)._module


def projection_input(model: Any, layer: int, heads: torch.Tensor) -> torch.Tensor:
    """``heads`` ``[..., H, head_dim]`` as they enter block ``layer``'s output projection.

    The heads themselves, or, where a norm over all heads sits before the projection (BitNet), their
    normed values: each head's slice of the norm's output, as the norm ran on all of them together.
    """
    norm = head_norm(model, layer)
    if norm is None:
        return heads
    # The class's forward, without the module's hooks: this runs inside a trace, where nnsight hooks them.
    return type(norm).forward(norm, heads.flatten(-2)).view_as(heads)


def projection_weights(model: Any, layer: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The output projection of block ``layer`` per head: ``(W [heads, head_dim, hidden], bias [hidden] | None)``.

    Handles ``nn.Linear`` (weight ``[out, in]``), GPT-2's ``Conv1D`` (weight ``[in, out]``) and quantized layers
    (bitsandbytes, torchao, quanto: dequantized, `nncanon.quantization.dense_weight`). The split reads the
    layer's declared width and the head count of the config, never the weight's storage shape (a packed 4-bit
    weight is ``[in·out/2, 1]``).
    """
    module = output_projection(model, layer)
    by_input = dense_weight(module).T  # [in, out]: y = x @ W.T + b
    heads = head_count(model, layer)
    return by_input.reshape(heads, -1, by_input.shape[-1]), getattr(module, "bias", None)


def attention_head_contributions(model: Any, layer: int) -> torch.Tensor:
    """Each head's output through its slice of the output projection, ``[batch, seq, heads, hidden]``; inside a trace.

    ``contributions.sum(-2) + bias`` is the projection's output: what the attention module adds to
    the stream before any post-norm or scale the family applies (Gemma-2's post-attention norm,
    Granite's ``residual_multiplier``). Where a norm over all heads sits before the projection
    (BitNet), each head goes through it as it ran on all heads together. On families without those
    (Llama, GPT-2, ...), it sums to ``attention_output`` minus the projection bias. Reads
    ``attention_head_outputs`` (so call it in execution order with the other values of the trace).

    Example:
        >>> with model.trace(prompt):
        ...     per_head = attention_head_contributions(model, 3).save()   # [b, s, H, d]
    """
    heads = projection_input(model, layer, model.layers[layer].self_attn.attention_head_outputs)  # [b, s, H, hd]
    weight, _ = projection_weights(model, layer)
    return torch.einsum("bshk,hkd->bshd", heads, weight.to(heads.dtype))
