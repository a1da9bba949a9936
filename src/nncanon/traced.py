"""What a trace's code gets wrong, named: a value used outside a trace, an in-place write that does not fit, and a
backward of a trace that tracks no gradients.

Values exist while the model runs. Outside a trace, ``model.layers[i].<value>`` is an `OutsideTrace`: a reference
that says which value it is, so ``hasattr(model.layers[0].self_attn, "query_states")`` answers whether the block
serves it (a declined value raises `ValueNotAvailable`, an ``AttributeError``: ``False``), and any use of it (its
data, ``.save()``, indexing, arithmetic, a torch function) raises `NotInTrace`. A write outside a trace raises
`NotInTrace` at once; so does a read inside a trace that runs nothing (no input and no invoke).

A trace's code that fails inside torch is renamed where nncanon can say what the user did (`renamed`): an in-place
write (``value[...] = t``, ``value += t``, ``value.copy_(t)``) torch refuses becomes `InvalidWrite` naming the line
and the served values written there; ``with loss.backward():`` (or ``loss.backward()``) in a trace under
``torch.no_grad()`` or ``torch.inference_mode()`` becomes `GradientNotAvailable`.
"""

from __future__ import annotations

import dis
import linecache
import re
from types import TracebackType
from typing import Any, NoReturn

import torch
from nnsight.intervention.interleaver import Mediator

from .errors import GradientNotAvailable, InvalidWrite, NncanonError, NotInTrace
from .gradients import MARK
from .threads import trace_lock

#: What to do instead, in every message about a value outside a trace.
_INSIDE = ("Values exist only while the model runs: inside `with model.trace(prompt):` (`.save()` a value there to "
           "keep it after the block)")


class OutsideTrace:
    """A standard value asked for outside a trace: it names the value, and any use of it raises `NotInTrace`.

    ``hasattr`` answers ``True`` for it (the block serves the value); ``repr`` says what it is.
    """

    __slots__ = ("_label",)

    def __init__(self, label: str) -> None:
        object.__setattr__(self, "_label", label)

    def __repr__(self) -> str:
        return f"<{self._label}: a value served inside model.trace(...) only>"

    def _refuse(self, *args: Any, **kwargs: Any) -> NoReturn:
        raise NotInTrace(f"{self._label} was used outside a trace (it was read outside one). {_INSIDE}.")

    def __getattr__(self, name: str) -> NoReturn:
        if name.startswith("__") and name.endswith("__"):  # a protocol probed by a library (copy, IPython): none
            raise AttributeError(name)
        self._refuse()

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> NoReturn:
        placeholder = next(a for a in (*args, *(kwargs or {}).values()) if isinstance(a, OutsideTrace))
        placeholder._refuse()

    __setattr__ = __delattr__ = __getitem__ = __setitem__ = __delitem__ = _refuse
    __iter__ = __len__ = __bool__ = __float__ = __int__ = __index__ = __complex__ = __array__ = _refuse
    __contains__ = __call__ = __neg__ = __pos__ = __abs__ = __invert__ = __round__ = _refuse
    __lt__ = __le__ = __eq__ = __ne__ = __gt__ = __ge__ = _refuse
    __hash__ = object.__hash__
    save = _refuse  # (nnsight gives every object a .save(), which would say only "outside a trace")


for _operator in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "matmul", "and", "or", "xor", "lshift",
                  "rshift"):
    for _form in ("__{}__", "__r{}__", "__i{}__"):  # (a binary operator on it, either side, or in place)
        setattr(OutsideTrace, _form.format(_operator), OutsideTrace._refuse)


def outside_trace(model: Any, label: str) -> OutsideTrace | None:
    """``None`` where the code runs in a trace's worker (values can be read); else the `OutsideTrace` of ``label``.
    (``model``: the model the value is of, ``None`` where the host does not know it.)

    Raises:
        NotInTrace: inside a trace of ``model`` that runs nothing (``model.trace()`` with no invoke).
    """
    try:
        Mediator.current(label)
        return None
    except ValueError:
        pass
    if model is not None and trace_lock(model)._is_owned():
        raise NotInTrace(f"{label} was read in a trace that runs nothing: {_NOTHING}")
    return OutsideTrace(label)


