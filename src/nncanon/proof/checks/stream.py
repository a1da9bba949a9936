"""The stream and its contributions.

- ``read``: each value equals the tensor read with plain PyTorch hooks (or nnsight's source hooks for an
  operation inside a forward) on the unwrapped model, bit for bit; so do the logits.
- ``identity``: ``layer_input + contributions == layer_output``; an idle block (not run) adds nothing.
- ``ablation``: zeroing one contribution (the block's later contributions held at their clean values) moves
  ``layer_output`` by exactly that contribution: the value is what reaches the stream.
- ``lens``: the lens at the last layer equals the logits, bit for bit.
"""

from __future__ import annotations

from typing import Any

import torch

from ...components.anatomy import NEURON_VALUES
from ...reading import CONTRIBUTIONS, host
from ..prompts import PROMPTS
from .base import (
    HEAD_VALUES,
    INPUT_VALUES,
    KERNEL_INPUTS,
    ROUTING,
    TOLERANCE,
    CheckResult,
    compare,
    guarded,
    raised_or,
)
from .references import block_streams, encode, served, site_references, stream_block, whole_layers

_READ_VALUES = (*INPUT_VALUES, *KERNEL_INPUTS, *HEAD_VALUES, *CONTRIBUTIONS, *ROUTING, "shared_expert_output",
                *NEURON_VALUES)


def check_read(model: Any) -> list[CheckResult]:
    """Every served value, the block streams and the logits against plain hooks, bit for bit."""
    inputs = encode(model)
    entering, leaving, reference = block_streams(model, inputs)
    every = {index: ["layer_input", *served(model, index, _READ_VALUES), "layer_output"]
             for index in range(model.num_layers)}
    running = {index: names for index, names in every.items() if stream_block(model, index) is None}
    # every running block's values and the logits in one trace, against one plain forward's hooks (and one plain
    # copy's source hooks); where any differs, each block alone, so that a failure is exactly its block's
    together = guarded("read", None, ("logits",), lambda: _read_layers(model, running, inputs, entering, leaving,
                                                                       reference.logits))
    if all(result.passed for result in together):
        results = together
    else:
        with torch.no_grad(), model.trace(PROMPTS[0]):
            logits = model.logits.save()
        results = [compare("read", None, ("logits",), logits, reference.logits, 0.0, "against a plain forward")]
        for index, names in running.items():
            results += guarded("read", index, names, lambda index=index, names=names: _read_layer(
                model, index, names, inputs, entering[index], leaving[index]))
    for index, names in every.items():
        block = stream_block(model, index)
        if block is not None:  # idle: the stream where it enters the next block that runs (or leaves the last)
            stream = entering[block] if block > index else leaving[block]
            results += guarded("read", index, names, lambda index=index, stream=stream, block=block: _read_idle(
                model, index, stream, block, entering[index] is not None or leaving[index] is not None))
    return results


def _read_layers(model: Any, running: dict[int, list[str]], inputs: dict, entering: list, leaving: list,
                 logits: torch.Tensor) -> list[CheckResult]:
    """`_read_layer` of every block of ``running`` (its values by block) and the logits, in one trace."""
    saved: dict = {}  # bound outside the trace, filled inside
    with torch.no_grad(), model.trace(PROMPTS[0]):
        for index, names in running.items():
            for name in names:
                saved[index, name] = getattr(host(model, index, name), name).save()
        saved["logits"] = model.logits.save()
    results = [compare("read", None, ("logits",), saved["logits"], logits, 0.0, "against a plain forward")]
    references = site_references(model, [(index, name) for index, names in running.items() for name in names[1:-1]],
                                 inputs)
    for index, names in running.items():
        results += _compared(index, names, {name: saved[index, name] for name in names}, references,
                             entering[index], leaving[index])
    return results


