"""Neuron ablation and neuron-level direct logit attribution, against independent computations."""

from __future__ import annotations

import pytest
import torch

import nncanon
from nncanon.testing import PROMPTS, tiny_model
from nncanon.tools import direct_logit_attribution, mean_ablate, mean_values, zero_ablate_neurons


def _plain_logits_with_zeroed(model, layer: int, neurons: list[int]) -> torch.Tensor:
    """The logits with ``neurons`` zeroed at the last position by a plain pre-hook on the down projection."""
    down = model._module.get_submodule(model.family.layers)[layer].get_submodule(
        model.layers[layer].mlp._nncanon.anatomy.down)
    inputs = model.tokenizer(PROMPTS[0], return_tensors="pt")
    tokens = inputs["input_ids"].shape[-1]

    def zero(module, args):
        hidden = args[0].clone()
        hidden.view(-1, tokens, hidden.shape[-1])[:, -1, neurons] = 0
        return (hidden, *args[1:])

    handle = down.register_forward_pre_hook(zero)
    try:
        with torch.no_grad():
            return model._module(**inputs).logits
    finally:
        handle.remove()


@pytest.mark.parametrize("name", ["gpt2", "llama", "opt", "phi3", "gemma2", "falcon_7b_style"])
def test_zero_ablate_neurons_is_a_pre_hook_on_the_down_projection(name):
    model = tiny_model(name)
    layer, neurons = model.num_layers - 1, [0, 3, 5]
    with torch.no_grad(), model.trace(PROMPTS[0]):
        zero_ablate_neurons(model, layer, neurons, positions=-1)
        ours = model.logits.save()
    assert torch.equal(ours, _plain_logits_with_zeroed(model, layer, neurons))


def test_mean_ablated_neurons_take_their_means():
    model = nncanon.demo_model("llama")
    means = mean_values(model, PROMPTS, "neurons", layers=[1])
    with torch.no_grad(), model.trace(PROMPTS[0]):
        mean_ablate(model, 1, "neurons", means[1], neurons=[2, 7])
        neurons = model.layers[1].mlp.neurons.save()
    assert torch.equal(neurons[0, :, [2, 7]], means[1][[2, 7]].expand(neurons.shape[1], 2))


def test_neuron_arguments_are_checked():
    model = nncanon.demo_model("llama")
    width = model._module.model.layers[0].mlp.down_proj.in_features
    with pytest.raises(nncanon.InvalidInput, match=f"has {width} neurons"), model.trace(PROMPTS[0]):
        zero_ablate_neurons(model, 0, [width])
    with pytest.raises(ValueError, match="neurons= applies to the value 'neurons' only"), model.trace(PROMPTS[0]):
        nncanon.tools.zero_ablate(model, 0, "mlp_output", neurons=[1])
    with pytest.raises(nncanon.NotInTrace):
        zero_ablate_neurons(model, 0, [1])
    moe = tiny_model("qwen3_moe")
    with pytest.raises(nncanon.ValueNotAvailable, match="mixture of experts"), moe.trace(PROMPTS[0]):
        zero_ablate_neurons(moe, 0, [1])


@pytest.mark.parametrize("name", ["gpt2", "llama", "gemma2", "granite", "opt", "phi3", "olmo2"])
def test_neurons_add_up_to_their_mlp(name):
    """Every dense MLP's neurons plus its bias are its share of the logit (the tool checks it too, at 1e-3: here
    at 1e-5), on plain, post-norm (Gemma-2, OLMo-2), scaled (Granite), inline (OPT) and fused (Phi-3) MLPs."""
    model = tiny_model(name)
    dla = direct_logit_attribution(model, PROMPTS[:2], targets=[5, 9], neurons=True)
    assert sorted(dla.neurons) == list(range(model.num_layers))
    for layer, shares in dla.neurons.items():
        assert torch.allclose(shares.sum(-1) + dla.neuron_bias[layer], dla.mlp[:, layer], rtol=1e-5, atol=1e-5)
    assert torch.allclose(dla.total(), dla.logit, rtol=1e-5, atol=1e-5)


def test_a_neurons_share_is_its_activation_times_its_column_through_the_frozen_final_norm():
    """On GPT-2, neuron ``n``'s share computed by hand: ``a_n · W_out[:, n] · C(g / σ ⊙ u_t)``, σ the final
    LayerNorm's ``sqrt(var + eps)`` of the last stream, ``u_t`` the unembedding row."""
    model = nncanon.demo_model("gpt2")
    target, layer = 11, 1
    dla = direct_logit_attribution(model, PROMPTS[0], targets=target, neurons=True)
    with torch.no_grad(), model.trace(PROMPTS[0]):
        neurons = model.layers[layer].mlp.neurons[:, -1].save()
        final = model.layers[-1].layer_output[:, -1].save()
    hf = model._module.transformer
    norm = hf.ln_f
    sigma = (final.var(-1, unbiased=False, keepdim=True) + norm.eps).sqrt()
    direction = norm.weight / sigma * model._module.lm_head.weight[target]
    direction = direction - direction.mean(-1, keepdim=True)
    column = hf.h[layer].mlp.c_proj.weight  # Conv1D: [d_mlp, d]
    expected = neurons * (column @ direction[0])
    assert torch.allclose(dla.neurons[layer], expected, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("name", ["blocks.1.mlp.hook_post", "blocks.1.ln1.hook_normalized"])
def test_a_dictionary_reads_the_neurons_and_attention_input(name):
    """A dictionary attached at the neurons (``mlp.hook_post``) or at attention's normalised input before the norm's
    weight (``ln1.hook_normalized``: ``attention_normalized``)
    encodes the served value (against the dictionary's own encode of a plain read)."""
    from nncanon.sae import Dictionary, attach, resolve

    model = nncanon.demo_model("llama")
    point = resolve(model, name)
    with torch.no_grad(), model.trace(PROMPTS[0]):
        value = getattr(model.layers[1].mlp if point.value == "neurons" else model.layers[1].self_attn,
                        point.value).clone().save()
    width, features = value.shape[-1], 16
    generator = torch.Generator().manual_seed(0)
    sae = Dictionary.from_tensors(torch.randn(width, features, generator=generator), torch.zeros(features),
                                  torch.randn(features, width, generator=generator), torch.zeros(width),
                                  hook_name=name)
    with attach(model, sae) as attached, torch.no_grad(), model.trace(PROMPTS[0]):
        read = attached.features.save()
    assert torch.allclose(read, sae.encode(value), rtol=1e-5, atol=1e-6)
