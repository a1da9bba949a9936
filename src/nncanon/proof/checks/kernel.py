"""The attention kernel's inputs.

- ``kernel``: ``softmax(q·kᵀ·scale + mask)`` of the kernel's inputs reproduces the eager probabilities (under a
  kernel that computes none, times the values it reproduces the kernel's output); zeroing one group of values
  zeroes exactly its heads' kernel output.
- ``recomputed``: under sdpa, the probabilities recomputed from the kernel's inputs equal eager's, and multiply
  the values to sdpa's output.
"""

from __future__ import annotations

from typing import Any

import torch

from ...components.kernel import RECOMPUTED, Kernel, _additive_mask
from ...components.kernel import implementation as kernel_implementation
from ...served import operation_name
from ..prompts import PROMPTS
from .base import KERNEL_INPUTS, TOLERANCE, CheckResult, compare, guarded, raised_or, shared_or_none
from .references import encode, encode_batch, implementation_copy, kernel_copies, site_references


def check_kernel(model: Any) -> list[CheckResult]:
    """The kernel's inputs are what it attends with: ``softmax(q·kᵀ·scale + mask)`` (with the call's
    softcap, position bias and sinks, or the module's ALiBi argument where an inline kernel adds it; where the
    kernel masks positions itself, from buffers no argument holds, over the rest, on token rows) reproduces the
    eager probabilities, and zeroing one group of ``value_states`` zeroes exactly its heads' kernel output.
    Where the forward calls its kernel only under another attention implementation (Falcon's sdpa call before
    transformers 5.25), on a
    copy of the model running that one: the inputs read there against plain source hooks, and
    ``softmax(q·kᵀ·scale + mask) · v`` against the kernel's own output."""
    results = []
    report = model.support()
    attends = {index: ("query_states", *(("key_states",) if report.available("key_states", layer=index) else ()),
                       "attention_probabilities")
               for index in report.layers_with("query_states")
               if report.available("attention_probabilities", layer=index) and _runs_eager(model)}
    reaches = [index for index in report.layers_with("query_states") if report.available("value_states", layer=index)]
    # every block's reads in one trace, and every block's clean run of the values' reach in one; where that raises,
    # each block alone, so that a failure is exactly its own
    read = shared_or_none(lambda: _attends_read(model, attends))
    clean = shared_or_none(lambda: _clean_outputs(model, reaches))
    for index in report.layers_with("query_states"):
        if index in attends:
            results += guarded("kernel", index, attends[index], lambda index=index: [
                _attends(model, index, attends[index], None if read is None else read[index])])
        if index in reaches:
            results += guarded("kernel", index, ("value_states",), lambda index=index: [
                _values_reach(model, index, None if clean is None else clean[index])])
    return results + _kernel_elsewhere(model)


def _kernel_elsewhere(model: Any) -> list[CheckResult]:
    """The kernel inputs of blocks whose forward calls the kernel only under another implementation (not
    served on ``model``), proved on a copy running it: read, their scores, and the values' reach."""
    results = []
    for other, layers in kernel_copies(model):
        results += _kernel_on(other, layers)
    return results


def _kernel_on(other: Any, layers: list[int]) -> list[CheckResult]:
    """`_kernel_elsewhere` on ``other``, the copy running the kernel."""
    inputs, report, results = encode(other), other.support(), []
    for index in layers:
        names = [name for name in KERNEL_INPUTS if report.available(name, layer=index)]
        results += guarded("read", index, names, lambda index=index, names=names: _read_kernel(
            other, index, names, inputs))
        if "query_states" in names:
            values = tuple(names)
            results += guarded("kernel", index, values, lambda index=index, values=values: [
                _attends(other, index, values)])
        if "value_states" in names:
            results += guarded("kernel", index, ("value_states",), lambda index=index: [
                _values_reach(other, index)])
    return results


