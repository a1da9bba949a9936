"""Reading a point of the model inside a trace, and handing it back changed: what a dictionary is served through.

`open_point` reads a `nncanon.sae.names.Point` the way nncanon serves its values (the family's site, this
invoke's rows, the write-back a scaled or copied value needs) and returns a `PointRead`: the value ``x`` and the
two things the model can be handed back at the point's location: `PointRead.keep` (what it computed, exactly as a
plain read hands it back) and `PointRead.apply` (the value changed to a new one, written back as an assignment to
the standard value is: only the elements that changed, on a scaled site). A derived point reads several sites:
``resid_mid`` is ``layer_input`` plus the token mixer's contribution, changed through the contribution; a head of a
per-head value is changed within its head.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from nnsight.intervention.eproperty import WriteBack
from nnsight.intervention.interleaver import Mediator

from ..components.norms import NORM_VALUES, NormRead, read_norm, write_back
from ..errors import DictionaryMismatch, InvalidWrite
from ..gradients import first_read_in_backward, in_backward, mark, refuse_gradient
from ..reading import host, in_execution_order
from ..reading import read as read_value
from ..served import Binding, Site, read_site
from ..tools.heads import projection_input, projection_weights
from ..traced import outside_trace
from .names import Point, mixers, mlp_returns, resolve


@dataclass
class PointRead:
    """One read of a point in one invoke at one visit of the model.

    Attributes:
        x: The point's value (``[b, s, ...]``; one head's ``[b, s, head_dim]`` where the point names a head).
        location: The nnsight location the model is paused at (where ``keep``/``apply`` are handed back).
        occurrence: Which visit of ``location`` (a generation step).
        mediator: The invoke's mediator.
        graph: Whether the trace tracks gradients through the value.
    """

    x: torch.Tensor
    location: str
    occurrence: int
    mediator: Any
    graph: bool
    _binding: Binding
    _raw: Any
    _view: torch.Tensor
    _hand_back: bool
    _head: int | None = None
    _mid: bool = False  # resid_mid: x is layer_input plus the contribution ``_view``, changed through it

    _after: torch.Tensor | None = None  # the site's value as last handed back (for a later read to take over)

    def keep(self) -> Any:
        """The raw value to hand the model when nothing changed: what a plain read of the value hands back."""
        self._after = self._view
        if self._hand_back:
            return self._binding.write_back(self._view, self._raw, self.mediator, self.graph)
        return self._raw

    def shift(self, delta: torch.Tensor) -> Any:
        """The raw value to hand the model so that the point's value moves by ``delta`` (``x``'s shape)."""
        if self._mid:
            return self._handed(self._view + delta)
        return self.apply(self.x + delta)

    def apply(self, new: torch.Tensor) -> Any:
        """The raw value to hand the model so that the point's value becomes ``new`` (``x``'s shape, dtype, device)."""
        if self._mid:
            return self._handed(self._view + (new - self.x))
        if self._head is not None:
            whole = self._view.clone()
            whole[..., self._head, :] = new
            new = whole
        return self._handed(new)

    def _handed(self, view: torch.Tensor) -> Any:
        self._after = view
        return self._binding.write_back(view, self._raw, self.mediator, self.graph)


@dataclass
class NormPointRead(PointRead):
    """A read of a norm's normalised value (``mlp_normalized``...: TransformerLens's ``hook_normalized``), at the
    norm's output: handed back as the norm's output, ``x · (offset + weight) (+ bias)`` where ``x`` changed
    (`nncanon.components.norms.write_back`), the norm's own output bit for bit where nothing did."""

    _norm: NormRead | None = None
    _label: str = ""

    def keep(self) -> Any:
        self._after = self._view
        return write_back(self._binding.site, self._norm, self._raw, self._label)

    def _handed(self, view: torch.Tensor) -> Any:
        self._after = view
        return write_back(self._binding.site, self._norm, self._raw, self._label, view)


