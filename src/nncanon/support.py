"""``model.support()``: which standard values each layer serves, and the reason where it does not."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from .components.layer import layer_index

#: Every standard value of a layer, in the order ``support()`` reports them.
LAYER_VALUES = (
    "layer_input",
    "layer_output",
    "self_attn",
    "attention_input",
    "query_states",
    "key_states",
    "value_states",
    "attention_probabilities",
    "attention_head_outputs",
    "attention_output",
    "linear_attn",
    "linear_attention_input",
    "linear_attention_head_outputs",
    "linear_attention_output",
    "mlp",
    "router_logits",
    "expert_weights",
    "expert_indices",
    "shared_expert_output",
    "pre_activations",
    "linear_activations",
    "neurons",
    "mlp_output",
)

#: The component each value is served on.
COMPONENT_OF = {
    "attention_input": "self_attn",
    "query_states": "self_attn",
    "key_states": "self_attn",
    "value_states": "self_attn",
    "attention_probabilities": "self_attn",
    "attention_head_outputs": "self_attn",
    "attention_output": "self_attn",
    "linear_attention_input": "linear_attn",
    "linear_attention_head_outputs": "linear_attn",
    "linear_attention_output": "linear_attn",
    "router_logits": "mlp",
    "expert_weights": "mlp",
    "expert_indices": "mlp",
    "shared_expert_output": "mlp",
    "pre_activations": "mlp",
    "linear_activations": "mlp",
    "neurons": "mlp",
    "mlp_output": "mlp",
}
COMPONENTS = ("self_attn", "linear_attn", "mlp")


_ANY_LAYER = re.compile(r"layers\[\d+\]")


def layer_states(layer: Any) -> dict[str, Any]:
    """The mounted states of block envoy ``layer``: ``"layer"`` and each of `COMPONENTS` (``None`` where
    the block has no such component)."""
    states = {"layer": layer.__dict__["_nncanon"]}
    for component in COMPONENTS:
        host = layer.__dict__.get(component)
        states[component] = None if host is None else host.__dict__.get("_nncanon")
    return states


def value_reason(states: dict[str, Any], value: str) -> str | None:
    """Why the block whose `layer_states` are ``states`` does not serve ``value`` (a name of
    `LAYER_VALUES`), or ``None`` when it serves it: ``support()``'s cell."""
    if value in ("layer_input", "layer_output"):
        return states["layer"].reason(value)
    if value in COMPONENTS:
        if states[value] is not None:
            return None
        return states["layer"].reason(value) or "this block has no such component"
    component = COMPONENT_OF[value]
    state = states[component]
    return value_reason(states, component) if state is None else state.reason(value)


def attached_lines(model: Any) -> list[str]:
    """What is attached to ``model`` beside its values, one line each: the one place the surface learns of the
    dictionaries `nncanon.sae.attach` keeps on the model (under ``model.__dict__["_nncanon_attached"]``)."""
    return [item.describe() for item in model.__dict__.get("_nncanon_attached", {}).values()]


@dataclass(frozen=True)
class LayerSupport:
    """One layer's row: its block type and, per value, ``None`` (served) or the reason it is not; per
    served value whose gradient is not served (its gradient check failed), the reason."""

    index: int
    block_type: str
    reasons: dict
    absent: frozenset = frozenset()
    gradient_reasons: dict = field(default_factory=dict)