def _read_kernel(model: Any, index: int, names: list[str], inputs: dict) -> list[CheckResult]:
    """The kernel inputs ``names`` of block ``index`` against nnsight's source hooks on a plain copy."""
    saved = {}
    with torch.no_grad(), model.trace(PROMPTS[0]):
        for name in names:
            saved[name] = getattr(model.layers[index].self_attn, name).save()
    references = site_references(model, [(index, name) for name in names], inputs)
    return [compare("read", index, (name,), saved[name], raised_or(references[index, name]), 0.0,
                     f"against a source hook at its call, under {kernel_implementation(model._module)}")
            for name in names]


def _runs_eager(model: Any) -> bool:
    return all(model.layers[i].self_attn._eager() for i in model.support().layers_with("attention_probabilities"))


def _kernel(model: Any, index: int) -> Kernel:
    return model.layers[index].self_attn._nncanon.kernel


def _interface(model: Any, index: int, output: bool = False) -> Any:
    """Block ``index``'s kernel call (transformers' attention interface, or the family's), as an nnsight
    operation (inside a trace); ``output``: the call whose output is the attention output (`Kernel.output_op`)."""
    source = model.layers[index].self_attn.source
    kernel = _kernel(model, index)
    return getattr(source, operation_name(source.names, kernel.output_op if output else kernel.op))


def _bias(module: torch.nn.Module, kernel: Kernel, inputs: tuple, kwargs: dict, batch: int, keys: int
          ) -> torch.Tensor:
    """The position bias the kernel adds to the scores (`Kernel.bias`): the module's argument of that name (of
    its forward's ``inputs``), laid out to broadcast over ``[b, heads, q, k]`` (its last ``keys`` positions;
    heads out of the batch where the kernel folds them in), times the call's ``beta``."""
    import inspect

    bound = inspect.signature(type(module).forward).bind(module, *inputs[0], **inputs[1])  # (the class's own)
    bias = bound.arguments[kernel.bias][..., -keys:]
    if kernel.batch_heads:
        bias = bias.unflatten(0, (batch, -1))  # [b·heads, 1, k]
    return bias * kwargs.get("beta", 1.0)


def _attends_read(model: Any, attends: dict[int, tuple[str, ...]]) -> dict[int, dict]:
    """What `_attends` reads on each block of ``attends`` (its values by block), on `PROMPTS`, in one trace."""
    saved: dict = {index: {} for index in attends}  # bound outside the trace, filled inside
    with torch.no_grad(), model.trace(PROMPTS):
        for index, values in attends.items():
            attention = model.layers[index].self_attn
            if _kernel(model, index).bias is not None:
                saved[index]["module"] = attention.inputs.save()
            for name in values:
                if name in KERNEL_INPUTS:
                    saved[index][name] = getattr(attention, name).save()
            saved[index]["call"] = _interface(model, index).inputs.save()
            if attention._eager():
                saved[index]["probabilities"] = attention.attention_probabilities.save()
            else:
                saved[index]["output"] = _interface(model, index, output=True).output.save()
    return saved