def _open_norm(model: Any, point: Point, label: str) -> NormPointRead:
    """Read norm value ``point.value`` of block ``point.layer`` (a ``*_normalized``; a scale is refused)."""
    if not point.value.endswith("_normalized"):
        raise DictionaryMismatch(f"{label}: {point.value} is a norm's scale [b, s, 1], not a value per token a "
                                 "dictionary reads")
    if in_backward():
        raise first_read_in_backward(label)
    binding = host(model, point.layer, point.value)._nncanon_norm(point.value)
    mediator = Mediator.current(binding.site.location)
    occurrence = mediator.wanted(binding.site.location)
    norm, raw = read_norm(binding.site, mediator, label)
    return NormPointRead(norm.normalized, binding.site.location, occurrence, mediator, norm.graph, binding, raw,
                         norm.normalized, True, _norm=norm, _label=label)


def binding_of(model: Any, layer: int, value: str) -> Binding:
    """The `Binding` of a standard value of block ``layer`` (raising `ValueNotAvailable` with the reason where it
    is declined), or, for ``mlp_input`` and ``mlp_module_output``, one made for the MLP module's first input and its
    output (the first element where it returns a tuple)."""
    if value in ("mlp_input", "mlp_module_output"):
        mlp = model.layers[layer].mlp
        if not hasattr(mlp, "_module"):  # (run inline, OPT's: its up projection's input, its down projection's output)
            return _inline_binding(model, layer, value)
        key, site = ("input", _MLP_INPUT) if value == "mlp_input" else ("output", _MLP_OUTPUT)
        if value == "mlp_module_output" and mlp_returns(model, layer) == "tuple":  # (RWKV's, ZAYA's: state after it)
            site = _MLP_OUTPUT_FIRST
        return Binding(value, f"{mlp.path}.{key}", site, model._text_config, f"layers[{layer}].mlp")
    component = host(model, layer, value)
    binding = component._nncanon_binding(value)
    return binding


def _inline_binding(model: Any, layer: int, value: str) -> Binding:
    """The `Binding` of ``mlp_input`` or ``mlp_module_output`` of block ``layer``'s MLP run inline (no module of its
    own: OPT's ``fc1``/``fc2`` on the block): the input of its projection to the pre-activations, the output of its
    down projection (`nncanon.families.MLPAnatomy`, relative to the block; ``[b, s, d]``, unflattened where the
    projections run on ``(b·s, d)``)."""
    anatomy = model.layers[layer].mlp._nncanon.anatomy
    path, key = (anatomy.pre, "input") if value == "mlp_input" else (anatomy.down, "output")
    return Binding(value, f"{model.layers[layer].path}.{path}.{key}", Site(key=key, flat=anatomy.flat),
                   model._text_config, f"layers[{layer}].mlp")


_MLP_INPUT = Site(key="input")
_MLP_OUTPUT = Site(key="output")
_MLP_OUTPUT_FIRST = Site(key="output", index=0)


def _read(binding: Binding, label: str) -> tuple[Any, torch.Tensor, bool, bool, Any, int]:
    if in_backward():
        raise first_read_in_backward(label)
    if binding.prepare is not None:
        binding.prepare()
    mediator = Mediator.current(binding.location)
    occurrence = mediator.wanted(binding.location)
    waiting = mediator.transform
    if waiting is not None and waiting.location == binding.location and waiting.occurrence == occurrence:
        taken = _take_over(waiting, binding)
        if taken is not None:  # read at this visit already: continue from what that read hands back
            mediator.transform = None
            raw, view, graph = taken
            return raw, view, graph, True, mediator, occurrence
    raw, view, graph, hand_back = read_site(binding, mediator, label)
    return raw, view, graph, hand_back, mediator, occurrence


def _take_over(waiting: Any, binding: Binding) -> tuple[Any, torch.Tensor, bool] | None:
    """``(raw, view, graph)`` of a read of ``binding`` this invoke made at this visit and has not handed back (a
    served value's write-back, a dictionary's splice, a `value_at`), with its change applied; ``None`` where the
    pending write-back is another value's (it is then handed back, and the site read again).

    The model cannot be asked for a site twice where reading it reads an earlier operation (a hyper-connection's
    weighted sum), nor for ``resid_mid``'s ``layer_input`` once past it: a second read continues from the first.
    """
    fn = waiting.fn
    if isinstance(fn, partial) and getattr(fn.func, "__self__", None) is binding:  # a served value's write-back
        view, raw, _, graph = fn.args
        return raw, view, graph
    owner = getattr(fn, "__self__", None)
    take_over = getattr(owner, "take_over", None)
    if take_over is None:
        return None
    read = take_over()
    if read is None or read._binding is not binding:
        return None
    return read._raw, read._after, read.graph


