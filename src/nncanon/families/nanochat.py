"""NanoChat: a Llama block (parameter-free RMSNorm, ReLU² MLP ``fc1``/``fc2``) with soft-capped logits.

The one final norm runs twice: on the embeddings before block 0 and on the last block's output.
``layers[0].layer_input`` is therefore the normed embedding, and the logits are
``tanh(lm_head(norm(h)) / c) · c`` with ``c = final_logit_softcapping`` (no cap where unset).
"""

from .base import Embeddings, Family, LogitStep

_TWICE = ("NanoChat's final norm (model.norm) runs twice, on the embeddings before block 0 and on the last block's "
          "output: a value read at the module would be the first call's; read layers[0].layer_input for the first")

NANOCHAT = Family(
    name="nanochat",
    model_types=("nanochat",),
    embeddings=Embeddings(norm="model.norm"),
    final_norm="lm_head",
    logit_steps=(LogitStep("softcap", "final_logit_softcapping"),),
    model_declines={"final_norm_scale": _TWICE, "final_normalized": _TWICE},
)

FAMILIES = [NANOCHAT]