class SupportReport:
    """The support table of a model. Built from the mounted family data; runs no forward.

    Example:
        >>> report = model.support()          # under sdpa, attention computed inline (Falcon before transformers 5.25)
        >>> report.available("attention_probabilities", layer=0)
        False
        >>> print(report.reason("attention_probabilities", layer=0))
        attention probabilities are not computed under attn_implementation='sdpa', and its attention ...
        >>> report.layers_with("self_attn")
        [0, 1, 2, ...]
    """

    def __init__(self, layers: list[LayerSupport], model_type: str, family: str, provenance: str = "",
                 model_declines: dict | None = None, cause: str | None = None,
                 attached: list[str] | None = None, batch: str | None = None) -> None:
        self.layers = layers
        self.model_type = model_type
        self.family = family
        #: Where the served values stand: proved on a twin of this config (when, which transformers),
        #: unproved (``verify="never"``), or tested on the registry variants only.
        self.provenance = provenance
        #: Model-level values (``logits``, ``project_on_vocab``, ``skip_layers``) not served, with the reason.
        self.model_declines = dict(model_declines or {})
        #: The one reason that declines every value, where there is one (no twin of the config runs):
        #: printed once, at the top; each value's reason (`reason`, `to_dict`) still says it in full.
        self.cause = cause
        #: What is attached to the model beside its values (a dictionary of `nncanon.sae`), one line each.
        self.attached = list(attached or [])
        #: Why the model does not compute the tokens of a batch independently (bitsandbytes LLM.int8's outlier
        #: columns: an edit at one token or in one invoke moves the others), ``None`` where it does.
        self.batch = batch

    @classmethod
    def of(cls, model: Any) -> SupportReport:
        """The report of a `StandardizedTransformer`."""
        rows = []
        for index, layer in enumerate(model.layers):
            states = layer_states(layer)
            reasons = {value: value_reason(states, value) for value in LAYER_VALUES}
            gradients: dict[str, str] = {}
            for value in LAYER_VALUES:
                owner = "layer" if value in ("layer_input", "layer_output") else COMPONENT_OF.get(value)
                state = states.get(owner) if reasons[value] is None else None
                refused = state.gradient_reason(value) if state is not None else None
                if refused is not None:
                    gradients[value] = refused
            absent = frozenset(name for state in states.values() if state is not None for name in state.absent)
            rows.append(LayerSupport(index, type(layer._module).__name__, reasons, absent, gradients))
        provenance = model.__dict__.get("_provenance")
        return cls(rows, model._text_config.model_type, model.family.name,
                   provenance.text if provenance is not None else "", model.__dict__.get("_model_declines"),
                   getattr(provenance, "cause", None), attached_lines(model),
                   model._batch_coupling() if hasattr(model, "_batch_coupling") else None)

    def _row(self, layer: int) -> LayerSupport:
        return self.layers[layer_index(layer, len(self.layers), "support()")]

    def _check(self, value: str) -> None:
        if value not in LAYER_VALUES:
            raise KeyError(f"{value!r} is not a standard value; the values are: {', '.join(LAYER_VALUES)}")

    def reason(self, value: str, layer: int) -> str | None:
        """Why ``value`` is not served on ``layer``, or ``None`` when it is."""
        self._check(value)
        return self._row(layer).reasons[value]

    def available(self, value: str, layer: int) -> bool:
        """Whether ``layer`` serves ``value``."""
        return self.reason(value, layer) is None

    def provenance_of(self, value: str, layer: int) -> str:
        """Where ``value`` on ``layer`` stands: the model's provenance where it is served (``proved on a
        twin of this config (transformers 5.24.0, ...)``, ``unproved: ...``), else ``declined: <reason>``."""
        reason = self.reason(value, layer)
        return self.provenance if reason is None else f"declined: {reason}"

    def gradient_reason(self, value: str, layer: int) -> str | None:
        """Why ``value.grad`` is not served on ``layer`` (the value is not, it has none, or its gradient
        check failed on the load-time proof), or ``None`` when it is."""
        reason = self.reason(value, layer)
        if reason is not None:
            return reason
        if value == "expert_indices":
            return "expert_indices are integers: they have no gradient"
        return self._row(layer).gradient_reasons.get(value)

    def gradient_provenance_of(self, value: str, layer: int) -> str:
        """Where ``value.grad`` on ``layer`` stands: the model's provenance where it is served (the
        gradient checks ran with the others), else ``declined: <reason>``."""
        reason = self.gradient_reason(value, layer)
        return self.provenance if reason is None else f"declined: {reason}"

    def layers_with(self, value: str) -> list[int]:
        """The layers that serve ``value``, e.g. ``report.layers_with("self_attn")``."""
        self._check(value)
        return [row.index for row in self.layers if row.reasons[value] is None]

    def declined(self, layer: int | None = None) -> list[str]:
        """The values a block's components have but that it does not serve (each with a reason).

        A component the block does not have (a Mamba block's ``self_attn``) declines nothing, nor does
        a value its component does not have (a dense MLP's routing, a mixer without heads). ``layer``
        ``None``: the values declined on any layer.
        """
        rows = self.layers if layer is None else [self._row(layer)]
        found = {
            value
            for row in rows
            for value, component in COMPONENT_OF.items()
            if row.reasons[component] is None and row.reasons[value] is not None and value not in row.absent
        }
        return [value for value in LAYER_VALUES if value in found]

    def to_dict(self) -> dict:
        """The report as plain data (for ``--json``)."""
        return {
            "model_type": self.model_type,
            "family": self.family,
            "provenance": self.provenance,
            "cause": self.cause,
            "model_declines": dict(self.model_declines),
            "attached": list(self.attached),
            "batch": self.batch,
            "layers": [
                {"layer": row.index, "block_type": row.block_type, "values": dict(row.reasons),
                 "gradients_declined": dict(row.gradient_reasons)}
                for row in self.layers
            ],
        }

    def __str__(self) -> str:
        """A table: one row per layer, one column per value served on some layer; reasons below. A value
        served without its gradient reads ``yes, no .grad [n]``."""
        columns = [v for v in LAYER_VALUES if any(row.reasons[v] is None for row in self.layers)]
        absent = [v for v in LAYER_VALUES if v not in columns]
        width = max([len("block"), *(len(row.block_type) for row in self.layers)])
        refused = {v for row in self.layers for v in row.gradient_reasons}
        widths = [max(len(v), 17 if v in refused else 6) for v in columns]
        by_cause = [name for name, reason in self.model_declines.items() if reason == self.cause]
        lines = [
            f"support of {self.model_type} (family {self.family})",
            *([f"values served: none, {self.cause.removeprefix('not proved: ')}"] if self.cause else
              [f"values served: {self.provenance}"] if self.provenance else []),
            *([f"batch tokens computed together: {self.batch}"] if self.batch else []),
            *([f"{', '.join(f'model.{name}' for name in by_cause)} not served: [*]"] if by_cause else []),
            *(f"model.{name} not served: {reason}" for name, reason in self.model_declines.items()
              if name not in by_cause),
            f"{'layer':>5}  {'block':<{width}}  "
            + "  ".join(f"{v:<{w}}" for v, w in zip(columns, widths, strict=True)),
        ]
        notes: dict[str, int | str] = {self.cause: "*"} if self.cause else {}
        numbered = 0 if self.cause is None else -1  # (the cause is no numbered note)
        for row in self.layers:
            cells = []
            for value, cell_width in zip(columns, widths, strict=True):
                reason = row.reasons[value]
                refusal = row.gradient_reasons.get(value)
                if reason is None and refusal is not None:
                    mark = notes.setdefault(f".grad not served: {refusal}", len(notes) + 1 + numbered)
                    cells.append(f"{'yes, no .grad [' + str(mark) + ']':<{cell_width}}")
                elif reason is None:
                    cells.append(f"{'yes':<{cell_width}}")
                else:
                    mark = notes.setdefault(reason, len(notes) + 1 + numbered)
                    cells.append(f"{'no [' + str(mark) + ']':<{cell_width}}")
            lines.append(f"{row.index:>5}  {row.block_type:<{width}}  " + "  ".join(cells))
        for reason, mark in notes.items():
            lines.append("[*] the cause above" if mark == "*" else f"[{mark}] {reason}")
        if absent:
            lines.append("not served on any layer:")
            grouped: dict[str, list[str]] = {}
            for value in absent:
                reasons = dict.fromkeys("[*]" if row.reasons[value] == self.cause else
                                        _ANY_LAYER.sub("layers[i]", row.reasons[value]) for row in self.layers)
                grouped.setdefault(" / ".join(reasons), []).append(value)
            for reason, values in grouped.items():
                lines.append(f"  {', '.join(values)}: {reason}")
        if self.attached:
            lines.append("attached:")
            lines.extend(f"  {line}" for line in self.attached)
        return "\n".join(lines)

    def __repr__(self) -> str:
        return str(self)
