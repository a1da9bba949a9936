"""Mllama (Llama-3.2-Vision), its text model: Llama blocks with gated cross-attention blocks interleaved.

``MllamaForCausalLM`` (the causal LM transformers builds for an ``mllama`` checkpoint, from its text
config ``mllama_text_model``) has Llama self-attention blocks, and at ``config.cross_attention_layers``
``MllamaCrossAttentionDecoderLayer`` blocks: ``h = x + tanh(attn_gate) · cross_attn(norm(x), image);
y = h + tanh(mlp_gate) · mask · mlp(norm(h))``. On text alone ``MllamaTextModel.forward`` does not call
them (``continue`` when there are no ``cross_attention_states`` and none cached), so the stream passes
them unchanged: they are idle blocks (`Family.idle`). Their ``layer_input`` and ``layer_output`` are the
stream passing them; they serve no component. ``cross_attention_states`` (image features) would make
them run: nncanon serves the text path and refuses it by name (`Family.idle_inputs`).
"""

from __future__ import annotations

from typing import Any

from .base import Family


def _idle(config: Any, layer: int) -> str | None:
    if layer not in (config.cross_attention_layers or []):
        return None
    return (
        "Mllama's text model runs its cross-attention decoder layers (cross_attn over image features and an MLP, "
        "each gated by tanh of a learned gate; no self-attention) only with cross_attention_states: on text "
        "alone the stream passes them unchanged"
    )


MLLAMA = Family(
    name="mllama",
    model_types=("mllama_text_model", "mllama"),
    idle=_idle,
    idle_inputs=("cross_attention_states",),
)

FAMILIES = [MLLAMA]
