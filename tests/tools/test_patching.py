"""Activation patching: the batched, chunked sweep against a per-item loop of single traces."""

from __future__ import annotations

import pytest
import torch

from nncanon.errors import InvalidInput
from nncanon.testing import PROMPTS
from nncanon.tools import activation_patching, attribution_patching, head_count, logit_difference, patch, run_metric
from nncanon.tools._common import token_count

from .conftest import attention_layers, build

CLEAN = "Paris lies in"
CORRUPTED = "Rome lies in"  # the same number of tokens
TOL = dict(rtol=1e-5, atol=1e-5)


def _host(model, layer, value):
    block = model.layers[layer]
    if value.startswith("attention"):
        return block.self_attn
    if value.startswith("linear_attention"):
        return block.linear_attn
    if value == "mlp_output":
        return block.mlp
    return block


def _single(model, value, layer, position=None, head=None):
    """One patch written with the plain surface, in two traces of one prompt each."""
    with torch.no_grad(), model.trace(CLEAN):
        source = getattr(_host(model, layer, value), value).save()
    with torch.no_grad(), model.trace(CORRUPTED):
        target = getattr(_host(model, layer, value), value)
        if head is None:
            target[:, position] = source[:, position]
        elif position is None:
            target[:, :, head] = source[:, :, head]
        else:
            target[:, position, head] = source[:, position, head]
        logits = model.logits[0, -1].save()
    return logits


def _same_length(model):
    a = model.tokenizer(CLEAN).input_ids
    b = model.tokenizer(CORRUPTED).input_ids
    assert len(a) == len(b) and a != b
    return len(a)


@pytest.mark.parametrize("value", ["layer_output", "attention_output", "mlp_output", "layer_input"])
def test_position_sweep_equals_a_loop_of_single_traces(model, value):
    length = _same_length(model)
    layers = model.support().layers_with(value)
    sweep = activation_patching(model, CLEAN, CORRUPTED, value=value, batch_size=7)
    assert sweep.shape == (len(layers), length, model.vocab_size)
    last = len(layers) - 1
    for row, position in [(0, 0), (last, length - 1), (min(1, last), 2), (0, length - 1)]:  # each is two traces
        torch.testing.assert_close(sweep[row, position], _single(model, value, layers[row], position), **TOL)


def test_head_sweeps_equal_a_loop_of_single_traces(model):
    _same_length(model)
    layers = attention_layers(model)
    every_head = activation_patching(
        model, CLEAN, CORRUPTED, value="attention_head_outputs", positions=None, heads="each", batch_size=3
    )
    heads = head_count(model, layers[0])
    assert every_head.shape == (len(layers), heads, model.vocab_size)
    picked = activation_patching(
        model, CLEAN, CORRUPTED, value="attention_head_outputs", layers=[layers[-1]], positions=[-1, 2], heads=[0, 3]
    )
    assert picked.shape == (1, 2, 2, model.vocab_size)
    for row, head in [(0, 0), (len(layers) - 1, heads - 1), (min(1, len(layers) - 1), 2)]:
        expected = _single(model, "attention_head_outputs", layers[row], None, head)
        torch.testing.assert_close(every_head[row, head], expected, **TOL)
    for i, j in [(0, 0), (1, 1), (0, 1)]:
        expected = _single(model, "attention_head_outputs", layers[-1], [-1, 2][i], [0, 3][j])
        torch.testing.assert_close(picked[0, i, j], expected, **TOL)


def test_chunking_and_metric(model):
    _same_length(model)
    metric = logit_difference(5, 7)
    one_chunk = activation_patching(model, CLEAN, CORRUPTED, value="mlp_output", metric=metric, batch_size=1000)
    small_chunks = activation_patching(model, CLEAN, CORRUPTED, value="mlp_output", metric=metric, batch_size=2)
    full = activation_patching(model, CLEAN, CORRUPTED, value="mlp_output")
    torch.testing.assert_close(one_chunk, small_chunks, **TOL)
    torch.testing.assert_close(one_chunk, full[..., 5] - full[..., 7], **TOL)


def test_patching_everything_at_the_last_layer_restores_the_clean_run(model):
    _same_length(model)
    restored = activation_patching(model, CLEAN, CORRUPTED, layers=-1, positions=None)
    clean = run_metric(model, CLEAN)
    corrupted = run_metric(model, CORRUPTED)
    torch.testing.assert_close(restored[0], clean, **TOL)
    assert not torch.allclose(clean, corrupted)
    one = patch(model, CLEAN, CORRUPTED, "layer_output", -1)
    torch.testing.assert_close(one, clean, **TOL)


def test_batched_prompt_pairs(model):
    pairs = [CLEAN, CLEAN], [CORRUPTED, CLEAN]
    _same_length(model)
    sweep = activation_patching(model, *pairs, value="attention_output", positions=[-1], metric=logit_difference(5, 7))
    count = len(attention_layers(model))
    assert sweep.shape == (count, 1, 2)
    clean = run_metric(model, CLEAN, logit_difference(5, 7))
    torch.testing.assert_close(sweep[:, 0, 1], clean.expand(count), **TOL)  # clean into clean


def test_bad_arguments(model):
    with pytest.raises(ValueError, match="same length"):
        activation_patching(model, PROMPTS[0], PROMPTS[1])
    with pytest.raises(KeyError, match="not one of"):
        activation_patching(model, CLEAN, CLEAN, value="logits")
    with pytest.raises(ValueError, match="heads="):
        activation_patching(model, CLEAN, CLEAN, value="mlp_output", heads="each")