def _attends(model: Any, index: int, values: tuple[str, ...], read: dict | None = None) -> CheckResult:
    """``values``: the kernel inputs served on the block (where ``key_states`` is declined, the keys are the
    call's own argument, and likewise the values), held to the eager probabilities; where the model runs a
    kernel that computes none, the probabilities times the values are held to the kernel's own output. ``read``:
    what `_attends_read` read (``None``: read now)."""

    attention = model.layers[index].self_attn
    kernel = _kernel(model, index)
    eager = attention._eager()
    saved = read if read is not None else _attends_read(model, {index: values})[index]
    args, kwargs = saved["call"]
    called = kernel.inputs(args, kwargs)
    q = saved["query_states"].transpose(1, 2)  # [b, H, s, d]
    k = called[1] if "key_states" not in saved else saved["key_states"].transpose(1, 2)
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    scores = q @ k.transpose(-1, -2) * kernel.scale(attention._module, kwargs, q.shape[-1])
    if kwargs.get("softcap"):
        scores = torch.tanh(scores / kwargs["softcap"]) * kwargs["softcap"]
    if kwargs.get("position_bias") is not None:  # an additive bias the interface takes (relative positions)
        scores = scores + kwargs["position_bias"]
    if kernel.bias is not None:  # the module's own position bias (ALiBi), added to the scaled scores
        scores = scores + _bias(attention._module, kernel, saved["module"], kwargs, q.shape[0], k.shape[-2])
    causal = kwargs.get(kernel.causal, False) if kernel.causal else getattr(attention._module, "is_causal", True)
    mask = _additive_mask(kernel.call_mask(args, kwargs), q, k, bool(causal))
    if mask is not None:
        scores = scores + mask[..., : k.shape[-2]]
    how = "q·kᵀ·scale + mask" if kernel.bias is None else f"q·kᵀ·scale + {kernel.bias} + mask"
    if kernel.structural_mask:  # masked inside the kernel, by buffers no argument holds: as it masked them
        scores = scores.masked_fill(saved["probabilities"] == 0, float("-inf"))
        how += ", over the positions the kernel does not mask itself"
    expected = {"softmax": torch.softmax(scores.float(), dim=-1).to(q.dtype)}
    sinks = kwargs.get("s_aux")
    if sinks is not None:  # a sink is one more logit of the softmax (GPT-OSS), or only scales the output after
        sunk = torch.cat([scores, sinks.reshape(1, -1, 1, 1).expand(*scores.shape[:-1], 1)], dim=-1)
        expected["softmax with the sink logit"] = torch.softmax(sunk.float(), dim=-1)[..., :-1].to(q.dtype)
    real = encode_batch(model)["attention_mask"].bool()  # the query rows that are tokens, not padding
    if eager:
        probabilities = saved["probabilities"]
        if kernel.structural_mask:  # a padding row attends where the kernel's own mask puts it: its rows only
            probabilities, expected = probabilities.transpose(1, 2)[real], {
                name: formula.transpose(1, 2)[real] for name, formula in expected.items()}
            how += ", on the rows that are tokens"
        results = [compare("kernel", index, values, probabilities, formula, TOLERANCE,
                            f"{name}({how}) against the eager probabilities") for name, formula in expected.items()]
    else:  # no probabilities: what they make of the values, on the rows that are tokens, against the kernel's output
        v = called[2] if "value_states" not in saved else saved["value_states"].transpose(1, 2)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
        output = kernel.attention_output(saved["output"], q.shape[0])[real]
        results = [compare("kernel", index, values, (formula @ v).transpose(1, 2)[real], output, TOLERANCE,
                            f"{name}({how}) · v against the kernel's output under "
                            f"{kernel_implementation(model._module)}") for name, formula in expected.items()]
    return next((result for result in results if result.passed), results[0])


def _clean_outputs(model: Any, layers: list[int]) -> dict[int, tuple[int, torch.Tensor]]:
    """``(value groups, kernel output)`` of each block of ``layers`` on the first prompt, nothing written: one
    trace."""
    saved: dict = {}  # bound outside the trace, filled inside
    with torch.no_grad(), model.trace(PROMPTS[0]):
        for index in layers:
            saved[index] = (model.layers[index].self_attn.value_states.save(),
                            _interface(model, index, output=True).output.save())
    return {index: (groups.shape[-2], output) for index, (groups, output) in saved.items()}


