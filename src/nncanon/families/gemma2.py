"""Gemma-2, Gemma-3 and Gemma-4 (text and multimodal): "sandwich" blocks, each sublayer normed before it is added.

``h = x + post_attention_layernorm(self_attn(input_layernorm(x)))``;
``y = h + post_feedforward_layernorm(mlp(pre_feedforward_layernorm(h)))``.

The contributions are the outputs of the post-norms, not of the attention or MLP modules (a
write into ``self_attn``'s output would be re-normalised). Here ``post_attention_layernorm`` is
the norm on attention's output, not the pre-MLP norm it names in Llama-style blocks.

Logits: Gemma-2 soft-caps them (``final_logit_softcapping``, 30.0 by default), Gemma-3/4's causal
LMs only when the config sets it, and Gemma-3's multimodal model (``Gemma3ForConditionalGeneration``)
never does, whatever its text config says. VaultGemma keeps Gemma-2's soft-caps on a plain
pre-norm block. The embedding scale ``sqrt(hidden)`` lives inside ``embed_tokens``.

Gemma-4 multiplies the whole stream by a learned ``layer_scalar`` at the end of each block (and its
E-models add a per-layer-input term), so its contributions are declined. Its checkpoints are
multimodal (``Gemma4ForConditionalGeneration``, blocks under ``model.language_model``; it soft-caps
with the text config's value). Its full-attention
layers may use another head width (``global_head_dim``) than its sliding ones: the per-head values
follow each layer's own width; where the widths differ, transformers' config has no one ``head_dim``
and ``model.head_dim`` raises ``SizeNotAvailable`` naming each layer's. Gemma-4-unified (encoder-free
multimodal: its images and audio are embedded by linear maps, no tower) has the same text blocks.
"""

from dataclasses import replace

from ..served import Site
from .base import Family, LogitStep

_SANDWICH_SITES = dict(
    attention_output=Site("post_attention_layernorm"),
    mlp_output=Site("post_feedforward_layernorm"),
)
_SANDWICH = (
    "h = x + post_attention_layernorm(attn(input_layernorm(x))); "
    "y = h + post_feedforward_layernorm(mlp(pre_feedforward_layernorm(h)))"
)
_SOFTCAP = (LogitStep("softcap", "final_logit_softcapping"),)

GEMMA2 = Family(
    name="gemma2",
    model_types=("gemma2", "gemma3_text"),
    logit_steps=_SOFTCAP,
    residual=_SANDWICH,
    **_SANDWICH_SITES,
)

GEMMA3_MULTIMODAL = Family(
    name="gemma3_multimodal",
    model_types=("gemma3",),
    layers="model.language_model.layers",
    embed_tokens="model.language_model.embed_tokens",
    norm="model.language_model.norm",
    residual=_SANDWICH,
    **_SANDWICH_SITES,
)

VAULTGEMMA = Family(
    name="vaultgemma",
    model_types=("vaultgemma",),
    logit_steps=_SOFTCAP,
    residual="h = x + attn(input_layernorm(x)); y = h + mlp(pre_feedforward_layernorm(h))",
)


def _gemma4_declines(config, layer):
    reason = (
        "a Gemma-4 block ends with `hidden_states *= layer_scalar`, a learned per-layer weight (not in the "
        "config) that scales the residual stream as well as the sublayer outputs, so no attention or MLP "
        "contribution satisfies layer_input + attention_output + mlp_output == layer_output"
    )
    if getattr(config, "hidden_size_per_layer_input", 0):
        reason += "; this configuration also adds a third term per block (the per-layer input embedding)"
    return {"attention_output": reason, "mlp_output": reason}


GEMMA4_TEXT = Family(
    name="gemma4_text",
    model_types=("gemma4_text", "gemma4_unified_text"),
    logit_steps=_SOFTCAP,
    declines=_gemma4_declines,
    residual=f"{_SANDWICH} [+ per-layer-input term]; y = y · layer_scalar",
    **_SANDWICH_SITES,
)

GEMMA4_MULTIMODAL = replace(
    GEMMA4_TEXT,
    name="gemma4",
    model_types=("gemma4", "gemma4_unified"),
    layers="model.language_model.layers",
    embed_tokens="model.language_model.embed_tokens",
    norm="model.language_model.norm",
)

FAMILIES = [GEMMA2, GEMMA3_MULTIMODAL, VAULTGEMMA, GEMMA4_TEXT, GEMMA4_MULTIMODAL]