def test_pairs_of_different_lengths_are_refused_even_when_the_batches_pad_to_one_length():
    """["e f", "d"] and ["d", "e f"] pad to the same length, but each pair's prompts differ: a patch would move
    a real token's value into padding. Both patching tools refuse them, naming the pair."""
    model = build("llama")
    clean, corrupted = ["e f", "d"], ["d", "e f"]
    assert token_count(model, clean) == token_count(model, corrupted)
    with pytest.raises(InvalidInput, match=r"\(pair 0\) tokenize to 3 and 1 tokens"):
        activation_patching(model, clean, corrupted)
    with pytest.raises(InvalidInput, match=r"\(pair 0\) tokenize to 3 and 1 tokens"):
        patch(model, clean, corrupted, "layer_output", 0)
    with pytest.raises(InvalidInput, match=r"\(pair 0\) tokenize to 3 and 1 tokens"):
        attribution_patching(model, clean, corrupted, logit_difference(5, 7))


@pytest.mark.parametrize("name", ["laguna_uneven_heads", "inkling_text_swa_heads"])
def test_a_head_sweep_over_blocks_of_different_head_counts(name):
    """heads="each" sweeps the widest block's heads: each item equals a patch written with the plain surface, NaN
    past a block's count (the first block's count was taken for all: an IndexError, or heads left out)."""
    model = build(name)
    layers = model.support().layers_with("attention_head_outputs")
    counts = [head_count(model, layer) for layer in layers]
    assert len(set(counts)) > 1
    sweep = activation_patching(model, CLEAN, CORRUPTED, value="attention_head_outputs", heads="each", positions=None)
    assert sweep.shape == (len(layers), max(counts), model.vocab_size)
    for row, layer, count in zip(sweep, layers, counts, strict=True):
        assert torch.isnan(row[count:]).all()
        for head in range(count):
            torch.testing.assert_close(row[head], _single(model, "attention_head_outputs", layer, head=head), **TOL)


def test_out_of_range_positions_and_heads_are_named_before_the_run(model):
    length = _same_length(model)
    layer = attention_layers(model)[0]
    count = head_count(model, layer)
    with pytest.raises(InvalidInput, match=rf"positions=\[{length}\] is out of range.*0\.\.{length - 1}"):
        activation_patching(model, CLEAN, CORRUPTED, positions=[length])
    with pytest.raises(InvalidInput, match=rf"positions=\[{-length - 1}\] is out of range"):
        patch(model, CLEAN, CORRUPTED, "layer_output", layer, positions=-length - 1)
    with pytest.raises(InvalidInput, match=rf"heads=\[{count}\] is out of range"):
        activation_patching(model, CLEAN, CORRUPTED, value="attention_head_outputs", layers=[layer], heads=[count])
    with pytest.raises(InvalidInput, match=rf"heads=\[{count}\] is out of range: layers\[{layer}\] has {count} heads"):
        patch(model, CLEAN, CORRUPTED, "attention_head_outputs", layer, heads=count)
    with pytest.raises(InvalidInput, match="positions='all'"):
        activation_patching(model, CLEAN, CORRUPTED, positions="all")
    with pytest.raises(ValueError, match="heads= patches attention_head_outputs"):
        patch(model, CLEAN, CORRUPTED, "mlp_output", layer, heads=0)


def test_layers_in_any_order_are_the_sweep_of_each(model):
    """layers=[last, first] in one trace resumed every invoke at the last layer, past the first one's write
    (OutOfOrderRead); each row equals the sweep of its layer alone."""
    first, last = 0, model.num_layers - 1
    both = activation_patching(model, CLEAN, CORRUPTED, layers=[last, first], positions=None)
    for row, layer in zip(both, (last, first), strict=True):
        torch.testing.assert_close(row, activation_patching(model, CLEAN, CORRUPTED, layers=[layer], positions=None)[0],
                                   **TOL)


def test_an_int_where_a_sweep_takes_a_list_and_empty_prompts_are_named(model):
    """positions=1 was "'int' object is not iterable"; two empty lists were an IndexError."""
    with pytest.raises(InvalidInput, match=r"positions=1: give \"each\", a list of indices \(\[1\] sweeps that one\)"):
        activation_patching(model, CLEAN, CORRUPTED, positions=1)
    with pytest.raises(InvalidInput, match=r"heads=0: give \"each\", a list of indices \(\[0\] sweeps that one\)"):
        activation_patching(model, CLEAN, CORRUPTED, value="attention_head_outputs", heads=0)
    with pytest.raises(InvalidInput, match="empty lists"):
        activation_patching(model, [], [])


def test_token_ids_patch_as_their_prompts_do(model):
    """Token ids (a [batch, seq] tensor) were handed to the tokenizer to count them: its "text input must be of
    type str" error. They patch as the prompts they encode."""
    ids = [model.tokenizer([prompt], return_tensors="pt")["input_ids"] for prompt in (CLEAN, CORRUPTED)]
    by_ids = activation_patching(model, *ids, value="layer_output", positions=[-1])
    by_text = activation_patching(model, [CLEAN], [CORRUPTED], value="layer_output", positions=[-1])
    torch.testing.assert_close(by_ids, by_text, rtol=0, atol=0)
    estimate = attribution_patching(model, *ids, logit_difference(5, 7))
    torch.testing.assert_close(estimate.heads, attribution_patching(model, [CLEAN], [CORRUPTED],
                                                                    logit_difference(5, 7)).heads, rtol=0, atol=0)
