"""`verify`: run every check on a model and say, per layer and value, whether it is proved."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from ..quantization import precision
from .checks import CHECKS
from .checks.base import PRECISION, Check, CheckResult, raised
from .checks.references import shared_copies


class _Doubts:
    """Which (layer, value) pairs some results cover, and the failed results that put each in doubt."""

    def __init__(self, results: list[CheckResult]) -> None:
        alone = {(r.layer, value) for r in results if not r.passed for value in r.values if len(r.values) == 1}
        held = {(r.layer, value) for r in results if r.passed for value in r.values}
        self.failed: dict[tuple[int | None, str], list[CheckResult]] = {}
        self.covered: set[tuple[int | None, str]] = set()
        for result in results:
            for value in result.values:
                self.covered.add((result.layer, value))
            if result.passed:
                continue
            raised = result.error is None and result.tolerance is None  # nothing measured: all in doubt
            doubted = list(result.values) if raised else (
                [v for v in result.values if (result.layer, v) in alone]
                or [v for v in result.values if (result.layer, v) not in held]
                or list(result.values)
            )
            for value in doubted:
                self.failed.setdefault((result.layer, value), []).append(result)


@dataclass
class Verdict:
    """The results of the checks on one model, and what they prove.

    A value is proved on a layer when some check covered it there and every check that covers it
    held. A failed check that covers several values (the identity covers all of a block's
    contributions; the probabilities check, the probabilities and the heads) puts in doubt those of
    them that failed a check of their own; where none did, those that no check that held covers;
    where every one is covered by a check that held, all of them. A check that raised (measured
    nothing) puts all its values in doubt.

    A value's gradient (``value.grad``) is proved the same way by the gradient checks alone
    (``gradient=True`` in each method); the value itself by the other checks alone.
    """

    results: list[CheckResult]

    def __post_init__(self) -> None:
        self._doubts = {kind: _Doubts([r for r in self.results if r.gradient == kind]) for kind in (False, True)}

    def failures(self, layer: int | None, value: str, gradient: bool = False) -> list[CheckResult]:
        """The failed checks that put ``value`` on ``layer`` (``None``: a model-level value) in doubt
        (``gradient``: its gradient)."""
        return self._doubts[gradient].failed.get((layer, value), [])

    def proved(self, layer: int | None, value: str, gradient: bool = False) -> bool:
        """Whether a check covered ``value`` on ``layer`` and every check covering it held (``gradient``:
        the gradient checks, for ``value.grad``)."""
        return self.covered(layer, value, gradient) and not self.failures(layer, value, gradient)

    def covered(self, layer: int | None, value: str, gradient: bool = False) -> bool:
        """Whether some check covered ``value`` on ``layer`` (``gradient``: some gradient check)."""
        return (layer, value) in self._doubts[gradient].covered

    def why_not(self, layer: int | None, value: str, gradient: bool = False) -> str | None:
        """Why ``value`` (``gradient``: its gradient) is not proved on ``layer`` (the failed checks and their
        numbers), or ``None``."""
        failures = self.failures(layer, value, gradient)
        if failures:
            return "; ".join(result.describe() for result in failures)
        if not self.covered(layer, value, gradient):
            return "no gradient check covered it" if gradient else "no check covered it"
        return None

    @property
    def passed(self) -> bool:
        """Whether every check held."""
        return all(result.passed for result in self.results)

    def failed(self) -> list[CheckResult]:
        """The checks that did not hold."""
        return [result for result in self.results if not result.passed]

    def table(self) -> str:
        """One line per check result."""
        return "\n".join(result.describe() for result in self.results)

    def to_list(self) -> list[dict]:
        """As plain data (the proof cache)."""
        return [result.to_dict() for result in self.results]

    @classmethod
    def from_list(cls, data: Iterable[dict]) -> Verdict:
        """The inverse of `to_list`."""
        return cls([CheckResult.from_dict(item) for item in data])


def verify(model: Any, checks: Sequence[Check] | None = None) -> Verdict:
    """Run ``checks`` (default: every check, `nncanon.proof.checks.CHECKS`) on ``model``.

    ``model`` is a `StandardizedTransformer` in fp32 with a tokenizer (a twin, a registry variant, or
    any model small enough to run the checks). Runs several dozen short forwards; changes nothing.

    Example:
        >>> verdict = verify(tiny_model("llama"))
        >>> verdict.passed, verdict.proved(0, "attention_output"), verdict.proved(0, "mlp_output", gradient=True)
        (True, True, True)
        >>> print(verdict.table())      # one line per check, with the measured error
    """
    results: list[CheckResult] = []
    token = PRECISION.set(precision(model._module))  # every bar scales with the model's format (one rule)
    try:
        with shared_copies():
            for check in checks if checks is not None else CHECKS:
                try:
                    found = check.run(model)
                except Exception as error:  # a check that cannot run proves nothing: its values are declined
                    found = raised(model, check.name, error)
                results += [replace(result, gradient=True) for result in found] if check.gradient else found
    finally:
        PRECISION.reset(token)
    return Verdict(results)
