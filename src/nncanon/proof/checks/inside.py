"""Inside attention: its scores, its queries and keys before their norms, its output gate.

- ``scores``: ``softmax(attention_scores)`` (with the sink column where the attention appends one) equals
  ``attention_probabilities``; under eager, one score raised by 1 (one head, query and key) gives the logits that the
  same edit made by nnsight's source hooks at the softmax of a plain copy gives, bit for bit.
- ``qk_norm``: the q/k norm module applied to the value (laid out as the module received it) is the module's own
  output (a plain hook), and the value's leading axes are the queries' ``[b, s]``.
- ``gate``: the kernel's output times ``attention_gate`` is ``attention_head_outputs``.
"""

from __future__ import annotations

from typing import Any

import torch

from ...components.inside import BEFORE_NORM
from ...components.kernel import has_sinks, scores_operation
from ..prompts import PROMPTS
from .base import TOLERANCE, CheckResult, compare, guarded, shared_or_none
from .kernel import _interface, _kernel
from .references import encode, hf_block, hooks_removed, plain_copy


def check_scores(model: Any) -> list[CheckResult]:
    """``softmax(attention_scores) == attention_probabilities`` (with the sink column where the attention's sinks
    are a column of the softmax); under eager, a write to the scores is the same edit at the softmax of a plain
    copy."""
    report = model.support()
    layers = [index for index in report.layers_with("attention_scores")
              if report.available("attention_probabilities", layer=index)]
    eager = [index for index in layers if model.layers[index].self_attn._eager()]
    # every block's scores and probabilities read in one trace (two where they are recomputed beside the kernel), and
    # every eager block's clean run in one; where that raises, each block reads alone, so a failure is exactly its own
    read = shared_or_none(lambda: _read_scores(model, layers)) or {}
    clean = shared_or_none(lambda: _clean_runs(model, eager)) or {}
    results = []
    for index in layers:
        results += guarded("scores", index, ("attention_scores",), lambda index=index: [
            _softmax(model, index, read.get(index))])
        if index in eager:
            results += guarded("scores", index, ("attention_scores",), lambda index=index: [
                _write(model, index, clean.get(index))])
    return results


def _read_scores(model: Any, layers: list[int]) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """``(scores, probabilities)`` of each block of ``layers`` on `PROMPTS`: one trace (two where any block
    recomputes them beside the kernel: both are served at the kernel's output)."""
    scores: dict = {}  # bound outside the traces, filled inside
    probabilities: dict = {}
    apart = any(not model.layers[index].self_attn._eager() for index in layers)
    with torch.no_grad(), model.trace(PROMPTS):
        for index in layers:
            scores[index] = model.layers[index].self_attn.attention_scores.save()
            if not apart:
                probabilities[index] = model.layers[index].self_attn.attention_probabilities.save()
    if apart:
        with torch.no_grad(), model.trace(PROMPTS):
            for index in layers:
                probabilities[index] = model.layers[index].self_attn.attention_probabilities.save()
    return {index: (scores[index], probabilities[index]) for index in layers}


def _clean_runs(model: Any, layers: list[int]) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """``(probabilities, logits)`` of each block of ``layers`` on the first prompt, with nothing written: one
    trace."""
    saved: dict = {}  # bound outside the trace, filled inside
    with torch.no_grad(), model.trace(PROMPTS[0]):
        for index in layers:
            saved[index] = model.layers[index].self_attn.attention_probabilities.save()
        saved["logits"] = model.logits.save()
    return {index: (saved[index], saved["logits"]) for index in layers}


def with_sinks(scores: torch.Tensor, module: torch.nn.Module) -> torch.Tensor:
    """``scores`` ``[b, H, q, k]`` with the attention's sink logits (``module.sinks``, ``[H]``) as one more column,
    where it has them (gpt-oss); else ``scores``."""
    if not has_sinks(module):
        return scores
    sinks = module.sinks
    return torch.cat([scores, sinks.reshape(1, -1, 1, 1).expand(*scores.shape[:-1], 1).to(scores.dtype)], dim=-1)


def probabilities_of(scores: torch.Tensor, module: torch.nn.Module, like: torch.Tensor | None = None
                     ) -> torch.Tensor:
    """The probabilities ``scores`` make: ``softmax`` in fp32, cast to the scores' dtype. Where the attention has
    sink logits, they are either one more column of the softmax, dropped after (gpt-oss), or only scale the output
    after it (Granite's sliding-window attention): the one of the two closer to ``like`` (the probabilities served
    beside them), or the first without it."""
    plain = torch.softmax(scores.float(), dim=-1).to(scores.dtype)
    if not has_sinks(module):
        return plain
    sunk = torch.softmax(with_sinks(scores, module).float(), dim=-1)[..., : scores.shape[-1]].to(scores.dtype)
    if like is None:
        return sunk
    return min((sunk, plain), key=lambda each: float((each.double() - like.double()).abs().max()))


def _softmax(model: Any, index: int, read: tuple[torch.Tensor, torch.Tensor] | None = None) -> CheckResult:
    """``softmax(scores) == probabilities`` on block ``index``, from ``read`` (`_read_scores`; ``None``: read now)."""
    attention = model.layers[index].self_attn
    scores, probabilities = read if read is not None else _read_scores(model, [index])[index]
    return compare("scores", index, ("attention_scores",), probabilities_of(scores, attention._module, probabilities),
                   probabilities, TOLERANCE, "softmax(scores) (with its sink column, where the sinks are one) against "
                   "attention_probabilities")