def _values_reach(model: Any, index: int, clean_run: tuple[int, torch.Tensor] | None = None) -> CheckResult:
    """Zeroing the last group of block ``index``'s values zeroes exactly its heads' kernel output; ``clean_run``:
    the groups and the kernel output with nothing written (`_clean_outputs`; ``None``: run now)."""
    attention = model.layers[index].self_attn
    kernel = _kernel(model, index)
    groups, clean = clean_run if clean_run is not None else _clean_outputs(model, [index])[index]
    with torch.no_grad(), model.trace(PROMPTS[0]):
        attention.value_states[..., -1, :] = 0
        written = _interface(model, index, output=True).output.save()
    clean, written = kernel.attention_output(clean, 1), kernel.attention_output(written, 1)
    heads = written.shape[-2]
    silenced = torch.arange(heads) // (heads // groups) == groups - 1
    zeroed = float(written[..., silenced, :].abs().max())
    moved = float((written[..., ~silenced, :] - clean[..., ~silenced, :]).abs().max()) if (~silenced).any() else 0.0
    reached = not torch.equal(written, clean)
    passed = zeroed == 0.0 and moved == 0.0 and reached
    note = (f"value group {groups - 1} zeroed: its {int(silenced.sum())} heads' kernel output max |x| {zeroed:.1e}, "
            f"the other heads moved {moved:.1e}")
    return CheckResult("kernel", index, ("value_states",), passed, max(zeroed, moved), 0.0, note)


def check_recomputed(model: Any) -> list[CheckResult]:
    """Under sdpa, the probabilities recomputed from the kernel's inputs equal eager's and multiply the
    values to sdpa's own output (left-padded batch)."""
    layers = [i for i in model.support().layers_with("attention_probabilities")
              if _recomputable(model.layers[i].self_attn._nncanon.kernel)
              and model.layers[i].self_attn._nncanon.reason(RECOMPUTED) is None]
    if not layers:
        return []
    sdpa = implementation_copy(model, "sdpa")
    if sdpa is None:  # the model class has no sdpa path: nothing runs without eager
        return []
    eager = model if _runs_eager(model) else implementation_copy(model, "eager")
    shared = shared_or_none(lambda: _recomputed(eager, sdpa, layers))  # every block in one trace of each copy
    if shared is not None:
        return shared
    results = []  # (the shared traces raised: each block alone says which one)
    for index in layers:
        results += guarded("recomputed", index, (RECOMPUTED,), lambda index=index: _recomputed(
            eager, sdpa, [index]))
    return results


def _recomputable(kernel: Any) -> bool:
    """Whether probabilities are recomputed from ``kernel`` (a `Kernel`, or why the block has none) under sdpa."""
    return isinstance(kernel, Kernel) and kernel.recompute is not None and kernel.runs_under("sdpa")


def _recomputed(eager: Any, sdpa: Any, layers: list[int]) -> list[CheckResult]:
    """`check_recomputed` of blocks ``layers``, read in one trace of each copy."""
    references: dict = {}  # bound outside the traces, filled inside
    saved: dict = {}
    with torch.no_grad(), eager.trace(PROMPTS):
        for index in layers:
            references[index] = eager.layers[index].self_attn.attention_probabilities.save()
    with torch.no_grad(), sdpa.trace(PROMPTS):
        for index in layers:
            saved[index] = (_interface(sdpa, index).inputs.save(),
                            sdpa.layers[index].self_attn.attention_probabilities.save(),
                            _interface(sdpa, index, output=True).output.save())
    real = encode_batch(sdpa)["attention_mask"].bool()  # the query rows that are tokens, not padding
    results = []
    for index in layers:
        call, probabilities, output = saved[index]
        output = _kernel(sdpa, index).attention_output(output, probabilities.shape[0])
        v = _kernel(sdpa, index).inputs(*call)[2]  # the values the kernel received, [b, KV, k, d]
        v = v.repeat_interleave(probabilities.shape[1] // v.shape[1], dim=1)
        mixed = (probabilities @ v).transpose(1, 2)  # [b, q, H, d]
        results += [
            compare("recomputed", index, (RECOMPUTED,), probabilities, references[index], TOLERANCE,
                     "recomputed under sdpa against eager's probabilities"),
            compare("recomputed", index, (RECOMPUTED,), mixed[real], output[real], TOLERANCE,
                     "recomputed probabilities · values against sdpa's output"),
        ]
    return results
