"""``model.support()``: which standard values each layer serves, and the reason where it does not."""

from __future__ import annotations

import re
import textwrap
from dataclasses import dataclass, field
from typing import Any

from .components.attention_gates import freezes_pattern
from .components.layer import layer_index
from .components.mixer_gates import mixer_reason
from .components.norms import NORM_VALUES  # noqa: F401 - every norm value of a block, for the tables' readers

#: Every standard value of a layer, in the order ``support()`` reports them.
LAYER_VALUES = (
    "layer_input",
    "layer_output",
    "self_attn",
    "attention_norm_scale",
    "attention_normalized",
    "attention_input",
    "query_states_before_norm",
    "key_states_before_norm",
    "query_norm_scale",
    "key_norm_scale",
    "query_states",
    "key_states",
    "value_states",
    "attention_scores",
    "attention_probabilities",
    "attention_gate",
    "attention_head_outputs",
    "attention_post_norm_scale",
    "attention_output",
    "linear_attn",
    "linear_attention_norm_scale",
    "linear_attention_normalized",
    "linear_attention_input",
    "linear_attention_head_outputs",
    "linear_attention_post_norm_scale",
    "linear_attention_output",
    "mlp",
    "mlp_norm_scale",
    "mlp_normalized",
    "router_logits",
    "expert_weights",
    "expert_indices",
    "shared_expert_output",
    "pre_activations",
    "linear_activations",
    "neurons",
    "mlp_post_norm_scale",
    "mlp_output",
)

#: The component each value is served on.
COMPONENT_OF = {
    "attention_norm_scale": "self_attn",
    "attention_normalized": "self_attn",
    "attention_input": "self_attn",
    "query_states_before_norm": "self_attn",
    "key_states_before_norm": "self_attn",
    "query_norm_scale": "self_attn",
    "key_norm_scale": "self_attn",
    "query_states": "self_attn",
    "key_states": "self_attn",
    "value_states": "self_attn",
    "attention_scores": "self_attn",
    "attention_probabilities": "self_attn",
    "attention_gate": "self_attn",
    "attention_head_outputs": "self_attn",
    "attention_post_norm_scale": "self_attn",
    "attention_output": "self_attn",
    "linear_attention_norm_scale": "linear_attn",
    "linear_attention_normalized": "linear_attn",
    "linear_attention_input": "linear_attn",
    "linear_attention_head_outputs": "linear_attn",
    "linear_attention_post_norm_scale": "linear_attn",
    "linear_attention_output": "linear_attn",
    "mlp_norm_scale": "mlp",
    "mlp_normalized": "mlp",
    "router_logits": "mlp",
    "expert_weights": "mlp",
    "expert_indices": "mlp",
    "shared_expert_output": "mlp",
    "pre_activations": "mlp",
    "linear_activations": "mlp",
    "neurons": "mlp",
    "mlp_post_norm_scale": "mlp",
    "mlp_output": "mlp",
}
COMPONENTS = ("self_attn", "linear_attn", "mlp")

#: The values inside a block that are neither the stream nor a contribution to it: what the token mixers receive,
#: queries and keys before their norms, an attention's output gate, and the MLP's neurons.
INNER_VALUES = ("attention_input", "linear_attention_input", "query_states_before_norm", "key_states_before_norm",
                "attention_gate", "pre_activations", "linear_activations", "neurons")


#: The model-level values, in the order ``support()`` reports them (each served once per model, not per layer).
MODEL_VALUES = ("token_embeddings", "position_embeddings", "final_norm_scale", "final_normalized", "final_norm_output",
                "logits", "next_token_probs", "project_on_vocab", "skip_layers")

_ANY_LAYER = re.compile(r"layers\[\d+\]")

#: The column headings of ``print(model.support())``: short names, each spelled out in the table's legend.
SHORT = {
    "layer_input": "layer_input", "layer_output": "layer_output", "self_attn": "attn", "attention_input": "attn_in",
    "query_states": "q", "key_states": "k", "value_states": "v", "attention_probabilities": "probs",
    "query_states_before_norm": "q_in", "key_states_before_norm": "k_in", "attention_scores": "scores",
    "attention_gate": "gate",
    "attention_head_outputs": "heads", "attention_output": "attn_out", "linear_attn": "mixer",
    "linear_attention_input": "mixer_in", "linear_attention_head_outputs": "mixer_heads",
    "linear_attention_output": "mixer_out", "mlp": "mlp", "router_logits": "router", "expert_weights": "weights",
    "expert_indices": "experts", "shared_expert_output": "shared", "pre_activations": "pre",
    "linear_activations": "linear", "neurons": "neurons", "mlp_output": "mlp_out",
    "attention_norm_scale": "ln1", "attention_normalized": "ln1_n", "query_norm_scale": "qn", "key_norm_scale": "kn",
    "attention_post_norm_scale": "ln1p", "linear_attention_norm_scale": "mix_ln",
    "linear_attention_normalized": "mix_n", "linear_attention_post_norm_scale": "mix_lnp",
    "mlp_norm_scale": "ln2", "mlp_normalized": "ln2_n",
    "mlp_post_norm_scale": "ln2p",
}

