"""What every standard component shares: its bindings to the model and its reasons to decline."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Optional, Union

from ..errors import ValueNotAvailable
from ..served import Binding

#: A reason a value is not served: a fixed sentence, or a function that says it now (``None``: served).
Reason = Union[str, Callable[[], Optional[str]]]  # noqa: UP007, UP045 - a runtime alias, kept 3.10-safe


@dataclass
class ComponentState:
    """One component of one block, as mounted on a model.

    Attributes:
        where: Its name in messages (``"layers[3].self_attn"``).
        bindings: The values it serves, by standard name.
        reasons: Values it does not serve, by standard name, with the reason.
        absent: Those of ``reasons`` the component does not have at all (a dense MLP's routing, an
            MLP without a shared expert, a mixer without heads): not served, but not declined either.
        probabilities: For attention, the source-operation path to the probabilities
            (``None``: found through transformers' attention interface).
        gradient_reasons: Values it serves whose gradient (``value.grad``) it does not, with the reason.
        kernel: For attention, its kernel call (`nncanon.components.kernel.Kernel`), or why it has none.
        anatomy: For a dense MLP, where it keeps its neurons (`nncanon.families.MLPAnatomy`), ``None`` elsewhere.
        norms: The norm values it serves (`nncanon.components.norms.NormBinding`), by standard name.
    """

    where: str
    bindings: dict[str, Binding] = field(default_factory=dict)
    reasons: dict[str, Reason] = field(default_factory=dict)
    absent: set[str] = field(default_factory=set)
    probabilities: tuple[str, ...] | None = None
    gradient_reasons: dict[str, Reason] = field(default_factory=dict)
    kernel: Any = None
    anatomy: Any = None
    norms: dict[str, Any] = field(default_factory=dict)

    def reason(self, name: str) -> str | None:
        """Why ``name`` is not served here, or ``None`` when it is."""
        reason = self.reasons.get(name)
        if callable(reason):
            return reason()
        return reason

    def gradient_reason(self, name: str) -> str | None:
        """Why ``name``'s gradient is not served here, or ``None`` when it is (or ``name`` is not served)."""
        reason = self.gradient_reasons.get(name)
        if callable(reason):
            return reason()
        return reason

    @classmethod
    def deferred(cls, where: str, make: tuple[Callable[..., dict[str, Binding]], tuple], reasons: dict[str, Reason],
                 absent: set[str], probabilities: tuple[str, ...] | None = None,
                 kernel: Any = None, anatomy: Any = None, norms: dict | None = None) -> ComponentState:
        """A state whose ``bindings`` are made at their first use, by ``make[0](*make[1])``.

        A load mounts ~10 bindings a block and a script reads a few: `nncanon.mounting.mount` defers
        them where making them later changes nothing (no operation hooks to install at load). The state
        is then the state made at once, field for field: reading ``bindings`` makes them, and a pickle or
        a copy (a remote request) makes them first.
        """
        state = cls.__new__(cls)
        state.__dict__.update(where=where, reasons=reasons, absent=absent, probabilities=probabilities,
                              gradient_reasons={}, kernel=kernel, anatomy=anatomy, norms=norms or {}, _make=make)
        return state

    def __getattr__(self, name: str) -> Any:
        make = self.__dict__.get("_make") if name == "bindings" else None
        if make is None:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        made = self.__dict__.setdefault("bindings", make[0](*make[1]))  # a thread that made them first wins
        self.__dict__.pop("_make", None)
        return made

    def __getstate__(self) -> dict:
        self.bindings  # noqa: B018 - made before the state travels
        return self.__dict__


class Component:
    """Mixin for the objects that serve standard values: envoys of blocks, attention, MLP.

    The values are class attributes (`served` descriptors and properties); what each one
    reads on this block is in ``self._nncanon`` (a `ComponentState`), set when the model
    is mounted.
    """

    #: The standard values this component serves, in execution order.
    standard_values: tuple[str, ...] = ()
    #: Its name on a block (``"self_attn"``, ``"linear_attn"``, ``"mlp"``; ``""``: the block itself).
    role: str = ""

    def _nncanon_state(self, name: str) -> ComponentState:
        state = self.__dict__.get("_nncanon")
        if state is None:
            raise ValueNotAvailable(
                f"{name!r} is a standard value, served only on a model loaded with "
                "nncanon.StandardizedTransformer."
            )
        return state

    def _nncanon_binding(self, name: str) -> Binding | None:
        state = self._nncanon_state(name)
        reason = state.reason(name)
        if reason is not None:
            raise ValueNotAvailable(f"{state.where}.{name} is not available: {reason}")
        return state.bindings.get(name)

    def _nncanon_norm(self, name: str) -> Any:
        """The `nncanon.components.norms.NormBinding` of norm value ``name``, or `ValueNotAvailable` with the reason."""
        state = self._nncanon_state(name)
        reason = state.reason(name)
        if reason is not None or name not in state.norms:
            raise ValueNotAvailable(f"{state.where}.{name} is not available: {reason or 'this block has no such norm'}")
        return state.norms[name]

    def _nncanon_gradient_reason(self, name: str) -> str | None:
        """Why ``name``'s gradient is not served here (`nncanon.mounting.decline_gradient`), or ``None``."""
        return self._nncanon_state(name).gradient_reason(name)

    def __getattr__(self, name: str) -> Any:
        # A served value that raised ValueNotAvailable lands here (it is an AttributeError):
        # raise its reason again rather than nnsight's generic "no attribute" (a reason met while reading
        # the value, kept by the value's property in ``_nncanon_raised``, else the binding's).
        if name in type(self).standard_values:
            raised = self.__dict__.pop("_nncanon_raised", None)
            if raised is not None:
                raise raised
            if name in self._nncanon_state(name).norms:
                self._nncanon_norm(name)
            self._nncanon_binding(name)
        elif (owner := _role_serving(name)) is not None:  # a standard value of another component
            try:
                return super().__getattr__(name)  # (the module's own attribute of that name, if it has one)
            except AttributeError:
                pass
            where = self._nncanon_state(name).where
            block = where.split(".")[0]
            place = f"{block}.{owner}" if owner else block
            raise ValueNotAvailable(
                f"{where}.{name} does not exist: {name} is a value of {place}, not of {where}. "
                f"Read model.{place}.{name}."
            )
        return super().__getattr__(name)


def _role_serving(name: str) -> str | None:
    """The role (`Component.role`) of the component whose standard values include ``name``, or ``None``."""
    pending, seen = list(Component.__subclasses__()), set()
    while pending:
        cls = pending.pop()
        if cls in seen:
            continue
        seen.add(cls)
        if name in cls.__dict__.get("standard_values", ()):
            return cls.role
        pending.extend(cls.__subclasses__())
    return None