def open_point(model: Any, point: Point, label: str | None = None) -> PointRead:
    """Read ``point`` inside a trace (this invoke's rows, this visit); see `PointRead`.

    Reading a point is reading the sites it is made of in the forward's order: a site read earlier is handed back
    (as a plain read would be) before the next is read.
    """
    label = label or point.label
    if point.value in NORM_VALUES:
        return _open_norm(model, point, label)
    if point.value != "resid_mid":
        binding = binding_of(model, point.layer, point.value)
        raw, view, graph, hand_back, mediator, occurrence = _read(binding, label)
        x = view if point.head is None else view[..., point.head, :]
        return PointRead(x, binding.location, occurrence, mediator, graph, binding, raw, view, hand_back, point.head)
    names = list(point.parts) or ["layer_input", *mixers(model, point.layer)]
    last = binding_of(model, point.layer, names[-1])
    if last.prepare is not None:
        last.prepare()
    mediator = Mediator.current(last.location)
    # The stream before the last contribution, kept for this visit: a second read of the point in the same visit
    # (the features after value_at, two dictionaries there) finds it, where the model has run past layer_input.
    kept = mediator.__dict__.setdefault("_nncanon_resid_mid", {})
    key = (point.layer, last.location)
    hit = kept.get(key)
    total = None
    if hit is not None and hit[0] == mediator.wanted(last.location):
        total, names = hit[1].clone(), names[-1:]
    for index, name in enumerate(names):
        binding = binding_of(model, point.layer, name)
        if index == len(names) - 1 and total is not None:
            kept[key] = (mediator.wanted(binding.location), total.detach().clone())
        raw, view, graph, hand_back, mediator, occurrence = _read(binding, label)
        total = view.clone() if total is None else total + view
        if index < len(names) - 1 and hand_back:  # handed back as a plain read would be, when the worker moves on
            mediator.transform = WriteBack(partial(binding.write_back, view, raw, mediator, graph), view, None,
                                           binding.location, occurrence)
    return PointRead(total, binding.location, occurrence, mediator, graph, binding, raw, view, hand_back, _mid=True)


def keep_stream_before(model: Any, point: Point, label: str) -> None:
    """Read ``point`` (a ``resid_mid``) up to its last contribution now, and keep that sum for this visit: a read of
    the point after a read of a later site of its block (a dictionary at ``hook_attn_out`` read before one at
    ``hook_resid_mid``) continues from it, where the model has run past ``layer_input``. Nothing where it is kept
    (the point was read at this visit already)."""
    names = list(point.parts) or ["layer_input", *mixers(model, point.layer)]
    last = binding_of(model, point.layer, names[-1])
    if last.prepare is not None:
        last.prepare()
    mediator = Mediator.current(last.location)
    kept = mediator.__dict__.setdefault("_nncanon_resid_mid", {})
    key, occurrence = (point.layer, last.location), mediator.wanted(last.location)
    if len(names) < 2 or (key in kept and kept[key][0] == occurrence):
        return
    total = None
    for name in names[:-1]:
        binding = binding_of(model, point.layer, name)
        raw, view, graph, hand_back, mediator, at = _read(binding, label)
        total = view.detach().clone() if total is None else total + view.detach()
        if hand_back:  # handed back as a plain read would be, when the worker moves on
            mediator.transform = WriteBack(partial(binding.write_back, view, raw, mediator, graph), view, None,
                                           binding.location, at)
    kept[key] = (occurrence, total)


#: Where an invoke's mediator lists what its dictionaries and `value_at` reads handed to the model, with the tensor's
#: version then: an edit after it could not reach the model (`refuse_late_edits`).
HANDED = "_nncanon_sae_handed"


def first_location(model: Any, layer: int, value: str) -> str:
    """The first location reading standard value ``value`` of block ``layer`` asks of the model (a norm's value: the
    norm's input)."""
    if value in NORM_VALUES:
        return host(model, layer, value)._nncanon_norm(value).site.input_location
    return binding_of(model, layer, value).location


def handed(mediator: Any, tensor: torch.Tensor, what: str, location: str) -> None:
    """Note that ``tensor`` (a read's served value, ``what``) went to the model at ``location``: an edit of it from
    now on is refused (`refuse_late_edits`)."""
    mediator.__dict__.setdefault(HANDED, []).append((tensor, tensor._version, what, location))