def write_position(probabilities: torch.Tensor) -> tuple[int, int]:
    """``(head, key)`` where raising one score of the last query moves its probabilities most: the largest
    ``p·(1 - p)`` (a score's own derivative through the softmax; 0 for a masked key, and for the one key a row
    attends). One key, as raising a whole row would leave its softmax as it is."""
    last = probabilities[0, :, -1].double()
    moves = last * (1 - last)
    flat = int(moves.flatten().argmax())
    return flat // last.shape[-1], flat % last.shape[-1]


def _write(model: Any, index: int, clean_run: tuple[torch.Tensor, torch.Tensor] | None = None) -> CheckResult:
    """A write to block ``index``'s scores against the same edit at a plain copy's softmax; ``clean_run``: the
    block's probabilities and the logits with nothing written (`_clean_runs`; ``None``: run now)."""
    attention = model.layers[index].self_attn
    probabilities, clean = clean_run if clean_run is not None else _clean_runs(model, [index])[index]
    head, key = write_position(probabilities)

    def _edit(scores: torch.Tensor) -> None:  # the write both sides make, in place
        scores[:, head, -1, key] += 1.0

    with torch.no_grad(), model.trace(PROMPTS[0]):
        _edit(attention.attention_scores)
        ours = model.logits.save()
    plain = plain_copy(model)
    path = ".".join((model.family.layers, str(index), model.family.for_layer(model._text_config, index)[0].attention))
    with torch.no_grad(), plain.trace(**encode(model)):
        operation, listed = scores_operation(plain.get(path).source, attention._nncanon.probabilities,
                                             has_sinks(attention._module))
        scores = operation.input[0] if listed else operation.input
        heads = attention._nncanon.bindings["attention_head_outputs"].heads
        _edit(scores.unflatten(0, (-1, heads)) if scores.dim() == 3 else scores)
        reference = plain.output.logits.save()
    result = compare("scores", index, ("attention_scores",), ours, reference, 0.0,
                     f"head {head}'s score + 1 at the last query for key {key} against the same edit at the softmax "
                     "of a plain copy")
    if result.passed and torch.equal(ours, clean):
        return CheckResult("scores", index, ("attention_scores",), False, 0.0, 0.0,
                           "the write to the scores did not move the logits")
    return result


def check_qk_norm(model: Any) -> list[CheckResult]:
    """The q/k norm applied to ``query_states_before_norm`` / ``key_states_before_norm`` (laid out as the norm
    received it) is the norm's own output, and the value is laid out ``[b, s, ...]`` as ``query_states`` is."""
    results = []
    report = model.support()
    for index in range(model.num_layers):
        names = [name for name in BEFORE_NORM if report.available(name, layer=index)]
        if names:
            results += guarded("qk_norm", index, names, lambda index=index, names=names: _normed(model, index, names))
    return results


def _normed(model: Any, index: int, names: list[str]) -> list[CheckResult]:
    attention = model.layers[index].self_attn
    bindings = attention._nncanon.bindings
    saved: dict = {}  # bound outside the trace, filled inside
    with torch.no_grad(), model.trace(PROMPTS[0]):
        for name in names:
            saved[name] = getattr(attention, name).save()
    block = hf_block(model, index)
    outputs: dict = {}
    handles = []
    for name in names:
        module = block.get_submodule(bindings[name].site.module)
        handles.append(module.register_forward_hook(
            lambda mod, args, output, name=name: outputs.setdefault(name, (mod, output.clone())) and None))
    with hooks_removed(handles), torch.no_grad():
        model._module(**encode(model))
    batch, seq = encode(model)["input_ids"].shape
    results = []
    for name in names:
        module, output = outputs[name]
        value = saved[name]
        as_received = value.transpose(1, 2) if bindings[name].site.heads_first else value
        with torch.no_grad():
            normed = module(as_received)
        results.append(compare("qk_norm", index, (name,), normed, output, TOLERANCE,
                               "the norm applied to the value against its own output (a plain hook)"))
        if tuple(value.shape[:2]) != (batch, seq):
            results.append(CheckResult("qk_norm", index, (name,), False, None, None,
                                       f"laid out {tuple(value.shape)}, not [b, s, ...] = [{batch}, {seq}, ...]"))
    return results


def check_gate(model: Any) -> list[CheckResult]:
    """The kernel's output times ``attention_gate`` is ``attention_head_outputs`` (the output projection's input)."""
    results = []
    report = model.support()
    for index in report.layers_with("attention_gate"):
        if report.available("attention_head_outputs", layer=index):
            results += guarded("gate", index, ("attention_gate",), lambda index=index: [_gated(model, index)])
    return results


def _gated(model: Any, index: int) -> CheckResult:
    attention = model.layers[index].self_attn
    with torch.no_grad(), model.trace(PROMPTS[0]):
        output = _interface(model, index, output=True).output.save()
        gate = attention.attention_gate.save()
        heads = attention.attention_head_outputs.save()
    ungated = _kernel(model, index).attention_output(output, heads.shape[0])  # [b, s, H, d]
    per_head = gate.reshape(*heads.shape[:3], -1)  # [b, s, H, d], or [b, s, H, 1] for one number per head
    gated = (ungated.to(per_head.dtype) * per_head).to(heads.dtype)
    return compare("gate", index, ("attention_gate",), gated, heads, TOLERANCE,
                   "the kernel's output times the gate against attention_head_outputs")
