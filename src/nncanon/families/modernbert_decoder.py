"""ModernBERT decoder: pre-norm blocks (``attn_norm`` is the identity on block 0), ``attn.Wo`` and a
gated ``mlp``; global and sliding-window layers alternate. The logits are
``decoder(lm_head(final_norm(h)))``: ``lm_head`` is a prediction head (dense, activation, norm)
run before the ``decoder`` projection, so the lens runs it too.
"""

from ..served import Site
from .base import Embeddings, Family

MODERNBERT_DECODER = Family(
    name="modernbert-decoder",
    model_types=("modernbert-decoder",),
    embeddings=Embeddings(norm="model.embeddings.norm"),
    embed_tokens="model.embeddings.tok_embeddings",
    norm="model.final_norm",
    before_head=("lm_head",),
    lm_head="decoder",
    attention="attn",
    attention_output=Site("attn", index=0),
    head_outputs=Site("attn.Wo", key="input"),
    residual="h = x + attn(attn_norm(x)); y = h + mlp(mlp_norm(h))",
)

FAMILIES = [MODERNBERT_DECODER]