#: The width ``print(model.support())`` keeps to.
WIDTH = 120


def _wrapped(text: str, indent: str = "  ") -> list[str]:
    """``text`` as lines of at most `WIDTH` characters, the later ones indented."""
    return textwrap.wrap(text, WIDTH, subsequent_indent=indent, break_on_hyphens=False) or [text]


def _follows(rows: list, value: str, component: str) -> bool:
    """Whether ``value`` is served, with its gradient, on exactly the layers that have ``component``."""
    return all((row.reasons[value] is None) == (row.reasons[component] is None) and value not in row.gradient_reasons
               for row in rows)


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


#: Where `nncanon.graphs` keeps its linearity proof's verdict on a model (in the model's ``__dict__``: ``None``
#: where it held, else the reason), read by `graphs_line`; `UNPROVED` until the proof runs.
GRAPH_PROOF, UNPROVED = "_nncanon_graph_proof", "<not yet run>"


#: The end of a block's ``mlp`` reason where the block has no MLP at all (`nncanon.mounting`).
NO_MLP = "it has no MLP"


def has_mlp(row: LayerSupport) -> bool:
    """Whether ``row``'s block has an MLP that runs (a block of a hybrid may have none: Nemotron-H's, Zamba's Mamba
    blocks; a block the model does not run, `LayerSupport.runs`, runs none)."""
    return row.runs and not (row.reasons.get("mlp") or "").endswith(NO_MLP)


def graph_reason(report: SupportReport, attn_implementation: str | None) -> str | None:
    """Why the model's structure allows no attribution graph (`nncanon.graphs`), or ``None``: every block's token
    mixer must be linear in the stream once its pattern, gate and norms' scales are frozen values (softmax attention
    with served probabilities under eager, with the kernel's served query and key under sdpa: `_pattern_reason`; a
    linear mixer whose data-dependent gates are frozen, `nncanon.components.mixer_gates`), and each block with an MLP
    must serve ``mlp_output`` or its MLP module (whose output a transcoder then writes: the block need not be
    additive, its edges are gradients through the frozen model) for a transcoder to write; some block must have
    one. A block without an MLP has no transcoder; a block the model does not run (`LayerSupport.runs`) has no steps
    at all."""
    if not any(has_mlp(row) for row in report.layers):
        return f"no block has an MLP for a transcoder ({report.layers[0].reasons['mlp']})"
    for row in report.layers:
        layer = row.index
        if not row.runs:  # (the stream passes it: nothing to freeze, no transcoder)
            continue
        if has_mlp(row) and row.reasons["mlp_output"] is not None and row.reasons["mlp"] is not None:
            return f"layers[{layer}] serves no mlp_output for a transcoder to write: {row.reasons['mlp_output']}"
        if row.mixer is not None and mixer_reason(row.mixer) is not None:  # (served contribution or not)
            return f"layers[{layer}]: {mixer_reason(row.mixer)}"
        if row.mixer is not None and row.reasons["linear_attention_input"] is not None:
            return (f"layers[{layer}]'s linear mixer ({row.mixer}) serves no linear_attention_input, where its gates "
                    f"are frozen: {row.reasons['linear_attention_input']}")
        pattern = _pattern_reason(row, attn_implementation) if row.attention is not None else None
        if pattern is not None:
            return f"layers[{layer}]{pattern}"
    if report.model_declines.get("final_norm_scale") and not report.final_norm_at_head:
        return ("the final norm's scale is not served, so it cannot be frozen: "
                f"{report.model_declines['final_norm_scale']}")
    if (attn_implementation or "eager") not in PATTERN_KERNELS and report.layers_with("attention_output"):
        return (f"attention runs {attn_implementation!r}, whose pattern is not proved a function of the kernel's "
                "query and key alone, so freezing them would not freeze it: load the model with "
                "attn_implementation=\"eager\" or \"sdpa\"")
    return None