def _read_idle(model: Any, index: int, stream: torch.Tensor, block: int, ran: bool) -> list[CheckResult]:
    """An idle block's ``layer_input`` and ``layer_output`` against the stream read by a plain hook at
    ``block``; fails where the model ran the block after all."""
    names = ("layer_input", "layer_output")
    if ran:
        return [CheckResult("read", index, names, False, None, 0.0,
                            "the model ran this block, which the family says it does not run (idle)")]
    saved: list = []  # bound outside the trace, filled inside
    with torch.no_grad(), model.trace(PROMPTS[0]):
        saved.append(model.layers[index].layer_input.save())
        saved.append(model.layers[index].layer_output.save())
    side = "input" if block > index else "output"
    return [compare("read", index, (name,), value, stream, 0.0, f"against a hook at layers[{block}]'s {side}")
            for name, value in zip(names, saved, strict=True)]


def _read_layer(model: Any, index: int, names: list[str], inputs: dict, entering: torch.Tensor,
                leaving: torch.Tensor) -> list[CheckResult]:
    saved = {}
    with torch.no_grad(), model.trace(PROMPTS[0]):
        for name in names:
            saved[name] = getattr(host(model, index, name), name).save()
    references = site_references(model, [(index, name) for name in names[1:-1]], inputs)
    return _compared(index, names, saved, references, entering, leaving)


def _compared(index: int, names: list[str], saved: dict, references: dict, entering: torch.Tensor,
              leaving: torch.Tensor) -> list[CheckResult]:
    """Block ``index``'s values ``saved`` (by name) against the block hooks and the site ``references``."""
    results = [
        compare("read", index, ("layer_input",), saved["layer_input"], entering, 0.0, "against a block hook"),
        compare("read", index, ("layer_output",), saved["layer_output"], leaving, 0.0, "against a block hook"),
    ]
    for name in names[1:-1]:
        results += guarded("read", index, (name,), lambda name=name: [compare(
            "read", index, (name,), saved[name], raised_or(references[index, name]), 0.0,
            "against a hook at its site")])
    return results


def check_identity(model: Any) -> list[CheckResult]:
    """``layer_input + contributions == layer_output`` on every block that serves all its contributions; a
    block the model does not run (`Family.idle`) adds nothing: the stream leaving the block that runs before
    it enters the one after it unchanged (plain hooks)."""
    results = []
    for index in whole_layers(model):
        names = served(model, index)
        results += guarded("identity", index, names, lambda index=index, names=names: [_identity(model, index, names)])
    idle = [index for index in range(model.num_layers) if stream_block(model, index) is not None]
    if idle:
        entering, leaving, _ = block_streams(model, encode(model))
        for index in idle:
            results += guarded("identity", index, ("layer_input", "layer_output"), lambda index=index: [
                _idle_identity(index, entering, leaving)])
    return results


def _idle_identity(index: int, entering: list, leaving: list) -> CheckResult:
    """An idle block adds nothing: the model does not call it, and the stream leaving the block that runs
    before it enters the one that runs after it unchanged (plain hooks)."""
    names = ("layer_input", "layer_output")
    if entering[index] is not None or leaving[index] is not None:
        return CheckResult("identity", index, names, False, None, 0.0, "the model ran this block (idle by its family)")
    before = next((i for i in range(index - 1, -1, -1) if leaving[i] is not None), None)
    after = next((i for i in range(index + 1, len(entering)) if entering[i] is not None), None)
    if before is None or after is None:
        return CheckResult("identity", index, names, True, None, None,
                           "the model does not call it (no block runs on one side to compare)")
    return compare("identity", index, names, entering[after], leaving[before], 0.0,
                    f"not called; layers[{before}]'s output enters layers[{after}] unchanged")


def _identity(model: Any, index: int, names: list[str]) -> CheckResult:
    parts: list = []  # bound outside the trace, filled inside
    with torch.no_grad(), model.trace(PROMPTS[0]):
        x = model.layers[index].layer_input.save()
        for name in names:
            parts.append(getattr(host(model, index, name), name).save())
        y = model.layers[index].layer_output.save()
    return compare("identity", index, names, x + sum(parts), y, TOLERANCE, "layer_input + contributions")