def late_edit(what: str, location: str) -> str:
    """The message for an edit of ``what`` made after the model ran past ``location``."""
    return (f"{what} was edited after the model ran past its point ({location}) in this invoke: the edit cannot reach "
            "the model. Edit it before reading a later site of the block (another dictionary's features, a later "
            "value), or in another invoke")


def refuse_late_edits(mediator: Any) -> None:
    """`InvalidWrite` where a tensor `handed` to the model was edited since (the edit would be lost silently)."""
    for tensor, version, what, location in mediator.__dict__.get(HANDED, ()):
        if tensor._version != version:
            mediator.__dict__[HANDED] = []
            raise InvalidWrite(late_edit(what, location))


def hand_back_now(read: PointRead) -> None:
    """Leave ``read`` to be handed back unchanged when the worker moves on (a transcoder's input site)."""
    if read._hand_back:
        read.mediator.transform = WriteBack(read.keep, read._view, None, read.location, read.occurrence)


def value_at(model: Any, name: str | Point, head: int | None = None) -> torch.Tensor:
    """Inside a trace: the value ``name`` names (`nncanon.sae.names.resolve`: a TransformerLens hook name, an nncanon
    value or a module path), ``[b, s, ...]``; with a ``head``, ``value[..., head, :]``.

    Read, ``.save()`` and write it as any value: a standard value is the served tensor itself; ``hook_resid_mid``
    (``layer_input`` plus the token mixer's contribution) is a sum, and an edit of it reaches the model through the
    contribution (the stream after the mixer moves by the edit); ``ln2.hook_normalized`` is the MLP norm's normalised
    input before its weight (``mlp.mlp_normalized``; a write makes the norm's output ``written · weight (+ bias)``).
    A name whose answer needs a probe of the model (``hook_resid_mid``, ``hook_mlp_in``) is resolved before the
    trace: pass the `Point` of ``resolve(model, name)``.
    """
    point = name if isinstance(name, Point) else resolve(model, name, head)
    outside = outside_trace(model, f"{point.name or point.label}")
    if outside is not None:
        return outside
    if point.layer is None:  # a model-level value (hook_embed): the served value itself
        return getattr(model, point.value)
    if point.value in ("attention_probabilities", "attention_scores"):  # no site of their own: served by the
        return getattr(model.layers[point.layer].self_attn, point.value)  # attention (eager or recomputed)
    if point.value == "attention_head_contributions":  # attn.hook_result: computed from hook_z, read-only
        return _head_contributions(model, point)
    if point.value in NORM_VALUES:  # a norm's values: computed from the norm's input, served by their component
        shared = _norm_read_here(model, point)
        return read_value(model, point.layer, point.value) if shared is None else shared
    read = open_point(model, point)
    held = _Held(read)
    if read._mid or read._hand_back:
        read.mediator.transform = WriteBack(held.flush, held.served, None, read.location, read.occurrence)
    return held.served


def _norm_read_here(model: Any, point: Point) -> torch.Tensor | None:
    """The norm value ``point`` names where a dictionary at the same norm read it at this visit and its splice is
    pending (the norm's input, which a read of the value asks for, is behind the model): the tensor that read holds,
    marked as the served one is. An edit of it reaches the model through that splice (the norm's output becomes
    ``written · weight (+ bias)``); ``None`` where there is no such read."""
    component = host(model, point.layer, point.value)
    binding = component._nncanon_norm(point.value)
    mediator = Mediator.current(binding.site.location)
    waiting = mediator.transform
    read = getattr(getattr(getattr(waiting, "fn", None), "__self__", None), "read", None)
    if not isinstance(read, NormPointRead) or read.location != binding.site.location or \
            waiting.occurrence != mediator.wanted(binding.site.location):
        return None
    view = read._norm.scale if binding.part == "scale" else read._norm.normalized
    mark(view, f"{binding.where}.{point.value}")
    return refuse_gradient(view, component._nncanon_gradient_reason(point.value))


