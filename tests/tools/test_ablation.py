"""The ablation helpers against the ablation page's recipes written with the plain surface."""

from __future__ import annotations

import pytest
import torch

from nncanon.errors import InvalidInput, ValueNotAvailable
from nncanon.reading import head_count
from nncanon.testing import PROMPTS
from nncanon.tools import (
    head_ablation_sweep,
    mean_ablate,
    mean_values,
    skip_blocks,
    zero_ablate,
    zero_ablate_attention,
    zero_ablate_block,
    zero_ablate_heads,
    zero_ablate_mlp,
)

from .conftest import attention_layers, build

PROMPT = PROMPTS[0]
REFERENCE = ["The capital of France is", "Berlin lies in", "London is the capital of", "Tokyo is in"]


def test_zero_ablations_equal_the_recipe(model):
    layer, head = attention_layers(model)[-1], 2
    runs, recipe = {}, {}
    with torch.no_grad(), model.trace() as tracer:
        with tracer.invoke(PROMPT):
            zero_ablate_attention(model, layer)
            runs["attention"] = model.logits.save()
        with tracer.invoke(PROMPT):
            zero_ablate_mlp(model, layer)
            runs["mlp"] = model.logits.save()
        with tracer.invoke(PROMPT):
            zero_ablate_heads(model, layer, head)
            runs["head"] = model.logits.save()
        with tracer.invoke(PROMPT):
            zero_ablate_heads(model, layer, [0, head], positions=[-1])
            runs["heads at -1"] = model.logits.save()
    block = model.layers[layer]
    with torch.no_grad(), model.trace() as tracer:
        with tracer.invoke(PROMPT):
            block.self_attn.attention_output[:] = 0
            recipe["attention"] = model.logits.save()
        with tracer.invoke(PROMPT):
            block.mlp.mlp_output[:] = 0
            recipe["mlp"] = model.logits.save()
        with tracer.invoke(PROMPT):
            block.self_attn.attention_head_outputs[..., head, :] = 0
            recipe["head"] = model.logits.save()
        with tracer.invoke(PROMPT):
            block.self_attn.attention_head_outputs[:, -1, [0, head], :] = 0
            recipe["heads at -1"] = model.logits.save()
    for name, logits in runs.items():
        assert torch.equal(logits, recipe[name]), name


def test_zero_ablated_block_equals_skipping_it(model):
    for layer in range(model.num_layers):
        with torch.no_grad(), model.trace() as tracer:
            with tracer.invoke(PROMPT):
                zero_ablate_block(model, layer)
                ablated = model.logits.save()
        with torch.no_grad(), model.trace(PROMPT):
            skip_blocks(model, layer)
            skipped = model.logits.save()
        torch.testing.assert_close(ablated, skipped, rtol=0, atol=0)


def test_mean_ablation_equals_the_recipe(model):
    layer = 1
    means = mean_values(model, REFERENCE, "mlp_output", layers=[layer])
    with torch.no_grad(), model.trace(REFERENCE):
        recipe_mean = model.layers[layer].mlp.mlp_output[:, -1].mean(0).save()
    assert torch.equal(means[layer], recipe_mean)
    with torch.no_grad(), model.trace(PROMPT):
        mean_ablate(model, layer, "mlp_output", means[layer], positions=-1)
        ours = model.next_token_probs.save()
    with torch.no_grad(), model.trace(PROMPT):
        model.layers[layer].mlp.mlp_output[:, -1] = recipe_mean
        recipe = model.next_token_probs.save()
    assert torch.equal(ours, recipe)


def test_mean_over_every_token_ignores_padding(model):
    layer = attention_layers(model)[0]
    means = mean_values(model, REFERENCE, "attention_output", layers=[layer], positions=None)
    rows = []
    for prompt in REFERENCE:  # one at a time: no padding
        with torch.no_grad(), model.trace(prompt):
            rows.append(model.layers[layer].self_attn.attention_output[0].save())
    expected = torch.cat(rows).mean(0)
    torch.testing.assert_close(means[layer], expected, rtol=1e-5, atol=1e-6)


