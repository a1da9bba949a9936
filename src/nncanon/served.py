"""Where a standard value lives inside a block, and the descriptor that serves it.

A family says, as data, where each value of the surface is found: a `Site` is a module path
relative to the block, which side of it (``output`` or ``input``), which tuple element, and the
few transformations a family may need (a scale factor, a flattened token axis, a clone because
the model changes the tensor in place later). `served` is the nnsight ``eproperty`` that reads
a site during a trace and writes the user's edits back to the model.

Reads are views wherever the layout allows, so an in-place edit (``value[:, -1] = 0``) reaches
the model with no copy. Only a scaled or cloned value needs a write-back; it writes back only
the elements the user changed, so every other element stays bit-identical to a clean run.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from nnsight.intervention.envoy import Envoy
from nnsight.intervention.eproperty import WriteBack, eproperty
from nnsight.intervention.interleaver import Mediator, OutOfOrderError
from nnsight.intervention.util import first_input, replace_first_input

from .errors import InvalidInput, InvalidWrite
from .gradients import Through, first_read_in_backward, in_backward, mark, refuse_gradient, tracks
from .order import note_read, translated
from .traced import outside_trace, refuse_outside_trace


@dataclass(frozen=True)
class Site:
    """Where a value is read in a block.

    Attributes:
        module: Path of the module relative to the block (``"self_attn"``,
            ``"self_attention.dense"``); ``""`` is the block itself.
        key: ``"output"`` or ``"input"`` (the first input of the module).
        index: The tuple element of the output that holds the tensor (``0`` for the
            ``(out, weights)`` every attention module returns); ``None`` for a tensor.
        scale: A config attribute the model multiplies the module's value by before it
            reaches the residual stream (Granite's ``residual_multiplier``), or a function of the
            config that returns the factor (MiniCPM3's ``scale_depth / sqrt(num_hidden_layers)``).
        flat: The module runs on a flattened ``(b·s, ...)`` tensor (OPT's ``fc2``), or, with ``heads_first``,
            on heads folded into the batch, ``(b·heads, s, head_dim)`` (BLOOM's and XGLM's attention
            kernels): the first axis is split back into the batch and the rest.
        clone: The model changes the tensor in place after the module returns (Falcon adds
            attention into the MLP output), so the read is a copy taken at the module.
        bias: The tuple element of the output holding a bias the caller adds to the tensor
            (GPT-NeoX-Japanese's last attention returns its ``dense_bias`` apart, Megatron's
            ``skip_bias_add``); the value served is ``tensor + bias`` where that element is not ``None``.
        op: An operation inside the module's forward, by its nnsight ``.source`` name
            (``"router_logits_0"``: the value bound to ``router_logits``); ``key`` then applies
            to the operation. For values that exist only inside a forward, such as router
            logits whose edit must change the routing.
        merge: The tensor's last two axes are one axis of the residual stream (hyper-connections:
            a sublayer writes ``[b, s, k, d]`` into a ``[b, s, k·d]`` stream, or the model keeps its
            streams as ``[b, s, k, d]``, `nncanon.families.Family.merged_streams`); served merged,
            ``[b, s, k·d]``, a view (on a ``weighted`` site, the product merged).
        stacked: The tensor holds ``k`` streams stacked on a leading axis, ``[k, b, s, d]`` (Gemma-3n's
            AltUp streams); served sequence-first with the streams side by side, ``[b, s, k·d]``, as a
            merged stream is (`stacked_as_served`), a copy whose edits are written back.
        weighted: ``(weight_op, output_op)``: two operations of the module's forward whose outputs the
            model multiplies and adds, in one expression, to the tensor of operation ``op``, the streams
            (hyper-connections written inline, DeepSeek-V4's ``post ⊗ out + streams``: per-stream weights
            ``[b, s, k, 1]`` times the sublayer's output ``[b, s, 1, d]``, added to ``[b, s, k, d]``). The
            product is no operation, so it is taken over: when the value is read, the weight is handed to
            the model as zeros and the value, ``weight · output`` ``[b, s, k, d]`` (the model's own product,
            bit for bit), is added to ``op``'s tensor instead. The sum is the model's, bit for bit, and a
            write to the value is exactly what reaches the streams. With ``merge``, served ``[b, s, k·d]``.
        arg: With ``key="input"``, the positional argument that holds the tensor, or the keyword it is
            passed by (``None``: the first input). The attention interface takes ``(module, query, key,
            value, mask)``: 1, 2 and 3; BLOOM's ``alibi.baddbmm(batch1=query, batch2=key, ...)``: ``"batch1"``.
        heads_first: The tensor is laid out ``[b, heads, s, head_dim]`` (as attention kernels take it);
            served sequence-first, ``[b, s, heads, head_dim]``, a view.
        transposed: The tensor's last two axes are ``(head_dim, s)`` (a key passed transposed to the
            kernel, GPT-1's): served with them swapped back, a view.
        private: The tensor may be storage the model keeps past the call (a key or value the cache
            returned is the cache's own tensor, or a view of it): at the first read the call is handed a
            copy in its place, and the value served is a view of that copy, so a write reaches the call
            and not what the cache keeps for later steps.
        part: ``(i, n)``: the value is part ``i`` of ``n`` equal parts of the tensor's last axis (a fused
            projection, Phi-3's ``gate_up_proj``, whose output the MLP chunks into its gate and linear paths),
            served as a view of that slice.
    """

    module: str = ""
    key: str = "output"
    index: int | None = None
    scale: str | Callable[[Any], float] | None = None
    flat: bool = False
    clone: bool = False
    op: str | None = None
    bias: int | None = None
    merge: bool = False
    stacked: bool = False
    weighted: tuple[str, str] | None = None
    arg: int | str | None = None
    heads_first: bool = False
    transposed: bool = False
    private: bool = False
    part: tuple[int, int] | None = None

    def factor(self, config: Any) -> float:
        """The scale factor for ``config`` (``1.0`` where the site has none)."""
        return 1.0 if self.scale is None else config_factor(self.scale, config)

    @property
    def needs_writeback(self) -> bool:
        """Whether the served tensor is not a view of the model's own, so edits must be written back."""
        return (self.scale is not None or self.clone or self.bias is not None or self.stacked
                or self.weighted is not None)


def stacked_as_served(tensor: torch.Tensor) -> torch.Tensor:
    """``k`` streams stacked first, ``[k, b, s, d]``, as the surface serves them: ``[b, s, k·d]`` (a copy).

    Stream ``j`` is ``served.view(b, s, k, d)[:, :, j]``, as on a merged hyper-connection stream.
    """
    return tensor.permute(1, 2, 0, 3).flatten(-2)


def served_as_stacked(value: torch.Tensor, streams: int) -> torch.Tensor:
    """The inverse of `stacked_as_served`: ``[b, s, k·d]`` back to ``[k, b, s, d]`` (contiguous)."""
    return value.unflatten(-1, (streams, -1)).permute(2, 0, 1, 3).contiguous()


def config_factor(attribute: str | Callable[[Any], Any], config: Any) -> Any:
    """A family's factor: the config attribute named ``attribute``, or ``attribute(config)``."""
    return attribute(config) if callable(attribute) else getattr(config, attribute, None)


def describe_factor(attribute: str | Callable[[Any], Any]) -> str:
    """A factor for the docs: ```residual_multiplier``` or the function's one-line docstring."""
    if callable(attribute):
        return (attribute.__doc__ or attribute.__name__).strip().splitlines()[0]
    return f"`{attribute}`"


def operation_name(names: Any, op: str) -> str | None:
    """The operation ``op`` names among a forward's operation ``names``: ``op`` itself, or for a pattern
    ending in ``*`` (``"attention_interface_*"``), the last name that starts with the rest, for one also starting
    with ``*`` (``"*sigmoid*"``), the last that contains it (``None``: there is none)."""
    if not op.endswith("*"):
        return op
    found = [name for name in names if (op[1:-1] in name if op.startswith("*") else name.startswith(op[:-1]))]
    return found[-1] if found else None


def _part(tensor: torch.Tensor, part: tuple[int, int]) -> torch.Tensor:
    """Part ``i`` of ``n`` equal parts of ``tensor``'s last axis (`Site.part`), a view."""
    index, count = part
    width = tensor.shape[-1] // count
    return tensor.narrow(-1, index * width, width)


def _pick(raw: Any, site: Site) -> torch.Tensor:
    """The tensor of a site inside the raw served value (a tensor, a tuple, or ``(args, kwargs)``)."""
    if site.key == "input":
        args, kwargs = raw
        if site.arg is None:
            return first_input(args, kwargs)
        return kwargs[site.arg] if isinstance(site.arg, str) else args[site.arg]
    if site.index is not None and isinstance(raw, (tuple, list)):
        return raw[site.index]
    if hasattr(raw, "last_hidden_state") and not isinstance(raw, torch.Tensor):
        return raw[0]
    return raw


def _put(raw: Any, site: Site, tensor: torch.Tensor) -> Any:
    """The raw value with the site's tensor replaced by ``tensor`` (containers rebuilt, not mutated)."""
    if site.key == "input":
        args, kwargs = raw
        if isinstance(site.arg, str):
            return args, {**kwargs, site.arg: tensor}
        if site.arg is not None:
            return (*args[: site.arg], tensor, *args[site.arg + 1 :]), kwargs
        return replace_first_input(args, kwargs, tensor)
    if site.index is not None and isinstance(raw, (tuple, list)):
        items = list(raw)
        items[site.index] = tensor
        return type(raw)(items) if not hasattr(raw, "_fields") else type(raw)(*items)
    return tensor


def _rows(mediator: Mediator) -> tuple[int, tuple[int, int] | None]:
    """The combined batch size, and this invoke's ``(start, size)`` rows when batching."""
    batcher = getattr(mediator.interleaver, "batcher", None)
    if batcher is None:
        return 0, None
    group = mediator.batch_group if batcher.batching else None
    return batcher.total, (tuple(group) if group is not None else None)


@dataclass
class Binding:
    """A site bound to one block of one model: the location it is read at, and how.

    Attributes:
        name: The standard value's name (``"attention_output"``), for messages.
        location: The nnsight location, ``"{module envoy path}.{key}"``.
        site: The family's site.
        config: The model's (text) config, for scale factors.
        where: A human label for messages (``"layers[3].self_attn"``).
        heads: When set, the last axis is split into ``(heads, head_dim)``.
        prepare: Called before a read; installs nnsight's source hooks for an operation site.
        order: The order the model computes this block's values in, for the out-of-order message.
        block: The index of the block ``site`` is relative to, where it is not the block serving the
            value (an idle block's stream is read at the next block that runs: `Family.idle`).
        weighted: For a ``weighted`` site, the locations of its weight and its output operations.
    """

    name: str
    location: str
    site: Site
    config: Any
    where: str
    heads: int | None = None
    prepare: Any | None = None
    order: str = ""
    block: int | None = None
    weighted: tuple[str, str] | None = None

    def _factor(self) -> float:
        return self.site.factor(self.config)

    def _bias(self, raw: Any) -> torch.Tensor | None:
        """The bias the caller adds to the site's tensor, where the site names one and it is set."""
        if self.site.bias is None or not isinstance(raw, (tuple, list)):
            return None
        bias = raw[self.site.bias]
        # The model adds the bias itself later: the served sum takes no second path to it.
        return bias.detach() if isinstance(bias, torch.Tensor) else bias

    def read(self, raw: Any, mediator: Mediator) -> torch.Tensor:
        """What the user reads: ``[b, s, ...]``, this invoke's rows only."""
        tensor = _pick(raw, self.site)
        if self.site.stacked:
            return stacked_as_served(self._own_rows(tensor, mediator))
        bias = self._bias(raw)
        if bias is not None:
            tensor = tensor + bias
        if self.site.flat:
            tensor = self._unflatten(tensor, mediator)
        if self.site.merge:
            tensor = tensor.flatten(-2)
        if self.site.part is not None:
            tensor = _part(tensor, self.site.part)
        if self.heads is not None:
            tensor = tensor.unflatten(-1, (self.heads, -1))
        if self.site.transposed:
            tensor = tensor.transpose(-1, -2)
        if self.site.heads_first:
            tensor = tensor.transpose(1, 2)
        if self.site.scale is not None:
            return tensor * self._factor()
        if self.site.clone:
            return tensor.clone()
        return tensor

    def _own_rows(self, tensor: torch.Tensor, mediator: Mediator) -> torch.Tensor:
        """This invoke's rows of a stacked ``[k, b, s, d]`` tensor (its batch is the second axis).

        nnsight narrows a batched trace's values on their first axis, where it holds the trace's
        total rows: on a stacked tensor that axis is the streams', so nncanon narrows the second one
        itself, and refuses the one layout it cannot tell apart (as many rows as streams).
        """
        total, rows = _rows(mediator)
        if getattr(tensor, "_nnsight_batch", False) or (rows is not None and tensor.shape[1] != total):
            raise InvalidInput(
                f"{self.where}.{self.name} cannot be served in this trace: the model keeps its "
                f"{tensor.shape[0]} streams stacked first ([k, b, s, d]) and this trace's invokes have "
                f"{total} rows in all, as many as the streams, so nnsight cut the streams' axis as if it "
                "were the batch's. Run these prompts with another number of rows in all (one invoke per "
                "trace, or add or drop a prompt)."
            )
        if rows is None:
            return tensor
        start, size = rows
        return tensor.narrow(1, start, size)

    def _unflatten(self, tensor: torch.Tensor, mediator: Mediator) -> torch.Tensor:
        total, rows = _rows(mediator)
        if rows is None:
            return tensor.view(total or 1, -1, *tensor.shape[1:])
        start, size = rows
        if tensor.shape[0] < total:
            # nnsight narrowed it already: one token per row (a generation step).
            return tensor.view(size, -1, *tensor.shape[1:])
        return tensor.view(total, -1, *tensor.shape[1:]).narrow(0, start, size)

    def _in_layout(self, value: torch.Tensor, tensor: torch.Tensor, mediator: Mediator | None) -> torch.Tensor:
        """``value`` (served shape) laid out as the model's ``tensor``: heads merged back, merged axes
        split again, a flattened token axis restored. On a flattened site, whose raw tensor holds every
        invoke's rows, this invoke's rows are placed into a copy of ``tensor``."""
        if self.site.heads_first:
            value = value.transpose(1, 2)
        if self.site.transposed:
            value = value.transpose(-1, -2)
        if self.heads is not None:
            value = value.flatten(-2)
        if self.site.part is not None:  # the other parts as the model computed them
            whole = tensor.clone()
            _part(whole, self.site.part).copy_(value)
            value = whole
        if self.site.merge:
            value = value.unflatten(-1, tensor.shape[-2:])
        if self.site.stacked:
            value = served_as_stacked(value, tensor.shape[0])
            total, rows = _rows(mediator) if mediator is not None else (0, None)
            if rows is None:
                return value
            full = tensor.clone()
            start, size = rows
            full[:, start : start + size] = value
            return full
        if not self.site.flat:
            return value
        total, rows = _rows(mediator) if mediator is not None else (0, None)
        if rows is not None and tensor.shape[0] >= total:
            full = tensor.clone()
            start, size = rows
            full.view(total, -1, *tensor.shape[1:])[start : start + size] = value
            return full
        return value.reshape(tensor.shape)

    def write_back(self, view: torch.Tensor, raw: Any, mediator: Mediator | None = None, graph: bool = False) -> Any:
        """Map the user's (possibly edited) view back into the model's raw value.

        Only elements the user changed are replaced, so a write at one position leaves
        every other position of the stream bit-identical, in any dtype. With ``graph`` (the trace
        tracks gradients), the model's tensor is handed back so that its gradient reaches ``view``
        (`nncanon.gradients`), with the same data.
        """
        tensor = _pick(raw, self.site)
        if self.weighted is not None:  # the streams, with what the sublayer writes into them (the model's sum)
            return _put(raw, self.site, tensor + self._in_layout(view, tensor, mediator))
        bias = self._bias(raw)
        if self.site.scale is not None or bias is not None:
            current = tensor if bias is None else tensor + bias
            factor = self._factor() if self.site.scale is not None else None
            served = current if factor is None else current * factor
            view = self._in_layout(view, served, mediator)
            kept = Through.apply(view, tensor, 1.0 if factor is None else factor) if graph else tensor
            changed = view != served
            if not bool(changed.any()):
                return _put(raw, self.site, kept) if graph else raw
            written = view if factor is None else view / factor
            written = written if bias is None else written - bias
            return _put(raw, self.site, torch.where(changed, written, kept))
        if not self.site.needs_writeback:  # a view of the model's tensor, handed back for its gradient
            return _put(raw, self.site, self._in_layout(view, tensor, mediator))
        return _put(raw, self.site, self._in_layout(view, tensor, mediator).clone())

    def assign(self, value: Any, raw: Any, mediator: Mediator) -> Any:
        """The raw value to swap in when the user assigns ``value`` to the whole value."""
        current = self.read(raw, mediator)
        check_write(value, current, f"{self.where}.{self.name}")
        value = value.expand_as(current)
        if self.site.scale is not None or self._bias(raw) is not None:
            # in a trace that tracks gradients, the assigned value takes the gradient where it equals the model's
            # own (the model's tensor is handed back through `Through`), not the model's computation
            return self.write_back(value, raw, mediator, graph=tracks(value) or tracks(_pick(raw, self.site)))
        value = self._in_layout(value, _pick(raw, self.site), mediator)
        return _put(raw, self.site, value.clone() if self.site.clone else value)


def check_write(value: Any, current: torch.Tensor, what: str) -> None:
    """Raise `InvalidWrite` unless ``value`` can stand in for ``current`` (broadcast shape, dtype, device)."""
    if not isinstance(value, torch.Tensor):
        raise InvalidWrite(
            f"{what} was assigned a {type(value).__name__}; it takes a tensor of shape "
            f"{tuple(current.shape)} (or one that broadcasts to it), dtype {current.dtype}, "
            f"on {current.device}."
        )
    try:
        fits = torch.broadcast_shapes(value.shape, current.shape) == current.shape
    except RuntimeError:
        fits = False
    problems = []
    if not fits:
        problems.append(f"shape {tuple(value.shape)} does not broadcast to {tuple(current.shape)}")
    if value.dtype != current.dtype and not (value.is_floating_point() or value.is_complex()):
        problems.append(f"dtype {value.dtype} is an integer or boolean dtype: the value holds {current.dtype} "
                        "numbers, and integers would be rounded into them (write a float tensor of that dtype)")
    elif value.dtype != current.dtype:  # one rule: the value's own dtype, never a silent cast (docs/quantization.md)
        problems.append(f"dtype {value.dtype} is not {current.dtype} (use .to({current.dtype}))")
    if value.device != current.device:
        problems.append(f"device {value.device} is not {current.device} (use .to('{current.device}'))")
    if problems:
        raise InvalidWrite(
            f"{what} cannot take the value written to it: " + "; ".join(problems) + ". "
            f"It expects shape {tuple(current.shape)}, dtype {current.dtype}, on {current.device}."
        )


def _rebuild_eproperty(cls: type, key: str, description: str | None, preprocess: Any, postprocess: Any,
                      transform: Any, put: Any = None) -> eproperty:
    prop = cls.__new__(cls)
    eproperty.__init__(prop, key=key, description=description)
    eproperty.__call__(prop, preprocess)
    prop._postprocess, prop._transform = postprocess, transform
    prop._put = put
    return prop


class model_value(eproperty):
    """An nnsight ``eproperty`` that pickles (remote requests ship nncanon's classes by value).

    A model value registers its write with `writer`: ``put(host, value, raw)`` checks the
    user's ``value`` against the value read from ``raw`` (raising `InvalidWrite`) and returns the
    raw value to swap in, its container kept. A model value without a writer cannot be written.
    """

    _put: Callable[[Any, Any, Any], Any] | None = None

    def __get__(self, obj: Any, owner: Any = None) -> Any:
        if obj is not None:
            obj._model_value_check(self.name)  # a declined value says why before it waits on the model
            outside = outside_trace(obj, f"model.{self.name}")
            if outside is not None:
                return outside
        return super().__get__(obj, owner)

    def writer(self, put: Callable[[Any, Any, Any], Any]) -> model_value:
        """Register ``put(host, value, raw) -> new raw``: the checked write of this value."""
        self._put = put
        return self

    def __set__(self, obj: Any, value: Any) -> None:
        obj._model_value_check(self.name)
        if self._put is None:
            raise InvalidWrite(f"model.{self.name} is read-only.")
        refuse_outside_trace(obj, f"model.{self.name} was written")
        location = self._location(obj)
        Mediator.swap(location, self._put(obj, value, Mediator.value(location)))

    def __reduce__(self) -> tuple:
        return (
            _rebuild_eproperty,
            (type(self), self.key, self.description, self._preprocess, self._postprocess, self._transform,
             self._put),
        )


def _init_served(prop: eproperty, name: str, description: str, doc: str) -> None:
    eproperty.__init__(prop, key=name, description=description)

    def stub(host: Any, value: Any) -> torch.Tensor:  # pragma: no cover - never called
        return value

    stub.__name__ = name
    stub.__doc__ = doc
    eproperty.__call__(prop, stub)


def _rebuild_served(cls: type, name: str, description: str, doc: str) -> eproperty:
    prop = cls.__new__(cls)
    _init_served(prop, name, description, doc)
    return prop


class served(eproperty):
    """A standard value of a component, served from the site its family names.

    The host (a component envoy) answers ``_nncanon_binding(name)`` with the `Binding`
    for this block, or raises `ValueNotAvailable` with the reason ``support()`` gives.
    """

    def __init__(self, name: str, description: str, doc: str) -> None:
        _init_served(self, name, description, doc)

    def __reduce__(self) -> tuple:
        # Remote requests pickle our classes by value, descriptors included. Rebuilt by a module
        # function, not the class: the class is itself being rebuilt when its descriptors are.
        return (_rebuild_served, (type(self), self.name, self.description, self.__doc__))

    def __get__(self, obj: Any, owner: Any = None) -> Any:
        if obj is None:
            return self
        binding: Binding = obj._nncanon_binding(self.name)
        if in_backward():
            raise first_read_in_backward(f"{binding.where}.{self.name}")
        outside = outside_trace(_model_of(obj), f"{binding.where}.{self.name}")
        if outside is not None:
            return outside
        if binding.prepare is not None:
            binding.prepare()  # an operation site found at the first read sets its location now
        location = binding.location
        mediator = Mediator.current(location)
        occurrence = mediator.wanted(location)
        waiting = mediator.transform
        if waiting is not None and waiting.key == (self, location, occurrence):
            return waiting.view
        label = f"{binding.where}.{self.name}"
        raw, view, graph, hand_back = read_site(binding, mediator, label)
        if hand_back:
            mediator.transform = WriteBack(
                partial(binding.write_back, view, raw, mediator, graph), view, self, location, occurrence
            )
        if isinstance(view, torch.Tensor):
            mark(view, f"{binding.where}.{self.name}")
            refuse_gradient(view, obj._nncanon_gradient_reason(self.name))
        return view

    def __set__(self, obj: Any, value: Any) -> None:
        binding: Binding = obj._nncanon_binding(self.name)
        refuse_outside_trace(_model_of(obj), f"{binding.where}.{self.name} was written")
        if binding.prepare is not None:
            binding.prepare()
        mediator = Mediator.current(binding.location)
        label = f"{binding.where}.{self.name}"
        if binding.weighted is not None:
            waiting = mediator.transform
            if waiting is not None and waiting.key == (self, binding.location, mediator.wanted(binding.location)):
                # Read already in this trace: the model is past the weight, and the read's write-back is pending.
                check_write(value, waiting.view, label)
                waiting.view.copy_(value.expand_as(waiting.view))
                return
            raw, current = _read_weighted(binding, mediator, label)
            check_write(value, current, label)
            Mediator.swap(binding.location, binding.write_back(value.expand_as(current), raw))
            return
        raw = _value(binding, mediator, label)
        Mediator.swap(binding.location, binding.assign(value, raw, mediator))


def read_site(binding: Binding, mediator: Mediator, label: str) -> tuple[Any, torch.Tensor, bool, bool]:
    """Read a bound site as `served` reads it: ``(raw, view, graph, hand_back)``.

    ``raw`` is the model's value at the site's location (this invoke's rows), ``view`` the value served from it,
    ``graph`` whether gradients are tracked, ``hand_back`` whether the model must be handed
    ``binding.write_back(view, raw, mediator, graph)`` before it moves on: a value that is not the model's own
    tensor (a copy's write-back), and, where gradients are tracked, a view (so that its gradient reaches it).
    ``label`` names the value in an out-of-order message. For code that serves values derived from a site
    (`nncanon.sae`).
    """
    if binding.weighted is not None:
        raw, view = _read_weighted(binding, mediator, label)
        tensor = _pick(raw, binding.site)
        graph = tracks(view)
    else:
        raw = _value(binding, mediator, label)
        if binding.site.private:
            raw = _private(raw, binding.site, binding.location)
        view = binding.read(raw, mediator)
        tensor = _pick(raw, binding.site)
        graph = tracks(tensor)
    return raw, view, graph, binding.site.needs_writeback or (graph and view is not tensor)


def _model_of(host: Any) -> Any:
    """The model a component serves values of (``None`` for one that is no envoy: OPT's inline MLP)."""
    return host.root if isinstance(host, Envoy) else None


def _private(raw: Any, site: Site, location: str) -> Any:
    """The raw value once the site's tensor is a copy the model was handed (`Site.private`): the copy is
    swapped in at the first read, and a later read (another invoke's, or the same again) finds it there."""
    tensor = _pick(raw, site)
    if not isinstance(tensor, torch.Tensor) or _owner(tensor).__dict__.get("_nncanon_private", False):
        return raw
    Mediator.swap(location, _put(raw, site, tensor.clone()))
    raw = Mediator.value(location)  # the model's value now (in a batched trace, the batch rebuilt around the copy)
    _owner(_pick(raw, site)).__dict__["_nncanon_private"] = True
    return raw


def _owner(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor whose storage ``tensor`` views (itself where it is no view)."""
    return tensor if tensor._base is None else tensor._base


def _read_weighted(binding: Binding, mediator: Mediator, label: str) -> tuple[Any, torch.Tensor]:
    """A ``weighted`` site: ``(raw value of the streams, weight · output)``, the weight handed to the model
    as zeros (the product is added to the streams by the write-back instead, `Site.weighted`); the product
    ``[b, s, k, d]``, served ``[b, s, k·d]`` where the site merges (a view of it)."""
    weight_at, output_at = binding.weighted
    weight = _value(binding, mediator, label, weight_at)
    Mediator.swap(weight_at, torch.zeros_like(weight))
    output = _value(binding, mediator, label, output_at)
    raw = _value(binding, mediator, label)
    product = weight * output
    return raw, product.flatten(-2) if binding.site.merge else product


def _value(binding: Binding, mediator: Mediator, label: str, location: str | None = None) -> Any:
    """The raw value at ``binding``'s location (or at ``location``, one of the operations it reads);
    nnsight's ``OutOfOrderError`` named (`nncanon.order`)."""
    try:
        raw = Mediator.value(binding.location if location is None else location)
    except OutOfOrderError as error:
        if mediator.iteration != 0:  # a tracer.iter loop that outran the run: nnsight warns, not an error
            raise
        raise translated(error, mediator, label, binding.order) from None
    note_read(mediator, label)
    return raw
