"""Which blocks are of which kind, as a rule of the config: `layout_rule`.

A family whose blocks differ (a hybrid's attention and mixer blocks, dense layers before MoE ones)
needs ``layout_of(config, layer) -> kind`` that holds for the twin's config and for the original's.
The rule is read from the config: a per-layer list whose entries split the blocks as the inferred
kinds do (``layer_types``, ``layers_block_type``, a pattern string), or a count of leading blocks of
one kind (``first_k_dense_replace``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ByList:
    """The kind of block ``layer`` is ``kinds[config.<attribute>[layer]]``."""

    attribute: str
    kinds: tuple[tuple[Any, str], ...]

    def __call__(self, config: Any, layer: int) -> str:
        return dict(self.kinds)[getattr(config, self.attribute)[layer]]

    def source(self) -> str:
        return f"lambda config, layer: {dict(self.kinds)!r}[config.{self.attribute}[layer]]"


@dataclass(frozen=True)
class Leading:
    """The first ``config.<attribute>`` blocks are of kind ``first``, the others of kind ``rest``."""

    attribute: str
    first: str
    rest: str

    def __call__(self, config: Any, layer: int) -> str:
        return self.first if layer < (getattr(config, self.attribute) or 0) else self.rest

    def source(self) -> str:
        return f"lambda config, layer: {self.first!r} if layer < (config.{self.attribute} or 0) else {self.rest!r}"


@dataclass(frozen=True)
class Listed:
    """Blocks whose index is in ``config.<attribute>`` are of kind ``listed``, the others of kind ``rest``."""

    attribute: str
    listed: str
    rest: str

    def __call__(self, config: Any, layer: int) -> str:
        return self.listed if layer in (getattr(config, self.attribute) or ()) else self.rest

    def source(self) -> str:
        return f"lambda config, layer: {self.listed!r} if layer in (config.{self.attribute} or ()) else {self.rest!r}"


def layout_rule(config: Any, kinds: list[str]) -> ByList | Leading | Listed | None:
    """A rule of ``config`` giving block ``j`` the kind ``kinds[j]``, or ``None`` where none does."""
    count = len(kinds)
    values = config.to_dict()
    for name, value in sorted(values.items()):
        if isinstance(value, (list, tuple, str)) and len(value) == count:
            mapping: dict = {}
            try:
                if all(mapping.setdefault(entry, kind) == kind for entry, kind in zip(value, kinds, strict=False)):
                    return ByList(name, tuple(mapping.items()))
            except TypeError:  # unhashable entries
                continue
    if len(set(kinds)) == 2:
        for name, value in sorted(values.items()):
            if isinstance(value, (list, tuple)) and value and all(isinstance(v, int) for v in value):
                inside = {kinds[j] for j in range(count) if j in value}
                outside = {kinds[j] for j in range(count) if j not in value}
                if len(inside) == 1 and len(outside) == 1 and inside != outside:
                    return Listed(name, inside.pop(), outside.pop())
    first = kinds[0]
    lead = next((j for j, kind in enumerate(kinds) if kind != first), count)
    if lead < count and all(kind == kinds[lead] for kind in kinds[lead:]):
        for name, value in sorted(values.items()):
            leading_name = any(word in name for word in ("dense", "first", "start", "replace"))
            if isinstance(value, int) and not isinstance(value, bool) and value == lead and leading_name:
                return Leading(name, first, kinds[lead])
    return None