def test_mean_ablation_of_heads_and_blocks(model):
    layer, heads, last = attention_layers(model)[0], [1, 3], model.num_layers - 1
    head_means = mean_values(model, REFERENCE, "attention_head_outputs", layers=layer)[layer]
    block_means = mean_values(model, REFERENCE, "block", layers=last)[last]
    assert head_means.shape == (head_count(model, layer), model.head_dim)
    with torch.no_grad(), model.trace(REFERENCE):
        x = model.layers[last].layer_input[:, -1].save()
        y = model.layers[last].layer_output[:, -1].save()
    torch.testing.assert_close(block_means, (y - x).mean(0), rtol=1e-5, atol=1e-6)
    with torch.no_grad(), model.trace(PROMPT):
        mean_ablate(model, layer, "attention_head_outputs", head_means, heads=heads, positions=-1)
        written = model.layers[layer].self_attn.attention_head_outputs[:, -1].save()
    with torch.no_grad(), model.trace(PROMPT):
        entering = model.layers[last].layer_input[:, -1].save()
        mean_ablate(model, last, "block", block_means, positions=-1)
        leaving = model.layers[last].layer_output[:, -1].save()
    assert torch.equal(written[:, heads], head_means[heads].expand_as(written[:, heads]))
    assert torch.equal(leaving, entering + block_means)


def test_generic_zero_ablate_touches_only_the_positions(model):
    layer = attention_layers(model)[0]
    with torch.no_grad(), model.trace(PROMPT):
        clean = model.layers[layer].self_attn.attention_output.save()
    with torch.no_grad(), model.trace(PROMPT):
        zero_ablate(model, layer, "attention_output", positions=[0, 3])
        written = model.layers[layer].self_attn.attention_output.save()
    assert torch.equal(written[:, [0, 3]], torch.zeros_like(written[:, [0, 3]]))
    keep = [p for p in range(clean.shape[1]) if p not in (0, 3)]
    assert torch.equal(written[:, keep], clean[:, keep])


def _one_trace_per_head(model, prompts, layer: int, value: str, heads: int, mean=None) -> torch.Tensor:
    rows = []
    for head in range(heads):
        with torch.no_grad(), model.trace(prompts):
            if mean is None:
                zero_ablate(model, layer, value, heads=head)
            else:
                mean_ablate(model, layer, value, mean[layer], heads=head)
            rows.append(model.next_token_probs.save())
    return torch.stack(rows)


# A sweep item runs in a batch of `batch_size` invokes and computes the last position's logits only:
# its matmuls have other shapes than a trace of its own, which moves probabilities at the last bit
# (5e-7 measured on the demo models). A wrong head or a leaked ablation moves them by far more.
SWEEP_TOLERANCE = dict(rtol=1e-4, atol=2e-6)


def test_head_ablation_sweep_equals_one_trace_per_head(model):
    layers = model.support().layers_with("attention_head_outputs")
    heads = head_count(model, layers[0])
    swept = head_ablation_sweep(model, PROMPT, batch_size=3)
    assert swept.shape == (len(layers), heads, model.vocab_size)
    for row, layer in zip(swept, layers, strict=True):
        reference = _one_trace_per_head(model, PROMPT, layer, "attention_head_outputs", heads)
        torch.testing.assert_close(row, reference[:, 0], **SWEEP_TOLERANCE)


def test_head_ablation_sweep_with_means_and_a_batch_of_prompts(model):
    layer = model.support().layers_with("attention_head_outputs")[-1]
    heads = head_count(model, layer)
    means = mean_values(model, REFERENCE, "attention_head_outputs", layers=[layer])
    prompts = REFERENCE[:2]
    swept = head_ablation_sweep(model, prompts, layers=[layer], mean=means,
                                metric=lambda logits: torch.softmax(logits, -1))
    assert swept.shape == (1, heads, 2, model.vocab_size)
    reference = _one_trace_per_head(model, prompts, layer, "attention_head_outputs", heads, mean=means)
    torch.testing.assert_close(swept[0], reference, **SWEEP_TOLERANCE)


