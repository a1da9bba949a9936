"""Doge: a Llama-shaped block whose residual path is rescaled by learned per-channel gains.

``h = a ⊙ x + self_attn(input_layernorm(x)); y = b ⊙ h + mlp(post_attention_layernorm(h))`` with
``a = input_residual`` and ``b = post_attention_residual`` (parameters, initialised to ones and
trained away from them). The block's update ``y - x = (b ⊙ a - 1) ⊙ x + b ⊙ attn + mlp`` is then not
a sum of what attention and the MLP add (it rescales the stream itself), so ``attention_output``
and ``mlp_output`` are declined. The rest is served as in Llama: the stream before and after each
block, the per-head outputs at ``o_proj``'s input (the dynamic mask only changes which keys a
query sees, through the probabilities). ``value_states`` is declined: the dynamic mask is computed from
the values before they reach the kernel, so the kernel's value input is not the only way the values act
(a write there, or its gradient, misses the mask).
"""

from .base import Family

_REASON = (
    "Doge rescales the residual stream with learned per-channel gains (h = input_residual ⊙ x + attn, "
    "y = post_attention_residual ⊙ h + mlp), so the block's update is not attention's plus the MLP's "
    "contribution; read layer_input/layer_output, or self_attn.output / mlp.output for the raw module outputs"
)

_MOE_REASON = (
    "Doge's cross-domain mixture of experts (is_moe) retrieves experts by product keys, "
    "not through a router nncanon serves"
)


_VALUES = (
    "Doge computes its dynamic attention mask from the values before the attention kernel receives them: "
    "a write to the kernel's value input (or its gradient) does not reach the mask"
)


def _declines(config, layer):
    declined = {"attention_output": _REASON, "mlp_output": _REASON, "value_states": _VALUES}
    if getattr(config, "is_moe", False):
        declined.update(dict.fromkeys(("router_logits", "expert_weights", "expert_indices"), _MOE_REASON))
    return declined


DOGE = Family(
    name="doge",
    model_types=("doge",),
    declines=_declines,
    residual=(
        "h = input_residual ⊙ x + attn(input_layernorm(x)); "
        "y = post_attention_residual ⊙ h + mlp(post_attention_layernorm(h))"
    ),
)

FAMILIES = [DOGE]
