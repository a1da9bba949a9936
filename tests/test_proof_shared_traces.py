"""The checks that share one trace among many values still decline exactly a wrong one.

``read`` reads every block's values in one trace, ``invokes`` writes every value in an invoke of its own of one
trace, ``locality`` and ``probabilities`` write every block's values likewise, ``gradients`` takes the operation
sites' references in one plain run and measures each value's gradient against its largest, ``gradient_writes``
zeroes every value's gradient in a row of its own of one backward, and ``scores``, ``kernel`` and ``recomputed``
read every block in one trace: a value broken on purpose is declined, alone, with the check's numbers; the others
still hold. (``ablation``: `tests/test_proof.py`, a broken site and a missing scale.)
"""

from __future__ import annotations

import pytest
import torch

from nncanon import gradients as gradient_module
from nncanon import served as served_module
from nncanon.components.anatomy import NEURON_VALUES
from nncanon.components.attention import AttentionEnvoy
from nncanon.proof.checks import gradients as gradient_checks
from nncanon.proof.checks.base import HEAD_VALUES, INPUT_VALUES, KERNEL_INPUTS
from nncanon.proof.checks.gradients import check_gradient_writes, check_gradients
from nncanon.proof.checks.heads import check_probabilities
from nncanon.proof.checks.inside import check_scores
from nncanon.proof.checks.kernel import check_kernel, check_recomputed
from nncanon.proof.checks.references import served, shared_copies
from nncanon.proof.checks.stream import check_read
from nncanon.proof.checks.writes import check_invokes, check_locality
from nncanon.reading import CONTRIBUTIONS, host
from nncanon.served import Binding
from nncanon.support import NORM_VALUES
from nncanon.testing import tiny_model

#: The values `check_invokes` writes on a block.
WRITABLE = NORM_VALUES + INPUT_VALUES + KERNEL_INPUTS + HEAD_VALUES + NEURON_VALUES + CONTRIBUTIONS


def _failed(results: list) -> set[tuple[int | None, str]]:
    return {(result.layer, value) for result in results if not result.passed for value in result.values}


def _held(results: list) -> set[tuple[int | None, str]]:
    return {(result.layer, value) for result in results if result.passed for value in result.values}


def test_a_read_wrong_by_one_part_in_a_thousand_is_declined_on_every_block_alone(monkeypatch):
    model = tiny_model("llama")
    original = Binding.read

    def scaled(self, raw, mediator):
        tensor = original(self, raw, mediator)
        return tensor * 1.001 if self.name == "value_states" else tensor

    monkeypatch.setattr(Binding, "read", scaled)
    with shared_copies():
        results = check_read(model)
    assert _failed(results) == {(index, "value_states") for index in range(model.num_layers)}
    assert {(index, "query_states") for index in range(model.num_layers)} <= _held(results)
    assert all("> 0e+00" in result.describe() for result in results if not result.passed)


@pytest.mark.parametrize(("name", "check", "implementation"), [
    ("attention_scores", check_scores, "eager"), ("query_states", check_kernel, "eager"),
    ("attention_probabilities", check_recomputed, "sdpa")])
def test_a_read_wrong_on_one_block_fails_there_alone_where_every_block_shares_a_trace(monkeypatch, name, check,
                                                                                       implementation):
    """``scores``, ``kernel`` and ``recomputed`` read every block in one trace: block 0's scores (its queries, its
    probabilities recomputed under sdpa) 10 % off fail there alone, with the check's numbers; block 1's hold."""
    model = tiny_model("llama", attn_implementation=implementation)
    original = AttentionEnvoy.__dict__[name]

    def scaled(self):
        tensor = original.__get__(self, type(self))
        return tensor * 1.1 if self._nncanon.where.startswith("layers[0]") else tensor

    monkeypatch.setattr(AttentionEnvoy, name, property(scaled))
    results = check(model)
    assert {result.layer for result in results if not result.passed} == {0}
    assert [result for result in results if result.layer == 1] and all(
        result.passed for result in results if result.layer == 1)
    assert any(result.error is not None and result.error > result.tolerance for result in results if not result.passed)


def test_a_write_that_leaks_into_the_next_invoke_is_declined_alone():
    """OPT's MLP output is read on the batch's flattened tokens: this invoke's rows shifted by one invoke make its
    write land in the next invoke (an unwritten one in the batched trace): exactly the flattened values (the MLP's
    output, its neurons and pre-activations) fail."""
    model = tiny_model("opt")
    flat = {(index, name) for index in range(model.num_layers) for name in served(model, index, WRITABLE)
            if name in host(model, index, name)._nncanon.bindings
            and host(model, index, name)._nncanon.bindings[name].site.flat}
    assert (0, "mlp_output") in flat
    rows = served_module._rows

    def shifted(mediator):
        total, found = rows(mediator)
        return total, None if found is None else ((found[0] + found[1]) % total, found[1])

    served_module._rows = shifted
    try:
        results = check_invokes(model)
    finally:
        served_module._rows = rows
    assert _failed(results) == flat
    assert (0, "attention_output") in _held(results)


