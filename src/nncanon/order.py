"""The order a trace reads values in, and the skips it makes: nnsight's ``OutOfOrderError``, named.

nnsight serves the values of one trace as the forward computes them. A value asked for after the
forward ran past it raises nnsight's ``OutOfOrderError`` naming an internal location
(``'model.model.layers.0.output.i0'``). `translated` names instead the value read too late, the value
read just before it and the order this model computes its values in (`block_order`); a value of a
block that a ``skip_layers`` of the same trace removed is an `InvalidSkip` naming both calls.

The reads and skips of a trace are noted on nnsight's ``Mediator`` (one per invoke), so they live
exactly as long as the trace.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from .errors import InvalidSkip, OutOfOrderRead


@dataclass(frozen=True)
class SkipRecord:
    """One ``skip_layers`` call of a trace: blocks ``start..end`` (inclusive) at generation ``step``."""

    start: int
    end: int
    step: int

    @property
    def call(self) -> str:
        return f"skip_layers({self.start}, {self.end})"

    def removes(self, label: str) -> bool:
        """Whether the value ``label`` (``"layers[2].mlp.mlp_output"``) has no value under this skip."""
        layer = layer_of(label)
        if layer is None or not self.start <= layer <= self.end:
            return False
        return label not in (f"layers[{self.start}].layer_input", f"layers[{self.end}].layer_output")


def skips(mediator: Any) -> list[SkipRecord]:
    """The skips this invoke made so far, in call order."""
    return mediator.__dict__.setdefault("_nncanon_skips", [])


def note_read(mediator: Any, label: str) -> None:
    """Remember ``label`` as the last value this invoke read (for the out-of-order message)."""
    mediator.__dict__["_nncanon_last_read"] = label


def layer_of(label: str) -> int | None:
    """The block index of a value label (``"layers[3].self_attn.attention_output"`` -> 3)."""
    found = re.match(r"layers\[(\d+)\]", label)
    return int(found.group(1)) if found else None


#: Where the model-level values fall in the order a model computes its values.
MODEL_ORDER = ("model.token_embeddings and position_embeddings come before layers[0]; model.final_norm_output, "
               "logits and next_token_probs come last")


def block_order(components: list[str], layer: int, count: int, model_type: str) -> str:
    """The sentence saying in which order this model computes block ``layer``'s values."""
    inside = ", then ".join(["layer_input", *components, "layer_output"])
    return (
        f"this {model_type} model computes its values block by block, layers[0] to layers[{count - 1}], "
        f"and inside layers[{layer}]: {inside}; {MODEL_ORDER}"
    )


def translated(error: Exception, mediator: Any, label: str, order: str) -> Exception:
    """The nncanon error for nnsight's ``error``, raised reading ``label`` (``order``: `block_order`'s sentence)."""
    for record in skips(mediator):
        if record.removes(label):
            return InvalidSkip(
                f"{label} was read after {record.call} in the same trace: that skip removes blocks "
                f"{record.start}..{record.end}, so {label} is never computed. Read it in another trace, "
                f"or skip fewer blocks (layers[{record.start}].layer_input and "
                f"layers[{record.end}].layer_output are still served)."
            )
    last = mediator.__dict__.get("_nncanon_last_read")
    for record in skips(mediator):
        if last == record.call:  # the skip read the stream entering its first block: the model ran on to it
            return OutOfOrderRead(
                f"{label} was read after {record.call} in the same trace: to skip, the model ran on to "
                f"layers[{record.start}].layer_input (the stream the skip passes on), past {label} ({error}). "
                f"Read values of blocks before layers[{record.start}] before calling {record.call}, or in another "
                "trace or invoke."
            )
    after = f", after {last}," if last is not None and last != label else ""
    return OutOfOrderRead(
        f"{label} was read{after} when the model had already computed it and moved on ({error}). "
        f"Inside one trace, read values in the order the model computes them: {order}. "
        "Read the earlier value first, or read the later one in another trace or invoke."
    )
