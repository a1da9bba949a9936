"""Gradients of served values: ``value.grad`` inside ``with loss.backward():`` of a trace.

nnsight serves ``t.grad`` by a hook on the tensor ``t`` itself, so a gradient reaches a value only
if the model's later computation runs through that very tensor. The model's own tensor at a site
does; a value we derive from it does not by itself: a per-head view (``unflatten``), a token axis
restored (``view``), a scaled copy (Granite's ``residual_multiplier``) or a bias added. So when a
trace tracks gradients, a read puts the served value into the model's graph, with data that is bit
for bit the model's own:

- a view: the model is handed the view laid out back as its own tensor (same storage, same data);
- a scaled or biased copy: the model is handed its own tensor through `Through`, an identity whose
  backward sends ``grad / factor`` to the served value (``value = tensor · factor + bias``), and
  from there the gradient flows on to the model's tensor (``(grad / factor) · factor``).

A write to ``value.grad`` then changes the gradient that flows on, as on any nnsight tensor.

Named errors (`GradientNotAvailable`): ``.grad`` of a served value asked in the forward part of a
trace (outside the backward block), a served value first read inside the backward block (the forward
is over), a ``.grad`` the backward never reaches, and the ``.grad`` of a value whose gradient check
failed on the load-time proof (`refuse_gradient`: the value is served, its gradient is not).
`InvalidWrite`: a write to a gradient that would not reach the model (`refuse_gradient_write`: the
probabilities recomputed beside an sdpa kernel, `nncanon.components.kernel.probabilities_in_graph`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from nnsight.intervention import backward as _backward
from nnsight.intervention.eproperty import WriteBack
from nnsight.intervention.interleaver import Mediator, OutOfOrderError

from .errors import GradientNotAvailable, InvalidWrite
from .threads import ProcessLock

#: The attribute that marks a served tensor with its name (``"layers[0].self_attn.attention_output"``).
MARK = "_nncanon_value"

#: The attribute that holds why a served tensor's gradient is not served (`refuse_gradient`).
REFUSED = "_nncanon_no_grad"

#: The attribute that holds why a write to a served tensor's gradient is refused (`refuse_gradient_write`).
READ_ONLY = "_nncanon_grad_read_only"

_GRAD = torch._C.TensorBase.grad  # torch's own ``.grad``


class Through(torch.autograd.Function):
    """``Through(served, tensor)`` is a copy of ``tensor`` whose gradient goes to ``served`` divided by
    ``factor`` (``served = tensor · factor (+ bias)``) and not to ``tensor`` directly."""

    @staticmethod
    def forward(ctx: Any, served: torch.Tensor, tensor: torch.Tensor, factor: float) -> torch.Tensor:
        ctx.factor = factor
        return tensor.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return (grad if ctx.factor == 1.0 else grad / ctx.factor), None, None


@contextlib.contextmanager
def no_weight_gradients(model: Any) -> Iterator[None]:
    """The model's parameters take no gradient for the duration (restored after): a backward computes the served
    values' gradients only, never the weights'."""
    parameters = [p for p in model._module.parameters() if p.requires_grad]
    for parameter in parameters:
        parameter.requires_grad_(False)
    try:
        yield
    finally:
        for parameter in parameters:
            parameter.requires_grad_(True)


def tracks(tensor: Any) -> bool:
    """Whether a gradient can reach ``tensor`` (the trace tracks gradients and it is in the graph)."""
    return isinstance(tensor, torch.Tensor) and tensor.requires_grad and torch.is_grad_enabled()


def in_backward() -> bool:
    """Whether a ``with loss.backward():`` block of nnsight is running (it replaces ``Tensor.grad``)."""
    current = torch.Tensor.__dict__.get("grad")
    return not _torchs_own(current) and current is not _FORWARD_GRAD


def _torchs_own(current: Any) -> bool:
    """Whether ``current`` (``torch.Tensor.__dict__["grad"]``) is torch's ``.grad``: absent, or the base
    class's descriptor, which nnsight writes back onto ``torch.Tensor`` after a backward block."""
    return current is None or current is _GRAD


def mark(tensor: torch.Tensor, name: str) -> torch.Tensor:
    """Label ``tensor`` as the served value ``name`` (for the messages of `GradientNotAvailable`)."""
    try:
        setattr(tensor, MARK, name)
    except (AttributeError, RuntimeError):  # pragma: no cover - a tensor subclass that refuses attributes
        pass
    return tensor


