"""What every check shares: the result record and its comparison, the bars, the groups of values, `Check`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

import torch

from ...components.kernel import STATES
from ...model_sites import MODEL_SITES
from ...support import COMPONENTS, LAYER_VALUES

#: Sums of fp32 tensors computed in another order than the model's (a parallel block adds its
#: sublayers in one expression) agree to about 1e-8; this is the bar, relative and absolute.
TOLERANCE = 1e-5


#: The one rule by which every bar scales with the format a model computes in: a nonzero bar (relative or
#: absolute) is at least this many units of roundoff of that format (`nncanon.quantization.precision`: float32
#: 1.2e-7, so its bars stay as written; float16 9.8e-4 and bfloat16 7.8e-3, so at least 7.8e-3 and 6.3e-2;
#: bitsandbytes' int8 matmul 2^-7). A bit-for-bit check (bar 0) stays bit for bit in every format.
ROUNDOFFS = 8


#: The unit roundoff of the format the model being verified computes in (`verify` sets it per model).
PRECISION: ContextVar[float] = ContextVar("nncanon_precision", default=float(torch.finfo(torch.float32).eps))


def scaled(bar: float) -> float:
    """``bar`` under the one rule (`ROUNDOFFS`): ``max(bar, ROUNDOFFS × PRECISION)``; 0 stays 0."""
    return max(bar, ROUNDOFFS * PRECISION.get()) if bar else 0.0


#: Per-head values.
HEAD_VALUES = ("attention_head_outputs", "linear_attention_head_outputs")


#: What a block's token mixers receive (the stream after the block's norm), and attention's inner site values.
INPUT_VALUES = ("attention_input", "linear_attention_input", "query_states_before_norm", "key_states_before_norm",
                "attention_gate")


#: The attention kernel's per-head inputs.
KERNEL_INPUTS = tuple(STATES)


#: The routing values of a mixture of experts.
ROUTING = ("router_logits", "expert_weights", "expert_indices")


#: Model-level values the checks prove (not per layer).
MODEL_VALUES = ("logits", "project_on_vocab", "skip_layers", "resume", *MODEL_SITES, "final_norm_scale",
                "final_normalized")


#: The values a gradient reaches (``expert_indices`` are integers).
GRADIENT_VALUES = tuple(v for v in LAYER_VALUES if v not in COMPONENTS and v != "expert_indices")


#: Gradients are compared at this relative bar and `GRADIENT_ABSOLUTE` (a backward sums in its own order).
GRADIENT_TOLERANCE = 1e-5


GRADIENT_ABSOLUTE = 1e-6


#: The logit whose gradients the gradient checks take: this token's, at the last position.
GRADIENT_TOKEN = 5


#: RWKV's recurrent state is updated in place when it caches: no backward runs through it then.
NO_CACHE = {"use_cache": False}


@dataclass(frozen=True)
class CheckResult:
    """One check on one layer (``None``: the whole model).

    Attributes:
        check: Its name (``"identity"``, ``"ablation"``...).
        layer: The layer it ran on, ``None`` for a model-level check.
        values: The values it proves (or, failed, puts in doubt).
        passed: Whether it held.
        error: The measured discrepancy (max absolute difference), where it has one.
        tolerance: The bar ``error`` is held to.
        note: What was compared, or what went wrong.
        gradient: Whether it proves the values' gradients (``value.grad``) rather than the values.
    """

    check: str
    layer: int | None
    values: tuple[str, ...]
    passed: bool
    error: float | None = None
    tolerance: float | None = None
    note: str = ""
    gradient: bool = False

    def describe(self) -> str:
        """One line: ``ablation on layers[1] (mlp_output): failed, error 3.1e-01 > 1e-05 (...)``."""
        where = "the model" if self.layer is None else f"layers[{self.layer}]"
        outcome = "held" if self.passed else "failed"
        figures = ""
        if self.error is not None:
            bar = "<=" if self.passed else ">"
            figures = f", error {self.error:.2e} {bar} {self.tolerance:.0e}" if self.tolerance is not None else (
                f", error {self.error:.2e}"
            )
        note = f" ({self.note})" if self.note else ""
        return f"{self.check} on {where} ({', '.join(self.values)}): {outcome}{figures}{note}"

    def to_dict(self) -> dict:
        """As plain data (the proof cache)."""
        return {
            "check": self.check,
            "layer": self.layer,
            "values": list(self.values),
            "passed": self.passed,
            "error": self.error,
            "tolerance": self.tolerance,
            "note": self.note,
            "gradient": self.gradient,
        }

    @classmethod
    def from_dict(cls, data: dict) -> CheckResult:
        """The inverse of `to_dict`."""
        return cls(
            data["check"], data["layer"], tuple(data["values"]), bool(data["passed"]), data.get("error"),
            data.get("tolerance"), data.get("note", ""), bool(data.get("gradient", False)),
        )


def compare(check: str, layer: int | None, values: Sequence[str], actual: torch.Tensor, expected: torch.Tensor,
             tolerance: float, note: str = "", absolute: float | None = None,
             magnitude: torch.Tensor | None = None) -> CheckResult:
    """``actual`` against ``expected``: max absolute difference within ``absolute`` (default ``tolerance``)
    plus ``tolerance`` relative to ``expected``, or to ``magnitude`` where larger (``actual`` a difference of
    tensors of that size, whose rounding is relative to them, not to the difference). Both bars scale with the
    model's format by the one rule (`scaled`)."""
    tolerance = scaled(tolerance)
    absolute = None if absolute is None else scaled(absolute)
    if actual.shape != expected.shape:
        return CheckResult(check, layer, tuple(values), False, None, tolerance,
                           f"shape {tuple(actual.shape)} where {tuple(expected.shape)} was expected")
    actual, expected = actual.detach(), expected.detach()  # (a gradient may carry a graph of its own)
    difference = (actual.double() - expected.double()).abs()
    error = float(difference.max()) if difference.numel() else 0.0
    size = expected.double().abs() if magnitude is None else torch.maximum(expected.double().abs(),
                                                                            magnitude.detach().double().abs())
    bar = (tolerance if absolute is None else absolute) + tolerance * size
    passed = bool((difference <= bar).all()) if tolerance else error == 0.0
    return CheckResult(check, layer, tuple(values), passed, error, tolerance, note)


