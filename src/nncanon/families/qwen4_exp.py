"""Qwen4-Exp (text): Qwen3-Next's mixers and MoE on a hyper-connected residual stream.

(A ``qwen4_exp`` checkpoint loads as its text model, ``Qwen4ExpForCausalLM``, for text generation.)

The stream is ``k = hc_count`` copies of the hidden state side by side: ``layer_input`` and
``layer_output`` are ``[b, s, k·d]`` (the embeddings repeated ``k`` times enter block 0). Each
sublayer reads a mix of the copies, ``(u, X, w) = hyper_connection(X)`` with ``u`` ``[b, s, d]`` and
per-copy weights ``w`` ``[b, s, k]``, and writes its output into every copy, scaled:
``X = X + flatten(out[..., None, :] · w[..., None])``. A block is therefore additive,
``y = x + inject(mixer(u_a), w_a) + inject(mlp(u_m), w_m)``, and the contributions are those
injections, ``[b, s, k·d]`` like the stream (read where the block binds ``injection``, merged; a view).
The mixer is a gated DeltaNet (``linear_attention``, served as ``linear_attn``) or gated softmax
attention with a sparse-attention indexer (``indexed_attention``, served as ``self_attn``); the MLP
is a sparse MoE with a sigmoid-gated shared expert. The final collapse of the ``k`` copies
(``model.hyper_connection_mixer``: a norm and a learned mix, ``[b, s, k·d] → [b, s, d]``) is the
model's final norm. Blocks with a per-layer embedding (``ple_layer_ids``) add a third term before
the attention: their contributions are declined.
"""

from ..served import Site
from ..versions import transformers_minor
from .base import Family
from .qwen3_next import DELTANET, QWEN_MOE

#: Before transformers 5.25 the scores with this family's sinks are not proved (softmax of them gave NaN on 5.21).
_OLD_SCORES = ({"attention_scores": "transformers' Qwen4-exp before 5.25: its attention's scores with the sinks are "
                "not proved on this minor (attention_probabilities are served); load with transformers 5.25 or later"}
               if transformers_minor() < (5, 25) else {})


def _declines(config, layer: int) -> dict:
    if layer + 1 not in (getattr(config, "ple_layer_ids", None) or []):
        return dict(_OLD_SCORES)
    reason = (
        f"layers[{layer}] adds a per-layer embedding to the stream before its attention "
        "(x = x + ple(x, input_ids)), a third term that is neither the mixer's nor the MLP's"
    )
    return {**_OLD_SCORES, **{name: reason for name in ("attention_output", "linear_attention_output", "mlp_output")}}


QWEN4_EXP = Family(
    name="qwen4_exp",
    model_types=("qwen4_exp_text", "qwen4_exp"),
    norm="model.hyper_connection_mixer",
    attention_output=Site(op="injection_0", merge=True),
    mlp_output=Site(op="injection_1", merge=True),
    declines=_declines,
    residual=(
        "(u, X, w) = attn_hyper_connection(x); h = X + flat(mixer(u) ⊗ w); "
        "(v, H, w') = mlp_hyper_connection(h); y = H + flat(mlp(v) ⊗ w')"
    ),
    layouts={
        "linear_attention": dict(DELTANET, mixer_output=Site(op="injection_0", merge=True)),
        "indexed_attention": {},
    },
    layout_of=lambda config, layer: config.layer_types[layer],
    **QWEN_MOE,
)

FAMILIES = [QWEN4_EXP]