def _head_contributions(model: Any, point: Point) -> torch.Tensor:
    """TransformerLens's ``attn.hook_result`` of block ``point.layer``: each head's output through its slice of the
    output projection, ``[b, s, H, d]`` (``[b, s, d]`` for one head), without the projection's bias: ``hook_z``
    (``attention_head_outputs``, through a norm over the heads where one sits before the projection) times the
    projection's weight per head (dequantized where the layer is quantized). Read-only: an edit of it is
    `InvalidWrite` when the worker moves on (write ``attn.hook_z`` instead)."""
    label = point.name or f"layers[{point.layer}].attention_head_contributions"
    read = open_point(model, Point(point.layer, "attention_head_outputs", None, point.name), label)
    heads = projection_input(model, point.layer, read.x)
    weight, _ = projection_weights(model, point.layer)
    result = torch.einsum("bshk,hkd->bshd", heads, weight.to(device=heads.device, dtype=heads.dtype))
    served = result if point.head is None else result[..., point.head, :]
    computed = _Computed(read, served, label)
    read.mediator.transform = WriteBack(computed.flush, served, None, read.location, read.occurrence)
    return served


class _Computed:
    """A value computed from a read (``attn.hook_result`` from ``hook_z``), read-only: the read is handed back as it
    was read; an edit of the value is `InvalidWrite` (it has no way back into the model that is exact)."""

    def __init__(self, read: PointRead, served: torch.Tensor, label: str) -> None:
        self.read, self.served, self.label = read, served, label
        self.version = served._version

    def flush(self) -> Any:
        refuse_late_edits(self.read.mediator)
        if self.served._version != self.version:
            raise InvalidWrite(f"{self.label} is read-only: each head's output through its slice of the output "
                               "projection is computed from attn.hook_z (attention_head_outputs), and an edit of it "
                               "has no exact way back into the model. Write attn.hook_z (or the attention's output) "
                               "instead")
        handed(self.read.mediator, self.served, self.label, self.read.location)
        return self.read.keep()

    def take_over(self) -> PointRead:
        self.flush()
        return self.read


class _Held:
    """A `value_at` read the worker holds: handed back (its edits with it) when the worker moves on."""

    def __init__(self, read: PointRead) -> None:
        self.read = read
        self.served = read.x.clone() if read._mid else read.x  # resid_mid: a sum, changed through the contribution
        self.version = self.served._version

    def flush(self) -> Any:
        refuse_late_edits(self.read.mediator)
        edited = self.served._version != self.version
        return self.read.apply(self.served) if self.read._mid and edited else self.read.keep()

    def take_over(self) -> PointRead:
        self.flush()
        return self.read


#: Standard values whose shapes `point_shape` learns for every block in one trace.
_PROBED = ("layer_input", "query_states", "key_states", "value_states", "attention_head_outputs", "attention_output",
           "linear_attention_head_outputs", "linear_attention_output", "shared_expert_output", "mlp_output",
           "layer_output")


def point_shape(model: Any, point: Point) -> tuple[tuple[int, ...], torch.dtype, torch.device]:
    """The shape after ``[b, s]``, the dtype and the device of ``point``'s value (one head's, where it names one),
    learned from a one-token trace that reads every block's values (once per model)."""
    known = model.__dict__.setdefault("_nncanon_sae_shapes", {})  # plain data: it travels with a remote request
    value = "layer_input" if point.value == "resid_mid" else point.value
    if (point.layer, value) not in known:
        if value in _PROBED and not known.get("_all"):
            known.update(_all_shapes(model))
            known["_all"] = True
        if (point.layer, value) not in known:
            found: list = []
            with torch.no_grad(), model.trace(torch.tensor([[1]])):
                found.append(value_at(model, Point(point.layer, value, None, point.name, point.parts)).save())
            known[(point.layer, value)] = (tuple(found[0].shape[2:]), found[0].dtype, found[0].device)
    shape, dtype, device = known[(point.layer, value)]
    return (shape[1:] if point.head is not None else shape), dtype, device


def _all_shapes(model: Any) -> dict:
    report = model.support()
    plan = []
    for layer in range(model.num_layers):
        names = [name for name in _PROBED if report.available(name, layer=layer)]
        plan += [(layer, name) for name in in_execution_order(model, layer, names)]
    found: dict = {}
    with torch.no_grad(), model.trace(torch.tensor([[1]])):
        for layer, name in plan:
            found[(layer, name)] = read_value(model, layer, name).save()
    return {key: (tuple(tensor.shape[2:]), tensor.dtype, tensor.device) for key, tensor in found.items()}
