"""Several dictionaries of one block read in one invoke: served in the model's order, whichever order the trace's
code reads them in.

A trace reads the model as it runs: a read of a later site of a block passes the earlier ones, and a dictionary
read after that could no longer reach its point. So, before a dictionary's read passes the points of the other
dictionaries attached in its block, those are read first, in the order the model computes them (`arrange`): their
features are encoded and their splices handed to the model as it passes, and a later read of their features in
the same invoke is served from that visit (its edits reach the model while the model is still at its point; one
made after the model passed it is `InvalidWrite`, never lost silently: `nncanon.sae.splice`).

The order of a block's values is asked of the model once, when a dictionary is attached (`learn_order`: a
hybrid block runs its mixers in its own order, Falcon-H1 its linear mixer before attention); inside a trace the
plan is made from it without a forward.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ..reading import HOSTS
from .names import Point, in_block_order, mixers

#: The order a block's points are computed in, before the model is asked (`learn_order`): ``resid_mid`` reads
#: ``layer_input`` first (its edit reaches the model through the mixer's contribution, later).
EXECUTION_ORDER = ("layer_input", "resid_mid", "attention_normalized", "attention_input", "query_states_before_norm",
                   "key_states_before_norm", "query_states", "key_states", "value_states", "attention_gate",
                   "attention_head_outputs", "attention_output", "linear_attention_normalized",
                   "linear_attention_input", "linear_attention_head_outputs", "linear_attention_output",
                   "mlp_normalized", "mlp_input", "router_logits", "expert_weights", "expert_indices",
                   "shared_expert_output", "pre_activations", "linear_activations", "neurons", "mlp_module_output",
                   "mlp_output", "layer_output")

#: Standard values that place the MLP in a block's order (the first the block serves is probed with the MLP module's
#: input or output, which are not standard values).
_MLP_PLACES = ("mlp_output", "neurons", "pre_activations", "mlp_normalized")

#: The MLP's values, in their order in every MLP (the module's input and output among them).
_MLP_VALUES = ("mlp_normalized", "mlp_input", "router_logits", "expert_weights", "expert_indices",
               "shared_expert_output", "pre_activations", "linear_activations", "neurons", "mlp_module_output",
               "mlp_output")

#: Where a model keeps its blocks' learned orders (``model.__dict__``): layer -> the values, in the model's order.
ORDERS = "_nncanon_sae_block_orders"


def execution_rank(point: Point) -> tuple[int, int]:
    """A sort key that puts points in the order the model computes them (block, then value)."""
    return point.layer, _static(point.value)


def _static(value: str) -> int:
    return EXECUTION_ORDER.index(value) if value in EXECUTION_ORDER else len(EXECUTION_ORDER)


def sites(model: Any, point: Point) -> tuple[str, ...]:
    """The values reading ``point`` asks of the model, in the model's order (``resid_mid``: its parts)."""
    if point.value != "resid_mid":
        return (point.value,)
    return tuple(point.parts) or ("layer_input", *mixers(model, point.layer))


def learn_order(model: Any, layer: int, values: Sequence[str]) -> None:
    """Learn (outside a trace) the order block ``layer`` computes ``values`` in, with those learned before: a
    one-token trace for the standard values (once per set, `in_block_order`), the MLP module's input and output
    placed among the MLP's values (after its norm, before its contribution; one of them is probed with them)."""
    known = model.__dict__.setdefault(ORDERS, {})
    wanted = set(values) | set(known.get(layer, ()))
    if wanted - set(HOSTS):  # the MLP's place in the block, by a value of it (Zamba runs it before its mixer)
        report = model.support()
        wanted |= set([value for value in _MLP_PLACES if report.available(value, layer=layer)][:1])
    wanted = sorted(wanted, key=_static)
    standard = [value for value in wanted if value in HOSTS]
    ordered = list(in_block_order(model, layer, standard)) if len(standard) > 1 else standard
    for value in wanted:
        if value not in HOSTS:
            mlp = [i for i, other in enumerate(ordered) if other in _MLP_VALUES]
            later = [i for i in mlp if _static(ordered[i]) > _static(value)]
            at = later[0] if later else (mlp[-1] + 1 if mlp else len(ordered))
            ordered.insert(at, value)
    known[layer] = tuple(ordered)