def check_ablation(model: Any) -> list[CheckResult]:
    """Each contribution zeroed, the block's later ones held at their clean values: ``layer_output``
    moves by exactly the contribution."""
    every = {index: names for index in range(model.num_layers) if (names := served(model, index))}
    # every contribution zeroed in an invoke of its own of one trace, against one clean run of every block; where any
    # fails (or the batch raises), each alone, as its verdict
    together = guarded("ablation", None, (), lambda: _all_ablations(model, every)) if every else []
    held = {(result.layer, result.values[0]): result for result in together if result.passed and result.values}
    results = []
    for index, names in every.items():
        clean: dict = {}  # the block's contributions and output with no write: one run for all of them
        for position, name in enumerate(names):
            later = names[position + 1:]
            results += [held[index, name]] if (index, name) in held else guarded(
                "ablation", index, (name,), lambda index=index, name=name, later=later, names=names, clean=clean: [
                    _ablation(model, index, name, later, names, clean)])
    return results


def _all_ablations(model: Any, every: dict[int, list[str]]) -> list[CheckResult]:
    """`_ablation` of every contribution of every block of ``every`` (its contributions by block), in one trace."""
    clean: dict = {}  # bound outside the trace, filled inside
    with torch.no_grad(), model.trace(PROMPTS[0]):
        for index, names in every.items():
            for name in names:
                clean[index, name] = getattr(host(model, index, name), name).save()
            clean[index, "layer_output"] = model.layers[index].layer_output.save()
    ablations = [(index, position, name) for index, names in every.items() for position, name in enumerate(names)]
    ablated: dict = {}  # (by invoke: their bodies run in the forward's order)
    with torch.no_grad(), model.trace() as tracer:
        for index, position, name in ablations:
            with tracer.invoke(PROMPTS[0]):
                setattr(host(model, index, name), name, torch.zeros_like(clean[index, name]))
                for other in every[index][position + 1:]:
                    setattr(host(model, index, other), other, clean[index, other])
                ablated[index, name] = model.layers[index].layer_output.save()
    results = []
    for index, position, name in ablations:
        later, output, moved = every[index][position + 1:], clean[index, "layer_output"], ablated[index, name]
        results.append(compare("ablation", index, (name,), output - moved, clean[index, name], TOLERANCE,
                               "the stream's change when it is zeroed" + (f", {', '.join(later)} held" if later else "")
                               + " (each zeroed in an invoke of its own)",
                               magnitude=torch.maximum(output.abs(), moved.abs())))
    return results


def _ablation(model: Any, index: int, name: str, later: list[str], names: list[str], clean: dict) -> CheckResult:
    if not clean:
        with torch.no_grad(), model.trace(PROMPTS[0]):
            for each in names:
                clean[each] = getattr(host(model, index, each), each).save()
            clean["layer_output"] = model.layers[index].layer_output.save()
    value = clean[name]
    with torch.no_grad(), model.trace(PROMPTS[0]):
        setattr(host(model, index, name), name, torch.zeros_like(value))
        for other in later:
            setattr(host(model, index, other), other, clean[other])
        ablated = model.layers[index].layer_output.save()
    return compare("ablation", index, (name,), clean["layer_output"] - ablated, value, TOLERANCE,
                    "the stream's change when it is zeroed" + (f", {', '.join(later)} held" if later else ""),
                    magnitude=torch.maximum(clean["layer_output"].abs(), ablated.abs()))


def check_lens(model: Any) -> list[CheckResult]:
    """``project_on_vocab(layers[-1].layer_output) == logits``, bit for bit, on a left-padded batch."""

    def run() -> list[CheckResult]:
        with torch.no_grad(), model.trace(PROMPTS):
            lens = model.project_on_vocab(model.layers[-1].layer_output).save()
            logits = model.logits.save()
        return [compare("lens", None, ("project_on_vocab",), lens, logits, 0.0, "at the last layer")]

    return guarded("lens", None, ("project_on_vocab",), run)
