"""Heads and probabilities.

- ``heads``: the heads, each through its slice of the output projection (plus the bias), sum to the
  projection's output.
- ``probabilities``: zeroing a head's probabilities equals zeroing its output.
"""

from __future__ import annotations

from typing import Any

import torch

from ...quantization import dense_weight
from ...reading import head_count, host
from ..prompts import PROMPTS
from .base import HEAD_VALUES, TOLERANCE, CheckResult, compare, guarded
from .references import encode, hf_block, served


def check_heads(model: Any) -> list[CheckResult]:
    """Each block's heads through their slices of the output projection sum to the projection's output."""
    results = []
    for index in range(model.num_layers):
        for name in served(model, index, HEAD_VALUES):
            results += guarded("heads", index, (name,), lambda index=index, name=name: [_heads(model, index, name)])
    return results


def _heads(model: Any, index: int, name: str) -> CheckResult:
    spec = model.family.for_layer(model._text_config, index)[0]
    if spec.head_totals is not None:
        with torch.no_grad(), model.trace(PROMPTS[0]):
            heads = getattr(host(model, index, name), name).save()
        total, output = spec.head_totals(model, index, heads, encode(model))
        return compare("heads", index, (name,), total, output, TOLERANCE, "the family's head totals")
    binding = host(model, index, name)._nncanon.bindings[name]
    through_norm = name == "attention_head_outputs" and spec.head_norm is not None
    # Where a norm over all heads sits before the projection (BitNet), the heads are its input.
    path = spec.head_projection if through_norm else binding.site.module
    projection = hf_block(model, index).get_submodule(path)
    seen: dict = {}

    def keep(module: torch.nn.Module, args: Any, out: torch.Tensor) -> None:
        seen["out"] = out.clone()

    handle = projection.register_forward_hook(keep)
    try:
        with torch.no_grad(), model.trace(PROMPTS[0]):
            heads = getattr(host(model, index, name), name).save()
    finally:
        handle.remove()
    if through_norm:
        with torch.no_grad():
            heads = hf_block(model, index).get_submodule(spec.head_norm)(heads.flatten(-2)).view_as(heads)
    weight, bias = _projection(projection)
    per_head = weight.view(weight.shape[0], heads.shape[-2], -1)  # [out, H, head_dim]
    with torch.no_grad():
        total = torch.einsum("bshd,ohd->bso", heads, per_head.to(heads.dtype))
        if bias is not None:
            total = total + bias
    return compare("heads", index, (name,), total, seen["out"].view_as(total), TOLERANCE,
                    f"sum over heads through {path}")


def _projection(module: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(W as [out, in], bias) of a linear output projection (``nn.Linear``, GPT-2's ``Conv1D``, or a quantized
    layer, dequantized: `nncanon.quantization.dense_weight`)."""
    return dense_weight(module), module.bias


def check_probabilities(model: Any) -> list[CheckResult]:
    """Zeroing the last head's probabilities equals zeroing its output, on every layer serving both."""

    report = model.support()
    layers = [index for index in report.layers_with("attention_probabilities")
              if report.available("attention_head_outputs", layer=index)]
    names = ("attention_probabilities", "attention_head_outputs")
    # every layer's two zeroings in invokes of their own of one trace, with a clean one; where any fails (or the
    # batch raises), each layer alone, as its verdict
    together = guarded("probabilities", None, names, lambda: _all_probabilities(model, layers)) if layers else []
    held = {result.layer: result for result in together if result.passed and result.layer is not None}
    results = []
    clean: list = []  # the logits with no write: one run for every layer
    for index in layers:
        results += [held[index]] if index in held else guarded("probabilities", index, names, lambda index=index: [
            _probabilities(model, index, head_count(model, index) - 1, clean)])
    return results


def _all_probabilities(model: Any, layers: list[int]) -> list[CheckResult]:
    """`_probabilities` of every layer of ``layers`` in one trace: invoke 0 writes nothing, then each layer's last
    head is zeroed by its output in one invoke and by its probabilities in the next."""
    heads = {index: head_count(model, index) - 1 for index in layers}
    logits: dict = {}  # bound outside the trace, filled inside (by invoke: their bodies run in the forward's order)
    with torch.no_grad(), model.trace() as tracer:
        with tracer.invoke(PROMPTS[0]):
            logits["clean"] = model.logits.save()
        for index in layers:
            with tracer.invoke(PROMPTS[0]):
                model.layers[index].self_attn.attention_head_outputs[..., heads[index], :] = 0
                logits[index, "head"] = model.logits.save()
            with tracer.invoke(PROMPTS[0]):
                model.layers[index].self_attn.attention_probabilities[:, heads[index]] = 0
                logits[index, "probabilities"] = model.logits.save()
    return [_zeroed_both_ways(index, heads[index], logits[index, "head"], logits[index, "probabilities"],
                              logits["clean"], " (in invokes of their own)") for index in layers]


def _probabilities(model: Any, index: int, head: int, clean_run: list) -> CheckResult:
    with torch.no_grad(), model.trace(PROMPTS[0]):
        model.layers[index].self_attn.attention_head_outputs[..., head, :] = 0
        by_head = model.logits.save()
    with torch.no_grad(), model.trace(PROMPTS[0]):
        model.layers[index].self_attn.attention_probabilities[:, head] = 0
        by_probabilities = model.logits.save()
    if not clean_run:
        with torch.no_grad(), model.trace(PROMPTS[0]):
            clean_run.append(model.logits.save())
    return _zeroed_both_ways(index, head, by_head, by_probabilities, clean_run[0])


def _zeroed_both_ways(index: int, head: int, by_head: torch.Tensor, by_probabilities: torch.Tensor,
                      clean: torch.Tensor, how: str = "") -> CheckResult:
    """The logits with ``head`` zeroed by its probabilities against those with it zeroed by its output, which must
    differ from the ``clean`` logits."""
    result = compare("probabilities", index, ("attention_probabilities", "attention_head_outputs"),
                      by_probabilities, by_head, TOLERANCE, f"logits with head {head} zeroed both ways{how}")
    if torch.equal(by_head, clean):
        return CheckResult(result.check, index, result.values, False, result.error, TOLERANCE,
                           f"zeroing head {head} did not reach the logits")
    return result
