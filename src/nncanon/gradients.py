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
from nnsight.intervention.interleaver import OutOfOrderError

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
    """nnsight's backward ``.grad``, with a named error where a served value's gradient never comes."""
    inner = _nnsight_grad_property(interleaver, seen, hooks)

    def getter(tensor: torch.Tensor) -> Any:
        _refused(tensor)
        try:
            return inner.fget(tensor)
        except OutOfOrderError as error:
            name = tensor.__dict__.get(MARK) if hasattr(tensor, "__dict__") else None
            if name is None:
                raise
            raise GradientNotAvailable(
                f"{name}.grad: the backward never reached it. Either the loss does not depend on it "
                f"(a value read after what the loss is computed from, or in another trace), or a gradient "
                f"of a value the forward computed earlier was asked before it: ask gradients in the reverse "
                f"of the forward order."
            ) from error

    def setter(tensor: torch.Tensor, value: Any) -> None:
        _refused(tensor)
        attributes = tensor.__dict__ if hasattr(tensor, "__dict__") else {}
        if attributes.get(READ_ONLY) is not None:
            raise InvalidWrite(f"{attributes.get(MARK, 'this value')}.grad was written, but {attributes[READ_ONLY]}")
        inner.fset(tensor, value)

    return property(getter, setter)


_nnsight_grad_property = _backward._grad_property
_backward._grad_property = _named_grad_property