#: The attention implementations a graph freezes the pattern under: eager (the probabilities written back) and
#: sdpa (the kernel's query and key written back: `nncanon.graphs.replacement.PATTERN_INPUTS`).
PATTERN_KERNELS = ("eager", "sdpa")


def _pattern_reason(row: LayerSupport, attn_implementation: str | None) -> str | None:
    """Why the attention pattern of ``row``'s block cannot be frozen (the text after ``layers[i]``), or ``None``.

    Under eager the probabilities are written back: they must be served. Under sdpa the kernel's query and key are
    (served writable, `query_states`/`key_states`), and the probabilities recomputed from the same call must be
    served: their check proves, per config, that they multiply the values to the kernel's own output, so the
    kernel's pattern is a function of its query and key and the call's mask and bias arguments (a mask made from
    the stream, Doge's, is left to the linearity proof). An attention whose frozen values freeze its pattern
    (`nncanon.components.attention_gates.freezes_pattern`: DiffLlama's two kernel calls) needs none of them."""
    if freezes_pattern(row.attention):
        return None
    reason = row.reasons["attention_probabilities"]
    if (attn_implementation or "eager") == "eager":
        return None if reason is None else (
            f"'s attention probabilities are not served, so its pattern cannot be frozen: {reason}")
    if reason is not None:
        return (f"'s attention probabilities are not served under {attn_implementation!r}, so its kernel's pattern "
                f"is not proved a function of its query and key: {reason}")
    for name in ("query_states", "key_states"):
        if row.reasons[name] is not None:
            return (f"'s attention kernel does not serve {name}, so its pattern cannot be frozen under "
                    f"{attn_implementation!r} (load the model with attn_implementation=\"eager\"): {row.reasons[name]}")
    return None