def _failure(check: str, layer: int | None, values: Sequence[str], error: Exception) -> CheckResult:
    return CheckResult(check, layer, tuple(values), False, None, None, f"{type(error).__name__}: {error}"[:300])


def guarded(check: str, layer: int | None, values: Sequence[str], run: Callable[[], list[CheckResult]]
             ) -> list[CheckResult]:
    """``run()``, or one failed result naming the exception it raised."""
    try:
        return run()
    except Exception as error:
        return [_failure(check, layer, values, error)]


def shared_or_none(run: Callable[[], Any]) -> Any:
    """``run()`` (a run shared by several blocks or values), or ``None`` where it raises: each then runs alone, so
    that a failure is exactly its own."""
    try:
        return run()
    except Exception:
        return None


def raised(model: Any, check: str, error: Exception) -> list[CheckResult]:
    """A check that raised outside its own guards (the model's forward itself fails, say): one failed
    result per layer over every value the layer serves, and one over the model-level values."""
    report = model.support()
    results = []
    for layer in range(model.num_layers):
        values = [v for v in LAYER_VALUES if v not in COMPONENTS and report.available(v, layer=layer)]
        results.append(_failure(check, layer, values, error))
    return [*results, _failure(check, None, MODEL_VALUES, error)]


@dataclass(frozen=True)
class Check:
    """A named check and the function that runs it (`check` makes one of a ``check_...`` function).

    ``gradient``: it proves the values' gradients (``value.grad``), not the values: a value whose gradient
    check fails is served, its ``.grad`` is not.
    """

    name: str
    run: Callable[[Any], list[CheckResult]]
    doc: str = field(default="", compare=False)
    gradient: bool = False


def check(function: Callable[[Any], list[CheckResult]], gradient: bool = False) -> Check:
    """The `Check` of ``function`` (``check_heads`` is ``heads``), documented by its docstring's first paragraph."""
    doc = " ".join((function.__doc__ or "").split("\n\n")[0].split())
    return Check(function.__name__.removeprefix("check_"), function, doc, gradient)


def raised_or(found: torch.Tensor | Exception) -> torch.Tensor:
    if isinstance(found, Exception):
        raise found
    return found
