"""Patchscopes against the plain surface: self-patching is the clean run, the last layer is the source's head."""

from __future__ import annotations

import torch

from nncanon.testing import PROMPTS
from nncanon.tools import patchscope, patchscope_generate

TOL = dict(rtol=1e-5, atol=1e-6)
SOURCE, TARGET = PROMPTS


def _probs(model, prompt):
    with torch.no_grad(), model.trace(prompt):
        probs = model.next_token_probs.save()
    return probs


def test_patching_a_prompt_into_itself_is_the_clean_run(model):
    probs = patchscope(model, TARGET, TARGET, layers=[0, 1], source_position=-2, target_position=-2)
    assert probs.shape == (1, 2, model.vocab_size)
    clean = _probs(model, TARGET)
    for layer in range(2):
        torch.testing.assert_close(probs[:, layer], clean, **TOL)


def test_at_the_last_layer_the_target_says_what_the_source_says(model):
    last = model.num_layers - 1
    probs = patchscope(model, SOURCE, TARGET, layers=last)
    torch.testing.assert_close(probs, _probs(model, SOURCE), **TOL)


def test_patchscope_equals_two_plain_traces(model):
    layer, target_layer = 0, 1
    with torch.no_grad(), model.trace(SOURCE):
        hidden = model.layers[layer].layer_output[:, -3].save()
    with torch.no_grad(), model.trace(TARGET):
        model.layers[target_layer].layer_output[:, -1] = hidden
        expected = model.next_token_probs.save()
    probs = patchscope(model, SOURCE, TARGET, layers=layer, source_position=-3, target_layer=target_layer)
    torch.testing.assert_close(probs, expected, **TOL)
    batch = patchscope(model, [SOURCE, TARGET], TARGET, layers=[layer], source_position=-3, target_layer=target_layer)
    torch.testing.assert_close(batch[0, 0], expected[0], **TOL)


def test_generation_from_the_patched_state(model):
    last = model.num_layers - 1
    ids = patchscope_generate(model, SOURCE, TARGET, last, max_new_tokens=3)
    prompt_length = len(model.tokenizer(TARGET).input_ids)
    assert ids.shape == (1, prompt_length + 3)
    assert int(ids[0, prompt_length]) == int(_probs(model, SOURCE).argmax())
    same = patchscope_generate(model, TARGET, TARGET, 0, max_new_tokens=3)
    with torch.no_grad(), model.generate(TARGET, max_new_tokens=3) as tracer:
        plain = tracer.result.save()
    assert torch.equal(same, plain)
