"""Tests of nncanon.sae."""

from __future__ import annotations

import torch

from nncanon.proof.checks.references import encode, hf_block


def block_output_and_gradient(model, layer: int, token: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Block ``layer``'s output on the first prompt and the gradient of the last position's ``token`` logit with
    respect to it, read by a plain forward hook and ``backward`` on the unwrapped model."""
    stream = {}

    def keep(module, args, output):
        tensor = output[0] if isinstance(output, tuple) else output
        tensor.retain_grad()
        stream["x"] = tensor

    handle = hf_block(model, layer).register_forward_hook(keep)
    try:
        logits = model._module(**encode(model)).logits
        logits[0, -1, token].backward()
    finally:
        handle.remove()
        model._module.zero_grad(set_to_none=True)
    return stream["x"].detach(), stream["x"].grad