@pytest.mark.parametrize("name", ["qwen3_next", "falcon_h1", "laguna_uneven_heads", "inkling_text_swa_heads"])
def test_head_ablation_sweep_on_hybrids_and_uneven_heads(name):
    """Linear-mixer heads (Qwen3-Next, Falcon-H1) and blocks with other head counts (Laguna, Inkling's sliding
    layers: NaN past a block's count)."""
    model = build(name)
    report = model.support()
    for value in ("attention_head_outputs", "linear_attention_head_outputs"):
        layers = report.layers_with(value)
        if not layers:
            continue
        swept = head_ablation_sweep(model, PROMPT, value=value)
        for row, layer in zip(swept, layers, strict=True):
            heads = head_count(model, layer, value)
            assert torch.isnan(row[heads:]).all()
            torch.testing.assert_close(row[:heads], _one_trace_per_head(model, PROMPT, layer, value, heads)[:, 0],
                                       **SWEEP_TOLERANCE)


def test_head_ablation_sweep_refuses_what_a_layer_does_not_serve():
    model = build("qwen3_next")
    linear = model.support().layers_with("linear_attention_head_outputs")[0]
    with pytest.raises(ValueNotAvailable, match=rf"layers\[{linear}\] does not serve attention_head_outputs"):
        head_ablation_sweep(model, PROMPT, layers=[linear])
    with pytest.raises(KeyError, match="mlp_output"):
        head_ablation_sweep(model, PROMPT, value="mlp_output")


def test_head_ablation_sweep_refuses_means_that_do_not_fit():
    """A mean for another layer was KeyError 0; the mean of attention_output ([hidden]) was torch's "expanded size"
    error inside the trace. Both are named before the sweep runs."""
    model = build("llama")
    heads = head_count(model, 0)
    with pytest.raises(InvalidInput, match=r"mean= has no entry for layers\[0\] \(it has \[1\]\)"):
        head_ablation_sweep(model, PROMPT, layers=[0], mean=mean_values(model, REFERENCE, "attention_head_outputs",
                                                                        layers=[1]))
    with pytest.raises(InvalidInput, match=rf"mean\[0\] is \({model.hidden_size},\).*\[{heads}, \.\.\.\]"):
        head_ablation_sweep(model, PROMPT, layers=[0], mean=mean_values(model, REFERENCE, "attention_output",
                                                                        layers=[0]))


def test_mean_ablate_refuses_a_mean_of_another_shape():
    """A mean of another value ([hidden] for the heads', or of another width) was torch's shape error inside the
    trace."""
    model = build("llama")
    means = mean_values(model, REFERENCE, "attention_output", layers=[0])
    with pytest.raises(InvalidInput, match=r"the mean is \(\d+,\); layers\[0\] attention_head_outputs is \(4, \d+\)"), \
            torch.no_grad(), model.trace(PROMPT):
        mean_ablate(model, 0, "attention_head_outputs", means[0], heads=[1])
    with pytest.raises(InvalidInput, match=r"the mean is \(5,\); layers\[0\] block is"), \
            torch.no_grad(), model.trace(PROMPT):
        mean_ablate(model, 0, "block", torch.zeros(5))


def test_mean_ablate_with_a_0d_tensor_writes_that_number():
    model = build("llama")
    with torch.no_grad(), model.trace(PROMPT):
        mean_ablate(model, 0, "mlp_output", torch.tensor(0.25))
        written = model.layers[0].mlp.mlp_output.save()
    assert torch.equal(written, torch.full_like(written, 0.25))