def refuse_outside_trace(model: Any, what: str) -> None:
    """Raise `NotInTrace` unless the code runs in a trace's worker (``what``: the write or the tool, named)."""
    if outside_trace(model, what) is not None:
        raise NotInTrace(f"{what} outside a trace. {_INSIDE}.")


_NOTHING = ("model.trace() was given no input and opened no invoke, so the model never ran. Give it a prompt, "
            "`with model.trace(prompt):`, or open an invoke inside: `with model.trace() as tracer:` then "
            "`with tracer.invoke(prompt):`.")


def renamed(error: BaseException) -> Exception | None:
    """The nncanon error for ``error``, raised by a trace's code, where it says more (``None``: keep ``error``)."""
    if isinstance(error, NncanonError) or not isinstance(error, RuntimeError):
        return None
    text = str(error)
    if not torch.is_grad_enabled() or torch.is_inference_mode_enabled():
        if "backward session" in text or "does not require grad and does not have a grad_fn" in text:
            mode = "torch.inference_mode()" if torch.is_inference_mode_enabled() else "torch.no_grad()"
            return GradientNotAvailable(
                f"a backward was asked in a trace run under {mode}: the forward tracked no gradients, so there is "
                f"no graph to run it on. Open the trace without {mode} (`with model.trace(prompt):`), read the "
                f"values there, and ask `with loss.backward(): grad = value.grad.save()`."
            )
    failed = _failed_in_place_write(error.__traceback__)
    if failed is not None:
        line, targets = failed
        return InvalidWrite(
            f"the in-place write {line} failed: {text.splitlines()[0] if text else type(error).__name__}.{targets} A "
            "write in place takes a tensor that broadcasts to the elements it selects (the values' shapes: "
            "docs/surface.md); assign the whole value (`component.value = tensor`) to have it checked against what it "
            "expects."
        )
    return None


def _failed_in_place_write(traceback: TracebackType | None) -> tuple[str, str] | None:
    """``(at file:line (`source`), what the served values written there are)`` where the innermost frame of
    ``traceback`` failed on a subscript store, an augmented assignment or an in-place method (``x[...] = t``,
    ``x += t``, ``x.copy_(t)``), else ``None``."""
    if traceback is None:
        return None
    while traceback.tb_next is not None:
        traceback = traceback.tb_next
    code = traceback.tb_frame.f_code
    instruction = next((i for i in dis.get_instructions(code) if i.offset == traceback.tb_lasti), None)
    if instruction is None:
        return None
    source = linecache.getline(code.co_filename, traceback.tb_lineno).strip()
    augmented = instruction.opname.startswith("INPLACE_") or (
        instruction.opname == "BINARY_OP" and instruction.argrepr.endswith("="))
    method = instruction.opname.startswith(("CALL", "PRECALL")) and _IN_PLACE_METHOD.search(source) is not None
    if instruction.opname not in ("STORE_SUBSCR", "STORE_SLICE") and not augmented and not method:
        return None
    line = f"at {code.co_filename}:{traceback.tb_lineno}" + (f" (`{source}`)" if source else "")
    return line, _served_in(traceback.tb_frame.f_locals, source)


#: An in-place tensor method called on a line (``.copy_(``, ``.add_(``, ``torch.nn.init.zeros_(``).
_IN_PLACE_METHOD = re.compile(r"\.[a-z][a-z0-9_]*_\(")


def _served_in(names: dict, source: str) -> str:
    """`` x is layers[0].mlp.mlp_output [1, 10, 32] float32.`` for each local named on ``source`` that holds a
    served value (empty where none does)."""
    named = set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", source))
    found = [f" `{name}` is {getattr(value, MARK)} {list(value.shape)} {str(value.dtype).removeprefix('torch.')}."
             for name, value in names.items()
             if name in named and isinstance(value, torch.Tensor) and getattr(value, MARK, None) is not None]
    return "".join(found)