def refuse_gradient(tensor: torch.Tensor, reason: str | None) -> torch.Tensor:
    """Mark the served ``tensor`` so that its ``.grad``, read or written, raises `GradientNotAvailable` with
    ``reason`` (its gradient check failed); ``reason`` ``None`` leaves it as it is."""
    if reason is not None:
        try:
            setattr(tensor, REFUSED, reason)
        except (AttributeError, RuntimeError):  # pragma: no cover - a tensor subclass that refuses attributes
            pass
    return tensor


def refuse_gradient_write(tensor: torch.Tensor, reason: str) -> torch.Tensor:
    """Mark the served ``tensor`` so that a write to its ``.grad`` raises `InvalidWrite` with ``reason`` (its
    gradient is served, but a written one would not reach what the model computes from it)."""
    try:
        setattr(tensor, READ_ONLY, reason)
    except (AttributeError, RuntimeError):  # pragma: no cover - a tensor subclass that refuses attributes
        pass
    return tensor


def _refused(tensor: torch.Tensor) -> None:
    """Raise `GradientNotAvailable` where ``tensor``'s gradient is refused (`refuse_gradient`)."""
    attributes = tensor.__dict__ if hasattr(tensor, "__dict__") else {}
    reason = attributes.get(REFUSED)
    if reason is not None:
        raise GradientNotAvailable(f"{attributes.get(MARK, 'this value')}.grad is not served: {reason}")


def first_read_in_backward(name: str) -> GradientNotAvailable:
    """The error for a served value read for the first time inside a backward block."""
    return GradientNotAvailable(
        f"{name} was read inside `with loss.backward():`, where the forward is over. Read it in the forward, "
        f"before the backward block, and ask its gradient inside: `value = {name}` ... "
        f"`with loss.backward(): grad = value.grad.save()`."
    )


def _forward_get(tensor: torch.Tensor) -> Any:
    _refused(tensor)
    name = tensor.__dict__.get(MARK) if hasattr(tensor, "__dict__") else None
    if name is not None:
        raise GradientNotAvailable(
            f"{name}.grad was asked in the forward part of the trace, where no gradient exists yet. Ask it "
            f"inside a backward block of the same trace: `loss = ...` then `with loss.backward(): "
            f"grad = value.grad.save()`."
        )
    return _GRAD.__get__(tensor)


def _forward_set(tensor: torch.Tensor, value: Any) -> None:
    if hasattr(tensor, "__dict__") and tensor.__dict__.get(MARK) is not None:
        _forward_get(tensor)
    _GRAD.__set__(tensor, value)


_FORWARD_GRAD = property(_forward_get, _forward_set)
_depth = 0
_replaced = False  # whether torch.Tensor held torch's descriptor itself when the guard went up
_lock = ProcessLock()


@contextlib.contextmanager
def forward_guard() -> Iterator[None]:
    """While a trace's forward runs: ``.grad`` of a served value raises `GradientNotAvailable`.

    Other tensors keep torch's own ``.grad``; nnsight's backward block replaces it for its duration
    and puts this one back.
    """
    global _depth, _replaced
    with _lock:
        if _depth == 0 and _torchs_own(torch.Tensor.__dict__.get("grad")):
            _replaced = "grad" in torch.Tensor.__dict__
            torch.Tensor.grad = _FORWARD_GRAD
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and torch.Tensor.__dict__.get("grad") is _FORWARD_GRAD:
                if _replaced:
                    torch.Tensor.grad = _GRAD
                else:
                    del torch.Tensor.grad


