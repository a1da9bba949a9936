"""Writes.

- ``invokes``: a write in one invoke leaves the batch's other invokes bit-identical, and reaches its own (on a model
  that computes a batch's tokens together, bitsandbytes LLM.int8, only that it reaches its own).
- ``locality``: in bf16, a write at one position leaves every other position bit-identical (on a model that computes
  a batch's tokens together, bitsandbytes LLM.int8, only that it reaches its own).

Both cover the model-level values read at a module (`nncanon.model_sites`) with the block values.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from ...components.anatomy import NEURON_VALUES
from ...components.norms import NORM_VALUES
from ...mounted import MountedModel
from ...quantization import batch_coupling, detected
from ...reading import CONTRIBUTIONS, host
from ..prompts import PROMPTS
from .base import HEAD_VALUES, INPUT_VALUES, KERNEL_INPUTS, CheckResult, guarded
from .embeddings import served_sites
from .references import encode, fresh_copy, served, whole_layers


def check_invokes(model: Any) -> list[CheckResult]:
    """A write in the middle invoke of three leaves the other two bit-identical and reaches its own (a model that
    computes a batch's tokens together, bitsandbytes LLM.int8: reaches its own)."""
    writable = NORM_VALUES + INPUT_VALUES + KERNEL_INPUTS + HEAD_VALUES + NEURON_VALUES + CONTRIBUTIONS
    writes: list[tuple[int | None, str]] = [(index, name) for index in range(model.num_layers)
                                            for name in served(model, index, writable)]
    writes += [(None, name) for name in served_sites(model)]  # the model-level values read at a module
    coupled = batch_coupling(model._module)
    together = guarded("invokes", None, (), lambda: _all_invokes(model, writes, coupled)) if len(writes) > 1 else []
    if together and all(result.passed for result in together):
        return together
    results = []  # (one write failed, or the batch raised: each write alone, so that a failure is exactly its value's)
    clean: list = []  # the three invokes' logits with no write: one run for every value
    for index, name in writes:
        results += guarded("invokes", index, (name,), lambda index=index, name=name: [
            _invokes(model, index, name, clean, coupled)])
    return results


def _tolerance(model: Any) -> float:
    # A mixture of experts runs each expert on the batch's tokens routed to it: a write that reroutes
    # an invoke's tokens changes how many rows each expert's matmul has, which moves the other rows'
    # results at the last bit (7.5e-9 measured). A write that leaked would move them by far more.
    return 1e-6 if model.support().layers_with("expert_indices") else 0.0


def _many_invokes(model: Any, writes: list[tuple[int | None, str]] | None, count: int) -> list[torch.Tensor]:
    """The logits of ``2·count + 2`` invokes: the first prompt ``2·count + 1`` times, then the second; with
    ``writes``, invoke ``2i + 1`` has write ``i``'s value changed past the first position (each written invoke
    between two that are not)."""
    logits: dict = {}  # bound outside the trace, filled inside (by invoke: their bodies run in the forward's order)
    if writes is None:  # (one invoke of the same rows: the same batch, as nnsight pads it)
        with torch.no_grad(), model.trace() as tracer:
            with tracer.invoke([PROMPTS[0]] * (2 * count + 1) + [PROMPTS[1]]):
                logits[0] = model.logits.save()
        return list(logits[0].split(1))
    with torch.no_grad(), model.trace() as tracer:
        for position in range(2 * count + 1):
            with tracer.invoke(PROMPTS[0]):
                if position % 2:
                    layer, name = writes[position // 2]
                    value = getattr(model if layer is None else host(model, layer, name), name)
                    value[:, 1:] = value[:, 1:] * 3 + 1
                logits[position] = model.logits.save()
        with tracer.invoke(PROMPTS[1]):
            logits[2 * count + 1] = model.logits.save()
    return [logits[position] for position in range(2 * count + 2)]


def _all_invokes(model: Any, writes: list[tuple[int | None, str]], coupled: str | None) -> list[CheckResult]:
    """`_invokes` of every write in one trace: write ``i`` in invoke ``2i + 1``, between invokes with no write (and
    the second prompt last), against the same invokes with no write. Each write must reach its own invoke; no invoke
    without a write may move (a write that leaked into its neighbours, or into any other, fails every result)."""
    clean, written = _many_invokes(model, None, len(writes)), _many_invokes(model, writes, len(writes))
    tolerance = _tolerance(model)
    unwritten = [i for i in range(len(clean)) if i % 2 == 0 or i == len(clean) - 1]
    moved = max(float((written[i] - clean[i]).abs().max()) for i in unwritten)
    results = []
    for number, (index, name) in enumerate(writes):
        own = 2 * number + 1
        reached = not torch.equal(written[own], clean[own])
        passed = reached and (moved <= tolerance or coupled is not None)
        note = (f"the other {len(unwritten)} unwritten invokes' logits (every value written in its own invoke of "
                f"{len(clean)})" + ("" if reached else "; the write did not reach its own invoke") + (
                    f"; not asserted: the model computes a batch's tokens together ({coupled.split(' (')[0]})"
                    if coupled is not None and moved > tolerance else ""))
        results.append(CheckResult("invokes", index, (name,), passed, moved, tolerance, note))
    return results


def _three_invokes(model: Any, write: tuple[int | None, str] | None) -> tuple[torch.Tensor, ...]:
    """The logits of three invokes (the first prompt twice, then the second), ``write``'s value (``(layer, name)``;
    layer ``None``: a model-level value) changed past the first position in the middle one."""
    with torch.no_grad(), model.trace() as tracer:
        with tracer.invoke(PROMPTS[0]):
            first = model.logits.save()
        with tracer.invoke(PROMPTS[0]):
            if write is not None:  # (large, and never 0: an edit that a quantized model's rounding cannot absorb)
                value = getattr(model if write[0] is None else host(model, *write), write[1])
                value[:, 1:] = value[:, 1:] * 3 + 1
            middle = model.logits.save()
        with tracer.invoke(PROMPTS[1]):
            last = model.logits.save()
    return first, middle, last


def _invokes(model: Any, index: int | None, name: str, clean: list, coupled: str | None) -> CheckResult:
    if not clean:
        clean.append(_three_invokes(model, None))
    runs = {False: clean[0], True: _three_invokes(model, (index, name))}
    tolerance = _tolerance(model)
    moved = max(float((runs[True][i] - runs[False][i]).abs().max()) for i in (0, 2))
    reached = not torch.equal(runs[True][1], runs[False][1])
    # A model that computes a batch's tokens together (LLM.int8's outlier columns) moves the other invokes whatever
    # is served: a property of the model (`support().batch`, a warning at its first trace), not a leak.
    passed = reached and (moved <= tolerance or coupled is not None)
    note = "the other invokes' logits" + ("" if reached else "; the write did not reach its own invoke") + (
        f"; not asserted: the model computes a batch's tokens together ({coupled.split(' (')[0]})"
        if coupled is not None and moved > tolerance else "")
    return CheckResult("invokes", index, (name,), passed, moved, tolerance, note)


def check_locality(model: Any) -> list[CheckResult]:
    """In bf16, a write at one position of a contribution leaves every other position of the layer's
    output bit-identical (the earlier ones only where a later sublayer reads the previous token:
    the family's ``token_shift_after``); a half-precision model, or a quantized one whose layers take no bf16, in
    its own format."""
    token_shift_after = model.family.token_shift_after
    bf16 = _bf16_copy(model)
    coupled = batch_coupling(bf16._module)  # (LLM.int8's outlier columns are picked over every token of the batch)
    writes = [(index, name) for index in whole_layers(bf16) for name in served(bf16, index)]
    together = guarded("locality", None, (), lambda: _all_localities(bf16, writes, coupled)) if len(writes) > 1 else []
    held = {(result.layer, result.values[0]): result for result in together if result.passed and result.values}
    results = []  # (a write that failed among the others, or all where the batch raised: alone, as its verdict)
    clean: dict = {}  # every block's layer_output with no write: one run for all of them
    for index, name in writes:
        results += [held[index, name]] if (index, name) in held else guarded(
            "locality", index, (name,), lambda index=index, name=name: [
                _locality(bf16, index, name, name in token_shift_after, clean, coupled)])
    # The model-level values alone: a write to GPT-2's position embeddings (one row broadcast over the batch) moves
    # the other invokes' bf16 rounding, which a write in an invoke of its own could not tell from a leak.
    for name in served_sites(bf16):
        results += guarded("locality", None, (name,), lambda name=name: [_model_locality(bf16, name, coupled)])
    return results


#: The position every locality write is made at.
_POSITION = 2


def _all_localities(model: Any, writes: list[tuple[int, str]], coupled: str | None) -> list[CheckResult]:
    """`_locality` of every block write in one trace, each in an invoke of its own, against as many invokes with no
    write (the same batch)."""
    runs: dict = {}  # bound outside the trace, filled inside (by invoke: their bodies run in the forward's order)
    for write in (False, True):  # (invokes of one prompt each, as many, both times: the same batch in bf16)
        with torch.no_grad(), model.trace() as tracer:
            for row, (layer, name) in enumerate(writes):
                with tracer.invoke(PROMPTS[0]):
                    if write:
                        getattr(host(model, layer, name), name)[:, _POSITION] += 0.5
                    runs[write, row] = model.layers[layer].layer_output.save()
    shifted = model.family.token_shift_after
    results = []
    for row, (layer, name) in enumerate(writes):
        before, after = runs[False, row], runs[True, row]
        later = range(_POSITION + 1, before.shape[1]) if name not in shifted else ()
        others = [*range(_POSITION), *later]
        moved = float((after[:, others].float() - before[:, others].float()).abs().max())
        reached = not torch.equal(after[:, _POSITION], before[:, _POSITION])
        note = (f"other positions of layer_output, bf16 (every block's value written in its own invoke of "
                f"{len(writes)})" + ("" if reached else "; the write did not reach the stream") + (
                    f"; not asserted: the model computes a batch's tokens together ({coupled.split(' (')[0]})"
                    if coupled is not None and moved > 0 else ""))
        results.append(CheckResult("locality", layer, (name,), reached and (moved == 0.0 or coupled is not None),
                                   moved, 0.0, note))
    return results


def _model_locality(model: Any, name: str, coupled: str | None) -> CheckResult:
    """A model-level value written at one position: the stream entering block 0 (the embeddings) or the logits (the
    final norm's output) moves there only."""
    position = _POSITION
    observed = "logits" if name == "final_norm_output" else "layers[0].layer_input"
    runs = []
    for write in (False, True):
        with torch.no_grad(), model.trace(PROMPTS[0]):
            if write:
                getattr(model, name)[:, position] += 0.5
            runs.append((model.logits if name == "final_norm_output" else model.layers[0].layer_input).save())
    clean, written = runs
    others = [i for i in range(clean.shape[1]) if i != position]
    moved = float((written[:, others].float() - clean[:, others].float()).abs().max())
    reached = not torch.equal(written[:, position], clean[:, position])
    note = f"other positions of {observed}, bf16" + ("" if reached else "; the write did not reach the model") + (
        f"; not asserted: the model computes a batch's tokens together ({coupled.split(' (')[0]})"
        if coupled is not None and moved > 0 else "")
    return CheckResult("locality", None, (name,), reached and (moved == 0.0 or coupled is not None), moved, 0.0, note)


def _bf16_copy(model: Any) -> Any:
    """A bf16 copy of a float32 model; a half-precision model itself. A quantized model's copy has its floating
    tensors cast by torch (transformers refuses to cast a quantized model), its quantized weights as they are;
    where its quantized layers do not take bf16 inputs (quanto's), the model itself, in its own format."""
    found = detected(model._module)
    if found is not None and found.method is None:
        return model
    if found is None:
        module = copy.deepcopy(model._module).to(torch.bfloat16)
    else:
        module = fresh_copy(model._module)._apply(_to_bf16)
        try:
            with torch.no_grad():
                module(**encode(model))
        except Exception:
            return model
    return MountedModel(module, family=model.family, tokenizer=model.tokenizer)


def _to_bf16(tensor: torch.Tensor) -> torch.Tensor:
    """A floating tensor in bf16; one whose dtype cannot change (quanto's weights), and any other, as it is."""
    if not tensor.is_floating_point():
        return tensor
    try:
        return tensor.to(torch.bfloat16)
    except (ValueError, RuntimeError, TypeError):
        return tensor


def _locality(model: Any, index: int, name: str, shifted: bool, clean: dict, coupled: str | None) -> CheckResult:
    position = _POSITION
    layer = model.layers[index]
    if not clean:
        with torch.no_grad(), model.trace(PROMPTS[0]):
            for each in whole_layers(model):
                clean[each] = model.layers[each].layer_output.save()
    with torch.no_grad(), model.trace(PROMPTS[0]):
        getattr(host(model, index, name), name)[:, position] += 0.5
        written = layer.layer_output.save()
    later = range(position + 1, clean[index].shape[1]) if not shifted else ()
    others = [*range(position), *later]
    moved = float((written[:, others].float() - clean[index][:, others].float()).abs().max())
    reached = not torch.equal(written[:, position], clean[index][:, position])
    note = "other positions of layer_output, bf16" + ("" if reached else "; the write did not reach the stream") + (
        f"; not asserted: the model computes a batch's tokens together ({coupled.split(' (')[0]})"
        if coupled is not None and moved > 0 else "")
    return CheckResult("locality", index, (name,), reached and (moved == 0.0 or coupled is not None), moved, 0.0,
                       note)