def block_ranks(model: Any, layer: int) -> dict[str, int]:
    """``value -> position`` in block ``layer``'s learned order (empty before any dictionary was attached there)."""
    return {value: i for i, value in enumerate(model.__dict__.get(ORDERS, {}).get(layer, ()))}


@dataclass
class Reader:
    """One dictionary's read, for `arrange`: its points (a transcoder's input, then its output) and their sites."""

    owner: Any
    points: tuple[Point, ...]
    sites: tuple[tuple[str, ...], ...]


@dataclass
class Step:
    """What to do before the read: keep a ``resid_mid``'s stream (``keep``), open another dictionary's visit, or
    read a transcoder's input (``input_only``)."""

    keep: Point | None = None
    reader: Reader | None = None
    input_only: bool = False  # a transcoder's input read now (its output is read where the model reaches it)


def arrange(own: Reader, others: Sequence[Reader], rank: dict[str, int],
            passed: Callable[[str], bool]) -> list[tuple[int, Step]]:
    """The reads to make around ``own``'s, in the model's order, so that ``others`` stay readable after it:
    ``(phase, step)``, phase 0 before ``own`` reads its point, 1 between a transcoder's input and its output.

    Another dictionary is read first where ``own``'s read would pass one of its sites and where it can be read
    whole before the site ``own`` reads next (up to the same site: the later read takes the visit over). A
    ``resid_mid`` (``layer_input`` plus the mixers' contributions) among them is read up to its last contribution
    first (its stream kept: `nncanon.sae.sites.keep_stream_before`), so that the reads after it ask only that
    contribution. ``passed(value)``: whether the model ran past ``value`` at this step (a dictionary that reads it
    is left out).
    """
    if any(value not in rank for reader in (own, *others) for group in reader.sites for value in group):
        return []
    own_last = max(rank[value] for group in own.sites for value in group)
    waiting = [reader for reader in others
               if any(rank[value] < own_last for group in reader.sites for value in group)
               and not any(passed(value) for group in reader.sites for value in group)]
    if not waiting:
        return []
    mids = {}
    for reader in (own, *waiting):
        for point, group in zip(reader.points, reader.sites, strict=True):
            if point.value == "resid_mid" and len(group) > 1:
                mids.setdefault(group, point)

    def effective(group: tuple[str, ...]) -> list[int]:
        return [rank[value] for value in (group[-1:] if group in mids else group)]

    # The windows between own's reads: before its point, and between a transcoder's input and output.
    windows = [(-1, effective(own.sites[0])[0])]
    if len(own.sites) > 1:
        windows.append((effective(own.sites[0])[-1], effective(own.sites[1])[0]))
    ops = [(rank[group[0]], rank[group[-2]], Step(keep=point), [rank[value] for value in group[:-1]], group)
           for group, point in mids.items()]
    for reader in waiting:
        ranks = [value for group in reader.sites for value in effective(group)]
        ops.append((ranks[0], ranks[-1], Step(reader=reader), ranks, None))
    steps, position, dropped = [], -1, set()
    for first, last, step, ranks, group in sorted(ops, key=lambda op: (op[0], op[1], op[2].keep is None)):
        phase = next((i for i, (start, end) in enumerate(windows) if first >= max(position, start) and last <= end),
                     None)
        if ranks != sorted(ranks) or (step.reader is not None and any(each in dropped for each in step.reader.sites)):
            phase = None
        if phase is None and step.reader is not None and len(step.reader.sites) > 1 and \
                effective(step.reader.sites[1])[0] >= own_last:  # its input now, its output after own's read
            ranks = effective(step.reader.sites[0])
            phase = next((i for i, (start, end) in enumerate(windows)
                          if ranks[0] >= max(position, start) and ranks[-1] <= end), None)
            step, last = Step(reader=step.reader, input_only=True), ranks[-1]
        if phase is None:
            if group is not None:
                dropped.add(group)
            continue
        steps.append((phase, step))
        position = last
    return steps
