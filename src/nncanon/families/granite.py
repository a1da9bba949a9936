"""Granite: a Llama block whose sublayer outputs are scaled before they join the stream.

``h = x + r·self_attn(input_layernorm(x)); y = h + r·mlp(post_attention_layernorm(h))`` with
``r = residual_multiplier``: no module outputs the contribution, so it is served as ``r`` times
the module's output, and a write is divided by ``r`` on the way back (only the elements the user
changed). ``embedding_multiplier`` scales ``embed_tokens``' output before block 0, and the
logits are ``lm_head(norm(h)) / logits_scaling``. Granite-SWA adds sliding-window layers and a
learnable per-head attention sink: its probabilities are the softmax over the real keys, and the
model then scales each head's output by ``sigmoid(logsumexp - sink)``.
"""

from ..served import Site
from .base import Embeddings, Family, LogitStep

GRANITE = Family(
    name="granite",
    model_types=("granite", "granite_swa"),
    embeddings=Embeddings(scale="embedding_multiplier"),
    attention_output=Site("self_attn", index=0, scale="residual_multiplier"),
    mlp_output=Site("mlp", scale="residual_multiplier"),
    logit_steps=(LogitStep("divide", "logits_scaling"),),
    residual="h = x + r·attn(input_layernorm(x)); y = h + r·mlp(post_attention_layernorm(h)), r = residual_multiplier",
)

FAMILIES = [GRANITE]
