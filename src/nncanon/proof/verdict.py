"""`verify`: run every check on a model and say, per layer and value, whether it is proved."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from .checks import CHECKS, Check, CheckResult, raised


@dataclass
class Verdict:
    """The results of the checks on one model, and what they prove.

    A value is proved on a layer when some check covered it there and every check that covers it
    held. A failed check that covers several values (the identity covers all of a block's
    contributions; the probabilities check, the probabilities and the heads) puts in doubt those of
    them that failed a check of their own; where none did, those that no check that held covers;
    where every one is covered by a check that held, all of them. A check that raised (measured
    nothing) puts all its values in doubt.
    """

    results: list[CheckResult]

    def __post_init__(self) -> None:
        alone = {(r.layer, value) for r in self.results if not r.passed for value in r.values if len(r.values) == 1}
        held = {(r.layer, value) for r in self.results if r.passed for value in r.values}
        self._failed: dict[tuple[int | None, str], list[CheckResult]] = {}
        self._covered: set[tuple[int | None, str]] = set()
        for result in self.results:
            for value in result.values:
                self._covered.add((result.layer, value))
            if result.passed:
                continue
            raised = result.error is None and result.tolerance is None  # nothing measured: all in doubt
            doubted = list(result.values) if raised else (
                [v for v in result.values if (result.layer, v) in alone]
                or [v for v in result.values if (result.layer, v) not in held]
                or list(result.values)
            )
            for value in doubted:
                self._failed.setdefault((result.layer, value), []).append(result)

    def failures(self, layer: int | None, value: str) -> list[CheckResult]:
        """The failed checks that put ``value`` on ``layer`` (``None``: a model-level value) in doubt."""
        return self._failed.get((layer, value), [])

    def proved(self, layer: int | None, value: str) -> bool:
        """Whether a check covered ``value`` on ``layer`` and every check covering it held."""
        return (layer, value) in self._covered and not self.failures(layer, value)

    def covered(self, layer: int | None, value: str) -> bool:
        """Whether some check covered ``value`` on ``layer``."""
        return (layer, value) in self._covered

    def why_not(self, layer: int | None, value: str) -> str | None:
        """Why ``value`` is not proved on ``layer`` (the failed checks and their numbers), or ``None``."""
        failures = self.failures(layer, value)
        if failures:
            return "; ".join(result.describe() for result in failures)
        if not self.covered(layer, value):
            return "no check covered it"
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
        >>> verdict.passed, verdict.proved(0, "attention_output")
        (True, True)
        >>> print(verdict.table())      # one line per check, with the measured error
    """
    results: list[CheckResult] = []
    for check in checks if checks is not None else CHECKS:
        try:
            results += check.run(model)
        except Exception as error:  # a check that cannot run proves nothing: its values are declined
            results += raised(model, check.name, error)
    return Verdict(results)