def _named_grad_property(interleaver: Any, seen: set, hooks: list) -> property:
    """nnsight's backward ``.grad``, with a named error where a served value's gradient never comes, a write checked
    as a value's write is (`check_gradient_write`), and a read-only gradient (`refuse_gradient_write`) refused
    when it is edited in place, as when it is assigned."""
    inner = _nnsight_grad_property(interleaver, seen, hooks)

    def getter(tensor: torch.Tensor) -> Any:
        _refused(tensor)
        attributes = tensor.__dict__ if hasattr(tensor, "__dict__") else {}
        read_only = attributes.get(READ_ONLY)
        location = f"{id(tensor)}.grad"
        occurrence = Mediator.current(location).wanted(location) if read_only is not None else None
        try:
            grad = inner.fget(tensor)
        except OutOfOrderError as error:
            name = attributes.get(MARK)
            if name is None:
                raise
            raise GradientNotAvailable(
                f"{name}.grad: the backward never reached it. Either the loss does not depend on it "
                f"(a value read after what the loss is computed from, or in another trace), or a gradient "
                f"of a value the forward computed earlier was asked before it: ask gradients in the reverse "
                f"of the forward order."
            ) from error
        if read_only is not None and isinstance(grad, torch.Tensor):
            _refuse_edits(grad, f"{attributes.get(MARK, 'this value')}.grad", read_only, location, occurrence)
        return grad

    def setter(tensor: torch.Tensor, value: Any) -> None:
        _refused(tensor)
        attributes = tensor.__dict__ if hasattr(tensor, "__dict__") else {}
        name = f"{attributes.get(MARK, 'this tensor')}.grad"
        if attributes.get(READ_ONLY) is not None:
            raise InvalidWrite(f"{name} was written, but {attributes[READ_ONLY]}")
        inner.fset(tensor, check_gradient_write(value, tensor, name))

    return property(getter, setter)


def check_gradient_write(value: Any, tensor: torch.Tensor, name: str) -> torch.Tensor:
    """``value`` as the gradient of ``tensor`` (broadcast to its shape), or `InvalidWrite` naming ``name`` and what a
    gradient of it is: a tensor of its shape (or one that broadcasts to it), dtype and device. Without the check,
    torch's hook raises ``hook 'hook' has changed the size/type of value`` from inside the backward, ``expected
    Variable`` for a number, and ``None`` is silently kept as no change."""
    expects = f"It takes a tensor of shape {tuple(tensor.shape)}, dtype {tensor.dtype}, on {tensor.device}"
    if value is None:
        raise InvalidWrite(
            f"{name} was assigned None, which would leave the gradient as it is (a gradient cannot be removed). "
            f"To stop it, write zeros: value.grad = torch.zeros_like(value.grad). {expects}."
        )
    if not isinstance(value, torch.Tensor):
        raise InvalidWrite(f"{name} was assigned a {type(value).__name__}. {expects} (or one that broadcasts to it), "
                           f"e.g. torch.full_like(value.grad, {value!r})."[:600])
    try:
        fits = torch.broadcast_shapes(value.shape, tensor.shape) == tensor.shape
    except RuntimeError:
        fits = False
    problems = [] if fits else [f"shape {tuple(value.shape)} does not broadcast to {tuple(tensor.shape)}"]
    if value.dtype != tensor.dtype:
        problems.append(f"dtype {value.dtype} is not {tensor.dtype} (use .to({tensor.dtype}))")
    if value.device != tensor.device:
        problems.append(f"device {value.device} is not {tensor.device} (use .to('{tensor.device}'))")
    if problems:
        raise InvalidWrite(f"{name} cannot take the gradient written to it: {'; '.join(problems)}. {expects}.")
    return value if value.shape == tensor.shape else value.expand(tensor.shape).contiguous()


def same_bits(tensor: torch.Tensor, kept: torch.Tensor) -> bool:
    """Whether ``tensor`` holds exactly ``kept``'s bits (NaN equal to itself, ``-0.0`` not to ``0.0``)."""
    if tensor.shape != kept.shape or tensor.dtype != kept.dtype:
        return False
    if tensor.dtype.is_floating_point and tensor.element_size() in _BITS:
        as_bits = _BITS[tensor.element_size()]
        return torch.equal(tensor.detach().view(as_bits), kept.view(as_bits))
    return torch.equal(tensor.detach(), kept)


#: An integer dtype of each float width, to compare floats bit for bit.
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _refuse_edits(grad: torch.Tensor, name: str, reason: str, location: str, occurrence: int | None) -> None:
    """Refuse an in-place edit of the read-only gradient ``grad`` when the block moves on: in place (``g[:] = 0``),
    through ``.data`` or any other view, it would not reach what the model computes from the value either."""
    kept = grad.detach().clone()
    mediator = Mediator.current(location)

    def check() -> torch.Tensor:
        if not same_bits(grad, kept):
            raise InvalidWrite(f"{name} was edited in place, but {reason}")
        return grad

    mediator.transform = WriteBack(check, grad, None, location, occurrence)


_nnsight_grad_property = _backward._grad_property
_backward._grad_property = _named_grad_property