def graphs_line(report: SupportReport, attn_implementation: str | None, proof: str | None) -> str:
    """``support()``'s line on attribution graphs: declined by structure (`graph_reason`) or by the linearity proof,
    proved, or not yet proved (`nncanon.graphs.support` runs the proof)."""
    reason = graph_reason(report, attn_implementation)
    if reason is not None:
        return f"no, {reason}"
    if proof == UNPROVED:
        return "the structure allows them; the linearity proof runs at first use (nncanon.graphs.support(model))"
    if proof is None:
        return "yes (the frozen replacement model was proved affine in its sources on this model)"
    return f"no, {proof}"


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
    mixer: str | None = None  # the linear mixer's class, where the block has one
    attention: str | None = None  # the softmax attention's class, where the block has one
    runs: bool = True  # False: the model does not run the block (`nncanon.families.base.Family.idle`)


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
                 attached: list[str] | None = None, batch: str | None = None,
                 model_gradient_declines: dict | None = None, model_absent: dict | None = None,
                 graphs: str | None = None) -> None:
        self.layers = layers
        self.model_type = model_type
        self.family = family
        #: Where the served values stand: proved on a twin of this config (when, which transformers),
        #: unproved (``verify="never"``), or tested on the registry variants only.
        self.provenance = provenance
        #: Model-level values (``logits``, ``project_on_vocab``, ``skip_layers``) not served, with the reason.
        self.model_declines = dict(model_declines or {})
        #: Model-level values the model has not at all (no position embeddings on a rotary model), with the reason.
        self.model_absent = dict(model_absent or {})
        #: Model-level values served whose gradient (``.grad``) is not (its gradient check failed), with the reason.
        self.model_gradient_declines = dict(model_gradient_declines or {})
        #: The one reason that declines every value, where there is one (no twin of the config runs):
        #: printed once, at the top; each value's reason (`reason`, `to_dict`) still says it in full.
        self.cause = cause
        #: What is attached to the model beside its values (a dictionary of `nncanon.sae`), one line each.
        self.attached = list(attached or [])
        #: Whether the final norm's last call reads the last block's output and feeds the head (`Family.final_norm`
        #: ``"lm_head"``, nothing between: nanochat's norm, run on the embeddings too), so an attribution graph
        #: freezes its scale there (`nncanon.graphs.head`) though ``final_norm_scale`` is not served.
        self.final_norm_at_head = False
        #: Whether attribution graphs (`nncanon.graphs`) can be built on the model, and why not: one line.
        self.graphs = graphs
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
            mixer = layer.__dict__.get("linear_attn") if states.get("linear_attn") is not None else None
            attention = layer.__dict__.get("self_attn") if states.get("self_attn") is not None else None
            rows.append(LayerSupport(index, type(layer._module).__name__, reasons, absent, gradients,
                                     type(mixer._module).__name__ if mixer is not None else None,
                                     type(attention._module).__name__ if attention is not None else None,
                                     model.family.idle_reason(model._text_config, index) is None))
        provenance = model.__dict__.get("_provenance")
        report = cls(rows, model._text_config.model_type, model.family.name,
                     provenance.text if provenance is not None else "", model.__dict__.get("_model_declines"),
                     getattr(provenance, "cause", None), attached_lines(model),
                     model._batch_coupling() if hasattr(model, "_batch_coupling") else None,
                     model.__dict__.get("_model_gradient_declines"), model.__dict__.get("_model_absent"))
        report.final_norm_at_head = model.family.final_norm == "lm_head" and not model.family.before_head
        report.graphs = graphs_line(report, getattr(model.config, "_attn_implementation", "eager"),
                                    model.__dict__.get(GRAPH_PROOF, UNPROVED))
        return report

    def _row(self, layer: int) -> LayerSupport:
        return self.layers[layer_index(layer, len(self.layers), "support()")]

    def _check(self, value: str) -> None:
        if value not in LAYER_VALUES:
            raise KeyError(f"{value!r} is not a standard value; the values are: {', '.join(LAYER_VALUES)}; the "
                           f"model-level values (asked without a layer): {', '.join(MODEL_VALUES)}")

    def reason(self, value: str, layer: int | None = None) -> str | None:
        """Why ``value`` is not served on ``layer`` (a model-level value of `MODEL_VALUES`: without a layer), or
        ``None`` when it is."""
        if layer is None and value in MODEL_VALUES:
            return self.model_declines.get(value) or self.model_absent.get(value)
        self._check(value)
        if layer is None:
            raise TypeError(f"support().reason({value!r}) needs a layer: {value} is a value of each layer")
        return self._row(layer).reasons[value]

    def available(self, value: str, layer: int | None = None) -> bool:
        """Whether ``layer`` serves ``value`` (a model-level value: whether the model does)."""
        return self.reason(value, layer) is None

    def model_values(self) -> dict[str, str | None]:
        """Each model-level value (`MODEL_VALUES`): ``None`` where it is served, else the reason it is not."""
        return {value: self.reason(value) for value in MODEL_VALUES}

    def provenance_of(self, value: str, layer: int) -> str:
        """Where ``value`` on ``layer`` stands: the model's provenance where it is served (``proved on a
        twin of this config (transformers 5.24.0, ...)``, ``unproved: ...``), else ``declined: <reason>``."""
        reason = self.reason(value, layer)
        return self.provenance if reason is None else f"declined: {reason}"

    def gradient_reason(self, value: str, layer: int | None = None) -> str | None:
        """Why ``value.grad`` is not served on ``layer`` (the value is not, it has none, or its gradient
        check failed on the load-time proof), or ``None`` when it is."""
        reason = self.reason(value, layer)
        if reason is not None:
            return reason
        if layer is None:
            return self.model_gradient_declines.get(value)
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
            "model_values": self.model_values(),
            "model_absent": dict(self.model_absent),
            "model_gradients_declined": dict(self.model_gradient_declines),
            "attached": list(self.attached),
            "batch": self.batch,
            "graphs": self.graphs,
            "layers": [
                {"layer": row.index, "block_type": row.block_type, "values": dict(row.reasons),
                 "gradients_declined": dict(row.gradient_reasons)}
                for row in self.layers
            ],
        }

    def __str__(self) -> str:
        """A table that fits a 120-column terminal: values served on every layer are listed once above it; a
        value served exactly where its component is folds into the component's column; one row per run of
        layers whose cells are the same, one column per value left; reasons below. A value served without
        its gradient reads ``yes, no .grad [n]``."""
        shown = [v for v in LAYER_VALUES if any(row.reasons[v] is None for row in self.layers)]
        absent = [v for v in LAYER_VALUES if v not in shown]
        everywhere = [v for v in shown if all(row.reasons[v] is None and v not in row.gradient_reasons
                                              for row in self.layers)]
        folded = {component: [v for v in shown if COMPONENT_OF.get(v) == component and v not in everywhere
                              and _follows(self.layers, v, component)] for component in COMPONENTS}
        hidden = {*everywhere, *(v for values in folded.values() for v in values)}
        columns = [v for v in shown if v not in hidden]
        by_cause = [name for name, reason in self.model_declines.items() if reason == self.cause]
        head = [
            f"support of {self.model_type} (family {self.family})",
            *([f"values served: none, {self.cause.removeprefix('not proved: ')}"] if self.cause else
              [f"values served: {self.provenance}"] if self.provenance else []),
            *([f"batch tokens computed together: {self.batch}"] if self.batch else []),
            *([f"{', '.join(f'model.{name}' for name in by_cause)} not served: [*]"] if by_cause else []),
            *(f"model.{name} not served: {reason}" for name, reason in self.model_declines.items()
              if name not in by_cause),
        ]
        served = [name for name, reason in self.model_values().items() if reason is None]
        head += [f"model values served: {', '.join(served)}"] if served else []
        head += [f"model.{name}: none, {reason}" for name, reason in self.model_absent.items()]
        head += [f"model.{name} served, its .grad not: {reason}"
                 for name, reason in self.model_gradient_declines.items()]
        graphs = self.graphs.replace(self.cause, "[*]") if self.graphs and self.cause else self.graphs
        head += [f"attribution graphs: {graphs}"] if graphs else []
        lines = [line for text in head for line in _wrapped(text)]
        if everywhere:
            lines += _wrapped("served on every layer: " + ", ".join(everywhere))
        for component, values in folded.items():
            if values:
                lines += _wrapped(f"served wherever {SHORT[component]} is: " + ", ".join(values))
        notes: dict[str, int | str] = {self.cause: "*"} if self.cause else {}
        numbered = 0 if self.cause is None else -1  # (the cause is no numbered note)
        rows: list[tuple[str, str, list[str]]] = []
        for row in self.layers:
            cells = []
            for value in columns:
                reason = row.reasons[value]
                refusal = row.gradient_reasons.get(value)
                # (one note for a reason that differs from layer to layer by the layer's index alone)
                if reason is None and refusal is not None:
                    note = _ANY_LAYER.sub("layers[i]", f".grad not served: {refusal}")
                    cells.append(f"yes, no .grad [{notes.setdefault(note, len(notes) + 1 + numbered)}]")
                elif reason is None:
                    cells.append("yes")
                else:
                    note = reason if reason == self.cause else _ANY_LAYER.sub("layers[i]", reason)
                    cells.append(f"no [{notes.setdefault(note, len(notes) + 1 + numbered)}]")
            last = rows[-1] if rows else None
            if last is not None and last[1] == row.block_type and last[2] == cells and last[0][1] == row.index - 1:
                rows[-1] = ((last[0][0], row.index), row.block_type, cells)
            else:
                rows.append(((row.index, row.index), row.block_type, cells))
        if columns:
            lines += _wrapped("columns: " + ", ".join(f"{SHORT[v]} = {v}" for v in columns if SHORT[v] != v))
            spans = [f"{a}" if a == b else f"{a}-{b}" for (a, b), _, _ in rows]
            first = max(len("layers"), *(len(span) for span in spans))
            width = max([len("block"), *(len(block) for _, block, _ in rows)])
            widths = [max(len(SHORT[v]), *(len(cells[i]) for _, _, cells in rows)) for i, v in enumerate(columns)]
            lines.append(f"{'layers':>{first}}  {'block':<{width}}  "
                         + "  ".join(f"{SHORT[v]:<{w}}" for v, w in zip(columns, widths, strict=True)))
            for span, (_, block, cells) in zip(spans, rows, strict=True):
                lines.append(f"{span:>{first}}  {block:<{width}}  "
                             + "  ".join(f"{c:<{w}}" for c, w in zip(cells, widths, strict=True)))
        for reason, mark in notes.items():
            lines += ["[*] the cause above"] if mark == "*" else _wrapped(f"[{mark}] {reason}")
        if absent:
            lines.append("not served on any layer:")
            grouped: dict[str, list[str]] = {}
            for value in absent:
                reasons = dict.fromkeys("[*]" if row.reasons[value] == self.cause else
                                        _ANY_LAYER.sub("layers[i]", row.reasons[value]) for row in self.layers)
                grouped.setdefault(" / ".join(reasons), []).append(value)
            for reason, values in grouped.items():
                lines += _wrapped(f"  {', '.join(values)}: {reason}", indent="    ")
        if self.attached:
            lines.append("attached:")
            lines.extend(f"  {line}" for line in self.attached)
        return "\n".join(lines)

    def __repr__(self) -> str:
        return str(self)