def test_a_write_that_moves_other_positions_is_declined_alone(monkeypatch):
    """Granite's mlp_output (scaled by its residual multiplier: a copy, written back) with a write-back moving every
    later position: its locality fails on every block; the attention output, written in the same trace, holds."""
    model = tiny_model("granite")
    original = Binding.write_back

    def spreading(self, view, raw, mediator=None, graph=False):
        if self.name == "mlp_output":
            view = view.clone()
            view[:, 3:] = view[:, 3:] + 0.25
        return original(self, view, raw, mediator, graph)

    monkeypatch.setattr(Binding, "write_back", spreading)
    results = check_locality(model)
    assert {(layer, name) for layer, name in _failed(results)} == {
        (index, "mlp_output") for index in range(model.num_layers)}
    assert {(index, "attention_output") for index in range(model.num_layers)} <= _held(results)


def test_a_gradient_off_by_one_part_in_ten_thousand_is_declined(monkeypatch):
    """The bar of the gradients is relative to a value's largest gradient: a gradient 1e-4 off on one block still
    fails, alone; so does an operation site's whose reference shares one plain run with the others."""
    model = tiny_model("llama")
    original = gradient_checks.served_gradients

    def off(model, names):
        grads = original(model, names)
        return {key: grad * wrong[key] if key in wrong else grad for key, grad in grads.items()}

    # (the queries' gradients are small: 1% off, beyond the checks' absolute floor of 1e-6; their reference is taken
    # in one plain run with every block's scores' and kernel inputs')
    wrong = {(0, "mlp_output"): 1 + 1e-4, (1, "query_states"): 1 + 1e-2}
    monkeypatch.setattr(gradient_checks, "served_gradients", off)
    with shared_copies():
        results = check_gradients(model)
    assert _failed(results) == set(wrong)
    assert {(1, "mlp_output"), (0, "query_states"), (0, "attention_scores")} <= _held(results)
    with torch.no_grad():
        assert all(result.error is not None for result in results if not result.passed)


def test_probabilities_whose_write_does_not_reach_the_model_are_declined_alone(monkeypatch):
    """Block 0's probabilities served as a copy (a write to them reaches nothing): the probabilities check, whose
    layers share one trace, fails on block 0 alone."""
    model = tiny_model("llama")
    original = AttentionEnvoy.attention_probabilities

    def copied(self):
        value = original.fget(self)
        return value.clone() if self._nncanon.where.startswith("layers[0]") else value

    monkeypatch.setattr(AttentionEnvoy, "attention_probabilities", property(copied, original.fset))
    results = check_probabilities(model)
    assert {result.layer for result in results if not result.passed} == {0}
    assert all(result.passed for result in results if result.layer != 0)


def test_values_that_hold_are_proved_in_one_shared_trace():
    """Nothing broken: every write of the invokes, every block write of the locality check and every gradient write
    held in one trace (the notes say so), with the same values covered as one trace per write covers."""
    model = tiny_model("llama")
    invokes, locality = check_invokes(model), check_locality(model)
    assert invokes and all(r.passed and "in its own invoke of" in r.note for r in invokes)
    writes = check_gradient_writes(model)
    assert len(writes) >= 8 and all(r.passed and "in a row of its own of one batch of" in r.note for r in writes)
    blocks = [r for r in locality if r.layer is not None]
    assert blocks and all(r.passed and "in its own invoke of" in r.note for r in blocks)
    assert {(r.layer, r.values) for r in invokes} == {
        (index, (name,)) for index in range(model.num_layers) for name in served(model, index, WRITABLE)} | {
        (None, (name,)) for name in ("token_embeddings", "final_norm_output")}



def test_a_gradient_write_that_does_not_land_is_declined_alone(monkeypatch):
    """``mlp_output.grad = 0`` on the last block broken (its zeros land as 1e-3): in the shared backward every row whose
    path to the logit runs through the MLP's output moves (the gradient written there is zero at every position but
    the last), so those values are checked alone; exactly the broken one fails, with its numbers. The block's input
    and the neurons, whose rows cut every path back from it, hold in the shared backward."""
    model = tiny_model("llama")
    last = model.num_layers - 1
    original = gradient_module.check_gradient_write

    def broken(value, tensor, name):
        written = original(value, tensor, name)
        return torch.where(written == 0, 1e-3, written) if name == f"layers[{last}].mlp.mlp_output.grad" else written

    monkeypatch.setattr(gradient_module, "check_gradient_write", broken)
    results = check_gradient_writes(model)
    assert _failed(results) == {(last, "mlp_output")}
    assert all(result.error is not None and result.error > 1e-4 for result in results if not result.passed)
    held = {result.values[0]: result for result in results if result.passed}
    assert len(held) == len(results) - 1 >= 7
    assert {name for name, result in held.items() if "in a row of its own of one batch" in result.note} == {
        "layer_input", "neurons"}
