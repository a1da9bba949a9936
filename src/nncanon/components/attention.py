"""Softmax attention: the kernel's per-head inputs, its probabilities, per-head outputs and contribution."""

from __future__ import annotations

from typing import Any

import torch
from nnsight.intervention.envoy import Envoy
from nnsight.intervention.eproperty import WriteBack
from nnsight.intervention.interleaver import Mediator

from ..errors import InvalidWrite, ValueNotAvailable
from ..gradients import (
    first_read_in_backward,
    in_backward,
    mark,
    refuse_gradient,
    refuse_gradient_write,
    same_bits,
    tracks,
)
from ..order import note_read
from ..served import _value, check_write, served
from ..traced import outside_trace, refuse_outside_trace
from .base import Component
from .kernel import (
    GRADIENT_WRITE_REASON,
    INTERFACE_KERNEL,
    implementation,
    probabilities_in_graph,
    recompute_probabilities,
)
from .norms import norm_values


class AttentionEnvoy(Component, Envoy):
    """A block's softmax attention: ``model.layers[i].self_attn``.

    Values, in the order the forward produces them:

    - ``attention_norm_scale`` ``[batch, seq, 1]`` and ``attention_normalized`` ``[batch, seq, hidden]``: the norm
      before attention, its denominator and its input normalised before its weight (`nncanon.components.norms`);
      ``query_norm_scale`` and ``key_norm_scale`` likewise for the query and key norms, ``attention_post_norm_scale``
      for a post-norm of attention's output.
    - ``attention_input`` ``[batch, seq, hidden]``: what the attention module receives (the stream after the
      block's norm, with the norm's weight).
    - ``query_states``, ``key_states``, ``value_states`` ``[batch, seq, heads, head_dim]`` (key/value
      heads for keys and values): what the attention kernel receives, queries and keys after rotary
      (keys and values with the cache's earlier positions when generating).
    - ``attention_probabilities`` ``[batch, heads, query, key]``: the probabilities that
      multiply the values; read under ``attn_implementation="eager"``, recomputed from the
      kernel's inputs under sdpa (its ``.grad`` exact there too; read it after the kernel's inputs).
    - ``attention_head_outputs`` ``[batch, seq, heads, head_dim]``: each head's output before
      the output projection (the projection's input, viewed per head).
    - ``attention_output`` ``[batch, seq, hidden]``: exactly what attention adds to the
      residual stream (after any post-norm or scale the family applies).
    """

    role = "self_attn"
    standard_values = (
        "attention_norm_scale", "attention_normalized", "attention_input", "query_norm_scale", "key_norm_scale",
        "query_states", "key_states", "value_states", "attention_probabilities", "attention_head_outputs",
        "attention_post_norm_scale", "attention_output",
    )
    locals().update(norm_values("self_attn"))

    attention_input = served(
        "attention_input",
        "what the attention module receives: the normed stream [b, s, d]",
        "The attention module's input, ``[batch, seq, hidden]``: the stream after the block's norm, with the norm's "
        "weight (TransformerLens ``ln1.hook_normalized`` before its weight is folded). Writable: a write reaches "
        "the query, key and value projections.",
    )
    query_states = served(
        "query_states",
        "per-head queries the attention kernel receives, after rotary [b, s, H, head_dim]",
        "The queries the attention kernel receives, ``[batch, seq, heads, head_dim]``, after rotary: the "
        "``query`` of transformers' attention interface, sequence-first (a view). Writable.",
    )
    key_states = served(
        "key_states",
        "per-head keys the attention kernel receives, after rotary [b, s, KV, head_dim]",
        "The keys the attention kernel receives, ``[batch, key, kv_heads, head_dim]``, after rotary and "
        "the cache (a generation step's keys include the cached positions). Writable.",
    )
    value_states = served(
        "value_states",
        "per-head values the attention kernel receives [b, s, KV, head_dim]",
        "The values the attention kernel receives, ``[batch, key, kv_heads, head_dim]`` (with the cache's "
        "positions when generating). Writable: ``[..., g, :] = 0`` silences the heads that share group ``g``.",
    )
    attention_head_outputs = served(
        "attention_head_outputs",
        "per-head outputs before the output projection [b, s, H, head_dim]",
        "Each head's output before the output projection, ``[batch, seq, heads, head_dim]``: the "
        "projection's input viewed per head. Zero ``[..., h, :]`` to ablate head ``h``. Writable.",
    )
    attention_output = served(
        "attention_output",
        "what attention adds to the residual stream [b, s, d]",
        "Exactly what attention adds to the residual stream, ``[batch, seq, hidden]``: "
        "``layer_input + attention_output + mlp_output == layer_output``. Writable.",
    )

    @property
    def attention_probabilities(self) -> torch.Tensor:
        """The attention probabilities, ``[batch, heads, query, key]``, as they multiply the values.

        Under ``attn_implementation="eager"``: the model's own tensor, writable in place
        (``[:, h] = 0`` removes head ``h``) or by assignment. Under sdpa: recomputed from the
        kernel's inputs for the layers read only (equal to eager's, proved per config); read-only.
        """
        self._nncanon_binding("attention_probabilities")
        outside = outside_trace(self.root, f"{self._nncanon.where}.attention_probabilities")
        if outside is not None:
            return outside
        if not self._eager():
            return self._recomputed()
        probabilities = self._probability_operation().input
        note_read(Mediator.current("attention_probabilities"), f"{self._nncanon.where}.attention_probabilities")
        reason = self._nncanon_gradient_reason("attention_probabilities")
        if reason is not None:  # (only then: the tensor is the model's own)
            mark(probabilities, f"{self._nncanon.where}.attention_probabilities")
            refuse_gradient(probabilities, reason)
        return probabilities

    @attention_probabilities.setter
    def attention_probabilities(self, value: Any) -> None:
        self._nncanon_binding("attention_probabilities")
        refuse_outside_trace(self.root, f"{self._nncanon.where}.attention_probabilities was written")
        if not self._eager():
            raise _read_only(self._nncanon.where)
        operation = self._probability_operation()
        check_write(value, operation.input, f"{self._nncanon.where}.attention_probabilities")
        operation.input = value.expand_as(operation.input)

    def _eager(self) -> bool:
        """Whether this attention runs eager: its own config's implementation (a multimodal model's text
        config may differ from the root's), else the root's."""
        return (implementation(self._module) or implementation(self.root._module)) == "eager"

    def _recomputed(self) -> torch.Tensor:
        """The probabilities recomputed from the kernel call's inputs; read-only: an edit, in place or through any
        view (``.data``, a NumPy array), is refused when the worker moves on (it would change nothing in the model).

        They are served at the call's output, as eager's are served inside the kernel: the read runs the model on
        to the kernel's output (its inputs as every write before the read left them), so a kernel input of the same
        call read or written after them is out of order (`nncanon.order`), never a write the kernel sees and the
        probabilities do not. Where the trace tracks gradients, they are computed without a graph and put into it
        at that output (`probabilities_in_graph`), which the model is handed back bit for bit, so that ``.grad``
        is the exact gradient at the probabilities.
        """
        binding = self._nncanon.bindings["query_states"]
        label = f"{self._nncanon.where}.attention_probabilities"
        if in_backward():
            raise first_read_in_backward(label)
        binding.prepare()
        mediator = Mediator.current(binding.location)
        output_at = binding.location.rpartition(".")[0] + ".output"
        after = mediator.wanted(output_at)
        waiting = mediator.transform
        if waiting is not None and waiting.key == (None, output_at, after):
            return waiting.view  # read again: the model is at the kernel's output already
        raw = _value(binding, mediator, label)
        args, kwargs = raw
        kernel = self._nncanon.kernel or INTERFACE_KERNEL
        states = kernel.inputs(args, kwargs)
        graph = any(tracks(state) for state in states)
        try:
            with torch.no_grad():
                probabilities = recompute_probabilities(self._module, args, kwargs, kernel)
        except ValueNotAvailable as error:  # an AttributeError: Python hands the read to __getattr__, which
            self.__dict__["_nncanon_raised"] = error  # raises this one again (its reason, not "no attribute")
            raise
        where = self._nncanon.where
        result = _value(binding, mediator, label, output_at)
        if graph:
            at_output = kernel.output
            probabilities, output = probabilities_in_graph(
                probabilities, result if at_output is None else result[at_output], states[2],
                heads_first=kernel.output_heads_first)
            result = output if at_output is None else (*result[:at_output], output, *result[at_output + 1:])
            refuse_gradient_write(probabilities, GRADIENT_WRITE_REASON.format(
                implementation=implementation(self._module) or implementation(self.root._module)))
        kept = probabilities.detach().clone()

        def refuse_edits() -> Any:
            if not same_bits(probabilities, kept):
                raise _read_only(where)
            return result

        mediator.transform = WriteBack(refuse_edits, probabilities, None, output_at, after)
        return mark(probabilities, label)

    def _probability_operation(self) -> Any:
        """The source operation whose first input is the probabilities."""
        path: tuple[str, ...] | None = self._nncanon.probabilities
        if path is not None:
            source = self.source
            for name in path[:-1]:
                source = getattr(source, name).source
            return getattr(source, path[-1])
        calls = [name for name in self.source.names if name.startswith("attention_interface_")]
        inner = getattr(self.source, calls[-1]).source
        products = [name for name in inner.names if name.startswith("torch_matmul_")]
        return getattr(inner, products[-1])


def _read_only(where: str) -> InvalidWrite:
    return InvalidWrite(
        f"{where}.attention_probabilities was written (by assignment, in place, or through a view such as .data), "
        f"but this model does not run eager attention: its "
        f"probabilities are recomputed from the kernel's inputs, and a write to them would not reach the model. "
        f"Load it with StandardizedTransformer(..., attn_implementation=\"eager\") to write them."
    )
