"""Each head's contribution through the attention's output projection."""

from __future__ import annotations

from typing import Any

import torch

from ..errors import ValueNotAvailable


def output_projection(model: Any, layer: int) -> torch.nn.Module:
    """The module that maps block ``layer``'s head outputs to the stream (``o_proj``, ``c_proj``, ``dense``...).

    Found from where ``attention_head_outputs`` is read: the input of this module.
    """
    attention = model.layers[layer].self_attn
    binding = attention._nncanon.bindings.get("attention_head_outputs")
    reason = attention._nncanon.reason("attention_head_outputs")
    if binding is None or reason is not None or binding.site.key != "input":
        raise ValueNotAvailable(
            f"layers[{layer}].self_attn has no per-head output projection to split"
            + (f": {reason}" if reason else "")
        )
    return model.layers[layer].get(binding.site.module)._module


def projection_weights(model: Any, layer: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The output projection of block ``layer`` per head: ``(W [heads, head_dim, hidden], bias [hidden] | None)``.

    Handles ``nn.Linear`` (weight ``[out, in]``) and GPT-2's ``Conv1D`` (weight ``[in, out]``).
    """
    module = output_projection(model, layer)
    weight = module.weight
    if type(module).__name__ == "Conv1D":  # transformers' GPT-2 style: y = x @ W + b, W [in, out]
        by_input = weight
    else:  # nn.Linear and its subclasses: y = x @ W.T + b, W [out, in]
        by_input = weight.T
    heads = model.num_heads
    return by_input.reshape(heads, -1, by_input.shape[-1]), getattr(module, "bias", None)


def attention_head_contributions(model: Any, layer: int) -> torch.Tensor:
    """Each head's output through its slice of the output projection, ``[batch, seq, heads, hidden]``; inside a trace.

    ``contributions.sum(-2) + bias`` is the projection's output: what the attention module adds to
    the stream before any post-norm or scale the family applies (Gemma-2's post-attention norm,
    Granite's ``residual_multiplier``). On families without those (Llama, GPT-2, ...), it sums to
    ``attention_output`` minus the projection bias. Reads ``attention_head_outputs`` (so call it
    in execution order with the other values of the trace).

    Example:
        >>> with model.trace(prompt):
        ...     per_head = attention_head_contributions(model, 3).save()   # [b, s, H, d]
    """
    heads = model.layers[layer].self_attn.attention_head_outputs  # [b, s, H, head_dim]
    weight, _ = projection_weights(model, layer)
    return torch.einsum("bshk,hkd->bshd", heads, weight.to(heads.dtype))
