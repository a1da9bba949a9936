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

from ..gradients import first_read_in_backward, in_backward
from ..served import Binding, Site, read_site
from ..tools._common import host
from .names import Point, mixers


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

    def keep(self) -> Any:
        """The raw value to hand the model when nothing changed: what a plain read of the value hands back."""
        if self._hand_back:
            return self._binding.write_back(self._view, self._raw, self.mediator, self.graph)
        return self._raw

    def shift(self, delta: torch.Tensor) -> Any:
        """The raw value to hand the model so that the point's value moves by ``delta`` (``x``'s shape)."""
        if self._mid:
            return self._binding.write_back(self._view + delta, self._raw, self.mediator, self.graph)
        return self.apply(self.x + delta)

    def apply(self, new: torch.Tensor) -> Any:
        """The raw value to hand the model so that the point's value becomes ``new`` (``x``'s shape, dtype, device)."""
        if self._mid:
            return self._binding.write_back(self._view + (new - self.x), self._raw, self.mediator, self.graph)
        if self._head is not None:
            whole = self._view.clone()
            whole[..., self._head, :] = new
            new = whole
        return self._binding.write_back(new, self._raw, self.mediator, self.graph)


def binding_of(model: Any, layer: int, value: str) -> Binding:
    """The `Binding` of a standard value of block ``layer`` (raising `ValueNotAvailable` with the reason where it
    is declined), or, for ``mlp_input``, one made for the MLP module's first input."""
    if value == "mlp_input":
        mlp = model.layers[layer].mlp
        return Binding("mlp_input", f"{mlp.path}.input", _MLP_INPUT, model._text_config, f"layers[{layer}].mlp")
    component = host(model, layer, value)
    binding = component._nncanon_binding(value)
    return binding


_MLP_INPUT = Site(key="input")


def _read(binding: Binding, label: str) -> tuple[Any, torch.Tensor, bool, bool, Any, int]:
    if in_backward():
        raise first_read_in_backward(label)
    if binding.prepare is not None:
        binding.prepare()
    mediator = Mediator.current(binding.location)
    occurrence = mediator.wanted(binding.location)
    raw, view, graph, hand_back = read_site(binding, mediator, label)
    return raw, view, graph, hand_back, mediator, occurrence


def open_point(model: Any, point: Point, label: str | None = None) -> PointRead:
    """Read ``point`` inside a trace (this invoke's rows, this visit); see `PointRead`.

    Reading a point is reading the sites it is made of in the forward's order: a site read earlier is handed back
    (as a plain read would be) before the next is read.
    """
    label = label or point.label
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


def hand_back_now(read: PointRead) -> None:
    """Leave ``read`` to be handed back unchanged when the worker moves on (a transcoder's input site)."""
    if read._hand_back:
        read.mediator.transform = WriteBack(read.keep, read._view, None, read.location, read.occurrence)


def value_at(model: Any, name: str | Point, head: int | None = None) -> torch.Tensor:
    """Inside a trace: the value ``name`` names (`nncanon.sae.names.resolve`: a TransformerLens hook name, an nncanon
    value or a module path), ``[b, s, ...]``; with a ``head``, ``value[..., head, :]``.

    Read, ``.save()`` and write it as any value: a standard value is the served tensor itself; ``hook_resid_mid``
    (``layer_input`` plus the token mixer's contribution) is a sum, and an edit of it reaches the model through the
    contribution (the stream after the mixer moves by the edit); ``ln2.hook_normalized`` is the MLP module's input.
    A name whose answer needs a probe of the model (``hook_resid_mid``, ``hook_mlp_in``) is resolved before the
    trace: pass the `Point` of ``resolve(model, name)``.
    """
    from .names import resolve

    point = name if isinstance(name, Point) else resolve(model, name, head)
    if point.value != "resid_mid" and point.head is None:
        if point.value == "mlp_input":
            return model.layers[point.layer].mlp.input
        return getattr(host(model, point.layer, point.value), point.value)
    read = open_point(model, point)
    served = read.x.clone() if read._mid else read.x
    version = served._version

    def hand_back() -> Any:
        return read.apply(served) if served._version != version else read.keep()

    if read._mid or read._hand_back or point.head is not None:
        read.mediator.transform = WriteBack(hand_back, served, None, read.location, read.occurrence)
    return served
