"""Steering adds exactly factor · vector where asked, and nowhere else."""

from __future__ import annotations

import pytest
import torch

from nncanon.errors import InvalidInput
from nncanon.testing import PROMPTS
from nncanon.tools import steer

from .conftest import build


def _vector(model, seed=1):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(model.hidden_size, generator=generator)


@pytest.mark.parametrize("positions", [None, -1, [0, 2], slice(1, 4)])
def test_steer_adds_exactly_the_delta(model, positions):
    layer, factor = 0, 2.5
    vector = _vector(model)
    with torch.no_grad(), model.trace(PROMPTS[0]):
        clean = model.layers[layer].layer_output.save()
    with torch.no_grad(), model.trace(PROMPTS[0]):
        steer(model, layer, vector, factor=factor, positions=positions)
        steered = model.layers[layer].layer_output.save()
        passed_on = model.layers[layer + 1].layer_input.save()
    expected = clean.clone()
    delta = factor * vector
    if positions is None:
        expected = clean + delta
    else:
        expected[:, positions] = clean[:, positions] + delta
    assert torch.equal(steered, expected)
    assert torch.equal(passed_on, expected)


def test_steer_is_exact_in_bf16():
    model = build("llama", dtype=torch.bfloat16)
    vector = _vector(model)
    with torch.no_grad(), model.trace(PROMPTS[0]):
        clean = model.layers[1].layer_output.save()
    with torch.no_grad(), model.trace(PROMPTS[0]):
        steer(model, 1, vector, factor=-3.0, positions=[1, 3])
        steered = model.layers[1].layer_output.save()
    expected = clean.clone()
    expected[:, [1, 3]] += (-3.0 * vector).to(torch.bfloat16)
    assert torch.equal(steered, expected)


def test_steer_at_the_last_layer_reaches_the_logits(model):
    last = model.num_layers - 1
    vector = _vector(model, seed=2)
    with torch.no_grad(), model.trace(PROMPTS[0]):
        clean = model.layers[last].layer_output.save()
    with torch.no_grad(), model.trace(PROMPTS[0]):
        steer(model, last, vector, factor=4.0, positions=-1)
        logits = model.logits.save()
    expected = clean.clone()
    expected[:, -1] += 4.0 * vector
    with torch.no_grad():
        lens = model.project_on_vocab(expected)
    torch.testing.assert_close(logits, lens, rtol=1e-6, atol=1e-6)


def test_several_layers_equal_manual_writes(model):
    vector = _vector(model, seed=3)
    with torch.no_grad(), model.trace(PROMPTS):
        steer(model, [1, 0], vector, factor=0.5, positions=-1)
        by_function = model.logits.save()
    with torch.no_grad(), model.trace(PROMPTS):
        for layer in (0, 1):
            model.layers[layer].layer_output[:, -1] += 0.5 * vector
        manual = model.logits.save()
    assert torch.equal(by_function, manual)


def test_steer_in_one_invoke_touches_its_rows_only(model):
    vector = _vector(model, seed=4)
    with torch.no_grad(), model.trace() as tracer:
        with tracer.invoke(PROMPTS[0]):
            clean = model.logits.save()
        with tracer.invoke(PROMPTS[0]):
            steer(model, 0, vector, factor=3.0)
            steered = model.logits.save()
        with tracer.invoke(PROMPTS[0]):
            again = model.logits.save()
    assert torch.equal(clean, again)
    assert not torch.equal(clean, steered)


def test_per_row_vectors(model):
    vectors = torch.stack([_vector(model, 5), _vector(model, 6)])  # [batch, hidden]
    with torch.no_grad(), model.trace(PROMPTS):
        clean = model.layers[0].layer_output.save()
    with torch.no_grad(), model.trace(PROMPTS):
        steer(model, 0, vectors, positions=-1)
        steered = model.layers[0].layer_output.save()
    assert torch.equal(steered[:, -1], clean[:, -1] + vectors)
    assert torch.equal(steered[:, :-1], clean[:, :-1])


@pytest.mark.parametrize("positions", [None, [0, -1], slice(1, None)])
def test_per_row_vectors_at_several_positions(model, positions):
    """A [batch, hidden] vector steers each prompt by its own vector at every position asked: it broadcast against
    [batch, seq, hidden] with its rows on the positions (torch's size error, or silently each position by another
    prompt's vector where batch == seq)."""
    vectors = torch.stack([_vector(model, 7), _vector(model, 8)])  # [batch, hidden]
    with torch.no_grad(), model.trace(PROMPTS[:2]):
        clean = model.layers[0].layer_output.clone().save()
        steer(model, 0, vectors, positions=positions)
        steered = model.layers[0].layer_output.save()
    where = slice(None) if positions is None else positions
    expected = clean.clone()
    for row in range(2):
        expected[row, where] += vectors[row]
    assert torch.equal(steered, expected)


def test_a_vector_that_does_not_fit_the_stream_is_named():
    model = build("llama")
    with pytest.raises(InvalidInput, match=rf"the steering vector is \({model.hidden_size + 1},\)"), \
            torch.no_grad(), model.trace(PROMPTS[:2]):
        steer(model, 0, torch.ones(model.hidden_size + 1))
    with pytest.raises(InvalidInput, match=rf"one per prompt, \[batch, hidden\] = \[2, {model.hidden_size}\]"), \
            torch.no_grad(), model.trace(PROMPTS[:2]):
        steer(model, 0, torch.ones(3, model.hidden_size))


def test_a_scalar_vector_still_adds_to_every_feature():
    model = build("llama")
    with torch.no_grad(), model.trace(PROMPTS[:2]):
        clean = model.layers[0].layer_output.clone().save()
        steer(model, 0, torch.tensor(0.5), factor=2.0)
        steered = model.layers[0].layer_output.save()
    assert torch.equal(steered, clean + 1.0)
