"""Direct logit attribution: the shares sum to the logit, and equal an independent frozen-norm computation."""

from __future__ import annotations

import pytest
import torch

from nncanon.errors import ValueNotAvailable
from nncanon.registry import variants
from nncanon.testing import PROMPTS
from nncanon.tools import cache_activations, direct_logit_attribution, freeze_norm

from .conftest import build

TARGETS = [5, 17]


def _close(a, b, scale):
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5 * float(scale))


def test_shares_sum_to_the_logit(model):
    dla = direct_logit_attribution(model, PROMPTS, TARGETS)
    scale = dla.logit.abs().max() + dla.attention.abs().max() + 1e-3
    _close(dla.total(), dla.logit, scale)
    config = model._module.config.get_text_config()
    cap = getattr(config, "final_logit_softcapping", None)
    capped = dla.logit if cap is None else torch.tanh(dla.logit / cap) * cap
    _close(capped, dla.model_logit, scale)
    _close(dla.heads.sum(-1) + dla.head_bias, dla.attention, scale)
    assert dla.heads.shape == (len(PROMPTS), model.num_layers, model.num_heads)


def test_model_logit_is_the_logits_entry(model):
    dla = direct_logit_attribution(model, PROMPTS[0], 9, position=-2, heads=False)
    with torch.no_grad(), model.trace(PROMPTS[0]):
        logits = model.logits.save()
    assert torch.equal(dla.model_logit, logits[:, -2, 9])
    assert dla.heads is None


def _explicit_frozen_norm(norm: torch.nn.Module, final: torch.Tensor):
    """The frozen final norm written out by its formula (LayerNorm, or Llama-style RMSNorm)."""
    if isinstance(norm, torch.nn.LayerNorm):
        sigma = torch.sqrt(final.var(-1, unbiased=False, keepdim=True) + norm.eps)
        return (lambda x: (x - x.mean(-1, keepdim=True)) * norm.weight / sigma), norm.bias
    eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
    sigma = torch.sqrt(final.pow(2).mean(-1, keepdim=True) + eps)
    zero_centred = any(name in type(norm).__name__ for name in ("Gemma", "Qwen3Next"))  # they scale by 1 + w
    gain = norm.weight + 1 if zero_centred else norm.weight
    return (lambda x: x * gain / sigma), torch.zeros_like(norm.weight)


def test_exact_linear_case_against_the_explicit_formula(model):
    """With the final norm's scale frozen at the full stream, each share is W_U[t] · frozen(x) · factor."""
    dla = direct_logit_attribution(model, PROMPTS, TARGETS)
    contributions = ["attention_output", "linear_attention_output", "mlp_output"]
    cache = cache_activations(model, PROMPTS, values=["layer_input", *contributions, "layer_output"])
    final = cache["layer_output"][model.num_layers - 1][:, -1]
    frozen, norm_bias = _explicit_frozen_norm(model.norm._module, final)
    config = model._module.config.get_text_config()
    factor = 1.0 / getattr(config, "logits_scaling", 1.0) if model.family.name == "granite" else 1.0
    unembed = model.lm_head._module.weight[TARGETS]  # [batch, hidden]
    lm_bias = getattr(model.lm_head._module, "bias", None)

    def share(x):
        return (frozen(x) * unembed).sum(-1) * factor

    scale = dla.logit.abs().max() + 1e-3
    with torch.no_grad():
        _close(dla.embedding, share(cache["layer_input"][0][:, -1]), scale)
        served = [(name, layer) for name in contributions for layer in cache.get(name, {})]
        shares = {"attention_output": dla.attention, "linear_attention_output": dla.linear_attention,
                  "mlp_output": dla.mlp}
        for name, layer in served:
            _close(shares[name][:, layer], share(cache[name][layer][:, -1]), scale)
        for name, table in shares.items():  # where a block has no such sublayer, its share is 0
            for layer in range(model.num_layers):
                if (name, layer) not in served:
                    assert not table[:, layer].any(), (name, layer)
        bias = (norm_bias * unembed).sum(-1) * factor
        if lm_bias is not None:
            bias = bias + lm_bias[TARGETS] * factor
        _close(dla.bias, bias, scale)
        # the frozen map is linear and exact at the full stream: the shares add up to the model's logit
        total = share(cache["layer_input"][0][:, -1])
        for name, layer in served:
            total = total + share(cache[name][layer][:, -1])
        _close(total + bias, dla.model_logit if model.family.name != "gemma2" else dla.logit, scale)


@pytest.mark.parametrize("kind", ["layernorm", "rmsnorm"])
def test_freeze_norm_reproduces_the_norm_at_its_point(kind):
    torch.manual_seed(0)
    hidden = 16
    if kind == "layernorm":
        norm = torch.nn.LayerNorm(hidden)
        torch.nn.init.normal_(norm.bias)
    else:
        norm = torch.nn.RMSNorm(hidden, eps=1e-6)
    torch.nn.init.normal_(norm.weight)
    point = torch.randn(3, hidden) * 4 + 1
    frozen = freeze_norm(norm, point)
    assert frozen.centers == (kind == "layernorm")
    with torch.no_grad():
        torch.testing.assert_close(frozen.linear(point) + frozen.bias, norm(point), rtol=1e-5, atol=1e-5)
        parts = torch.randn(4, 3, hidden)
        parts[-1] = point - parts[:-1].sum(0)  # four components that sum to the point
        summed = sum(frozen.linear(part) for part in parts)
        torch.testing.assert_close(summed + frozen.bias, norm(point), rtol=1e-4, atol=1e-4)


HYBRIDS = [name for name in ("falcon_h1", "jamba", "mamba") if name in {v.name for v in variants()}]


@pytest.mark.parametrize("name", HYBRIDS)
def test_hybrid_blocks_add_up_too(name):
    """Falcon-H1 runs a linear mixer beside attention, Jamba alternates them, Mamba has neither heads nor MLP."""
    model = build(name)
    dla = direct_logit_attribution(model, PROMPTS, TARGETS)
    scale = dla.logit.abs().max() + 1e-3
    _close(dla.total(), dla.logit, scale)
    _close(dla.logit, dla.model_logit, scale)
    report = model.support()
    linear = report.layers_with("linear_attention_output")
    assert linear and all(bool((dla.linear_attention[:, i] != 0).all()) for i in linear)
    assert dla.head_layers == report.layers_with("attention_head_outputs")
    if dla.heads is not None:
        _close(dla.heads.sum(-1) + dla.head_bias, dla.attention, scale)
    cache = cache_activations(model, PROMPTS[0])  # every value in the order the block produces it
    for layer in range(model.num_layers):
        parts = [cache.get(n, {}).get(layer) for n in ("attention_output", "linear_attention_output", "mlp_output")]
        total = cache["layer_input"][layer] + sum(part for part in parts if part is not None)
        torch.testing.assert_close(total, cache["layer_output"][layer], rtol=1e-5, atol=1e-5)


def test_heads_through_a_module_that_mixes_positions_are_refused():
    """Inkling's attention output passes through a short convolution over positions: a head's share of one
    position's logit is undefined, so heads=True is refused with what to do; the sublayer shares still add up."""
    model = build("inkling_text_swa_heads")
    with pytest.raises(ValueNotAvailable, match=r"InklingShortConvolution.*heads=False"):
        direct_logit_attribution(model, PROMPTS, TARGETS)
    dla = direct_logit_attribution(model, PROMPTS, TARGETS, heads=False)
    scale = dla.logit.abs().max() + dla.attention.abs().max() + 1e-3
    _close(dla.total(), dla.logit, scale)
