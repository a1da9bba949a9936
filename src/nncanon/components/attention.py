"""Softmax attention: the kernel's per-head inputs, its probabilities, per-head outputs and contribution."""

from __future__ import annotations

from typing import Any

import torch
from nnsight.intervention.envoy import Envoy
from nnsight.intervention.eproperty import WriteBack
from nnsight.intervention.interleaver import Mediator, OutOfOrderError

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
from ..order import note_read, translated
from ..served import _value, check_write, served
from ..traced import outside_trace, refuse_outside_trace
from .base import Component
from .kernel import (
    GRADIENT_WRITE_REASON,
    INTERFACE_KERNEL,
    has_sinks,
    implementation,
    probabilities_in_graph,
    recompute_both,
    scores_operation,
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
    - ``query_states_before_norm``, ``key_states_before_norm``: queries and keys before the norm a family applies
      to them (Qwen3, OLMo-2, Gemma-3...), sequence-first, ``[batch, seq, heads, head_dim]`` where the norm is per
      head, ``[batch, seq, heads·head_dim]`` where it norms the whole projection.
    - ``query_states``, ``key_states``, ``value_states`` ``[batch, seq, heads, head_dim]`` (key/value
      heads for keys and values): what the attention kernel receives, queries and keys after rotary
      (keys and values with the cache's earlier positions when generating).
    - ``attention_scores`` ``[batch, heads, query, key]``: what the softmax receives (scaled, soft-capped,
      masked; without a sink column); read under eager, recomputed beside the kernel under sdpa.
    - ``attention_probabilities`` ``[batch, heads, query, key]``: the probabilities that
      multiply the values; read under ``attn_implementation="eager"``, recomputed from the
      kernel's inputs under sdpa (its ``.grad`` exact there too; read it after the kernel's inputs).
    - ``attention_gate``: the multiplier an output-gated attention applies to the kernel's output (after its
      sigmoid or softplus), as the module applies it: ``[batch, seq, heads·head_dim]``, or ``[batch, seq, heads]``
      where it gates whole heads.
    - ``attention_head_outputs`` ``[batch, seq, heads, head_dim]``: each head's output before
      the output projection (the projection's input, viewed per head).
    - ``attention_output`` ``[batch, seq, hidden]``: exactly what attention adds to the
      residual stream (after any post-norm or scale the family applies).
    """

    role = "self_attn"
    standard_values = (
        "attention_norm_scale", "attention_normalized", "attention_input", "query_states_before_norm",
        "key_states_before_norm", "query_norm_scale", "key_norm_scale", "query_states", "key_states", "value_states",
        "attention_scores", "attention_probabilities", "attention_gate", "attention_head_outputs",
        "attention_post_norm_scale", "attention_output",
    )
    locals().update(norm_values("self_attn"))

    attention_input = served(
        "attention_input",
        "what the attention module receives: the normed stream [b, s, d]",
        "The attention module's input, ``[batch, seq, hidden]``: the stream after the block's norm, with the norm's "
        "weight (TransformerLens ``ln1.hook_normalized``, before the weight, is ``attention_normalized``). Writable: "
        "a write reaches the query, key and value projections.",
    )
    query_states_before_norm = served(
        "query_states_before_norm",
        "queries before their norm [b, s, H, head_dim] (per-head norm) or [b, s, H·head_dim]",
        "The queries before the norm the attention applies to them (the q-norm module's input), sequence-first: "
        "``[batch, seq, heads, head_dim]`` where the norm is per head (Qwen3, Gemma-3), ``[batch, seq, "
        "heads·head_dim]`` where it norms the whole projection (OLMo-2). Writable: a write reaches the norm.",
    )
    key_states_before_norm = served(
        "key_states_before_norm",
        "keys before their norm [b, s, KV, head_dim] (per-head norm) or [b, s, KV·head_dim]",
        "The keys before the norm the attention applies to them (the k-norm module's input), laid out as "
        "``query_states_before_norm`` with the key/value heads. Writable: a write reaches the norm.",
    )
    attention_gate = served(
        "attention_gate",
        "the output gate's multiplier [b, s, H·head_dim] (or [b, s, H]: one per head)",
        "The multiplier an output-gated attention applies to the kernel's output before the output projection "
        "(``attn_output * sigmoid(gate)``: Qwen3-Next, Qwen3.5; softplus: Laguna), after its activation, as the "
        "module applies it: ``[batch, seq, heads·head_dim]``, or ``[batch, seq, heads]`` where one number gates "
        "each head. Writable: ``[..., h] = 0`` (per-head) or a slice of ``head_dim`` zeroes a head's output.",
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
            return self._recomputed("attention_probabilities")
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
            raise _read_only(self._nncanon.where, "attention_probabilities")
        operation = self._probability_operation()
        check_write(value, operation.input, f"{self._nncanon.where}.attention_probabilities")
        operation.input = value.expand_as(operation.input)

    @property
    def attention_scores(self) -> torch.Tensor:
        """The attention scores, ``[batch, heads, query, key]``: exactly what the softmax receives.

        Scaled (``q·kᵀ·scale``), soft-capped where the family caps them (Gemma-2's ``tanh``), with any position
        bias (ALiBi) and the mask added: a masked entry holds what the family's mask makes it, the dtype's most
        negative number added to the score (about ``-3.4e38`` in fp32, finite) where the mask is additive, or
        the value the family fills masked positions with. Where a sink logit per head is concatenated as one more
        column before the softmax (gpt-oss's ``sinks``), the scores are served without it, and
        ``probabilities == softmax([scores, sink])[..., :-1]``; elsewhere ``probabilities == softmax(scores)``
        (computed in the family's softmax dtype, fp32).

        Under ``attn_implementation="eager"``: the tensor the softmax receives, writable (in place or by
        assignment), and the probabilities the kernel uses follow. Under sdpa: recomputed beside the kernel from
        its inputs by the family's own eager code (as ``attention_probabilities`` is); read-only, without a
        gradient.
        """
        self._nncanon_binding("attention_scores")
        label = f"{self._nncanon.where}.attention_scores"
        outside = outside_trace(self.root, label)
        if outside is not None:
            return outside
        if not self._eager():
            return self._recomputed("attention_scores")
        operation, listed = self._scores_operation()
        try:
            raw = operation.input[0] if listed else operation.input
        except OutOfOrderError as error:  # (read after a value the model computes later: named)
            binding = self._nncanon.bindings.get("attention_output")
            raise translated(error, Mediator.current("attention_scores"), label,
                             binding.order if binding is not None else "") from None
        scores = self._per_head(raw)
        if scores is not raw:  # the model is handed a view of the served tensor: its gradient reaches it
            operation.input = scores.flatten(0, 1)
        note_read(Mediator.current("attention_scores"), label)
        reason = self._nncanon_gradient_reason("attention_scores")
        if reason is not None:
            mark(scores, label)
            refuse_gradient(scores, reason)
        return scores

    @attention_scores.setter
    def attention_scores(self, value: Any) -> None:
        self._nncanon_binding("attention_scores")
        label = f"{self._nncanon.where}.attention_scores"
        refuse_outside_trace(self.root, f"{label} was written")
        if not self._eager():
            raise _read_only(self._nncanon.where, "attention_scores")
        operation, listed = self._scores_operation()
        current = operation.input
        scores = current[0] if listed else current
        served_as = self._per_head(scores)
        check_write(value, served_as, label)
        value = value.expand_as(served_as).reshape(scores.shape)
        operation.input = [value, *current[1:]] if listed else value

    def _per_head(self, scores: torch.Tensor) -> torch.Tensor:
        """Scores ``[b, heads, q, k]``: as the softmax receives them, or split out of the batch where the attention
        folds its heads into it, ``[b·heads, q, k]`` (XGLM), a view."""
        if scores.dim() != 3:
            return scores
        return scores.unflatten(0, (-1, self._nncanon.bindings["attention_head_outputs"].heads))

    def _scores_operation(self) -> tuple[Any, bool]:
        """The source operation whose input holds the scores (`nncanon.components.kernel.scores_operation`)."""
        try:
            return scores_operation(self.source, self._nncanon.probabilities, has_sinks(self._module))
        except ValueNotAvailable as error:
            raised = ValueNotAvailable(f"{self._nncanon.where}.attention_scores is not available: {error}")
            self.__dict__["_nncanon_raised"] = raised
            raise raised from None

    def _eager(self) -> bool:
        """Whether this attention runs eager: its own config's implementation (a multimodal model's text
        config may differ from the root's), else the root's."""
        return (implementation(self._module) or implementation(self.root._module)) == "eager"

    def _recomputed(self, name: str) -> torch.Tensor:
        """``name`` (the probabilities, or the scores) recomputed from the kernel call's inputs; read-only: an
        edit, in place or through any view (``.data``, a NumPy array), is refused when the worker moves on (it would
        change nothing in the model).

        They are served at the call's output, as eager's are served inside the kernel: the read runs the model on
        to the kernel's output (its inputs as every write before the read left them), so a kernel input of the same
        call read or written after them is out of order (`nncanon.order`), never a write the kernel sees and the
        probabilities do not. The scores and the probabilities are recomputed together, at the first read of
        either; the other is kept for a read of it at the same visit. Where the trace tracks gradients, the
        probabilities are computed without a graph and put into it at that output (`probabilities_in_graph`), which
        the model is handed back bit for bit, so that ``.grad`` is the exact gradient at the probabilities (the
        scores are served without a gradient).
        """
        binding = self._nncanon.bindings["query_states"]
        label = f"{self._nncanon.where}.{name}"
        if in_backward():
            raise first_read_in_backward(label)
        binding.prepare()
        mediator = Mediator.current(binding.location)
        output_at = binding.location.rpartition(".")[0] + ".output"
        after = mediator.wanted(output_at)
        waiting = mediator.transform
        if waiting is not None and waiting.key == (None, output_at, after):
            return waiting.view[name]  # read again: the model is at the kernel's output already
        raw = _value(binding, mediator, label)
        args, kwargs = raw
        kernel = self._nncanon.kernel or INTERFACE_KERNEL
        states = kernel.inputs(args, kwargs)
        graph = any(tracks(state) for state in states)
        try:
            with torch.no_grad():
                scores, probabilities = recompute_both(self._module, args, kwargs, kernel)
        except ValueNotAvailable as error:  # an AttributeError: Python hands the read to __getattr__, which
            self.__dict__["_nncanon_raised"] = error  # raises this one again (its reason, not "no attribute")
            raise
        where = self._nncanon.where
        used = implementation(self._module) or implementation(self.root._module)
        result = _value(binding, mediator, label, output_at)
        if graph:
            at_output = kernel.output
            probabilities, output = probabilities_in_graph(
                probabilities, result if at_output is None else result[at_output], states[2],
                heads_first=kernel.output_heads_first)
            result = output if at_output is None else (*result[:at_output], output, *result[at_output + 1:])
            refuse_gradient_write(probabilities, GRADIENT_WRITE_REASON.format(implementation=used))
        served_now = {"attention_scores": scores, "attention_probabilities": probabilities}
        kept = {each: tensor.detach().clone() for each, tensor in served_now.items()}

        def refuse_edits() -> Any:
            for each, tensor in served_now.items():
                if not same_bits(tensor, kept[each]):
                    raise _read_only(where, each)
            return result

        mediator.transform = WriteBack(refuse_edits, served_now, None, output_at, after)
        refuse_gradient(scores, SCORES_GRADIENT_REASON.format(implementation=used))
        mark(scores, f"{where}.attention_scores")
        mark(probabilities, f"{where}.attention_probabilities")
        return served_now[name]

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


def _read_only(where: str, name: str) -> InvalidWrite:
    what = "scores" if name == "attention_scores" else "probabilities"
    return InvalidWrite(
        f"{where}.{name} was written (by assignment, in place, or through a view such as .data), "
        f"but this model does not run eager attention: its "
        f"{what} are recomputed from the kernel's inputs, and a write to them would not reach the model. "
        f"Load it with StandardizedTransformer(..., attn_implementation=\"eager\") to write them."
    )


#: Why the scores recomputed beside the kernel have no gradient (`nncanon.gradients.refuse_gradient`).
SCORES_GRADIENT_REASON = (
    "the scores are recomputed beside the kernel under attn_implementation={implementation!r}, which computes "
    "no scores of its own for a gradient to reach. Load the model with "
    "StandardizedTransformer(..., attn_implementation=\"eager\") for attention_scores.grad."
)
