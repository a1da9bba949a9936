"""Values that live inside a forward, found among the operations of the module's source.

A router's logits must be read where a write changes the routing (an operation inside the router,
``router_logits_0``); attention computed inline (BLOOM, MPT, Falcon's ALiBi path) has its
probabilities at an operation of the attention's own forward. The candidates are the module's
nnsight source operations (by name: the logits' assignment or a linear map; those after the
softmax); the choice is the verifier's (the ``routing`` and ``probabilities`` checks, on the twin).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..proof.checks import CHECKS
from ..proof.load import mounted_twin
from ..proof.verdict import verify
from ..served import Site
from .declined import Declined

#: At most this many operations are tried per value.
TRIES = 8


def _names(model: Any, path: str, inside: str | None = None) -> tuple[str, ...]:
    """The source operations of the module at ``path`` (of its method call ``inside``, where given)."""
    try:
        source = model.get(path).source
        return tuple((getattr(source, inside).source if inside else source).names)
    except Exception:  # a forward nnsight cannot read the source of
        return ()


def _held(verdict: Any, check: str, layers: list[int]) -> bool:
    results = [r for r in verdict.results if r.check == check and r.layer in layers]
    return bool(results) and all(r.passed for r in results)


def _router_candidates(names: tuple[str, ...]) -> list[str]:
    return ([n for n in names if "logit" in n] + [n for n in names if "linear" in n and "logit" not in n])[:TRIES]


def _after_softmax(names: tuple[str, ...]) -> list[str]:
    after = next((i for i, n in enumerate(names) if "softmax" in n), None)
    if after is None:
        return []
    return [n for n in names[after + 1:] if not n.startswith(("int_", "range_", "slices_"))][:TRIES]


def _probability_candidates(model: Any, path: str) -> list[tuple[str, ...]]:
    """Operation paths after the softmax: in the module's forward, or in a method it calls (``self__attn_0``)."""
    names = _names(model, path)
    found = [(n,) for n in _after_softmax(names)]
    for method in (n for n in names if n.startswith("self_") and not found):
        found = [(method, n) for n in _after_softmax(_names(model, path, method))]
    return found


def _decline(fields: dict, reasons: dict) -> None:
    known = dict(fields["declines"].reasons) if fields.get("declines") else {}
    fields["declines"] = Declined(tuple(sorted({**known, **reasons}.items())))


def choose_operations(twin: torch.nn.Module, build: Callable[[dict], Any], fields: dict, parts: dict,
                      layers_of: dict, tried: dict) -> None:
    """Set, in ``fields`` (kind -> Family fields), each router's logits and each inline attention's
    probabilities at the first operation the verifier accepts; note in ``tried`` what was not found."""

    by_name = {c.name: c for c in CHECKS}
    model = mounted_twin(twin, build(fields))
    blocks = model.family.layers
    verdict = verify(model, [by_name["probabilities"]])
    for kind, block in parts.items():
        layers = layers_of[kind]
        where = f"{blocks}.{layers[0]}"
        if block.router is not None:
            names = _router_candidates(_names(model, f"{where}.{block.router}"))
            for name in names:
                fields[kind]["router_logits"] = Site(block.router, op=name, flat=block.router_flat)
                if _held(verify(mounted_twin(twin, build(fields)), [by_name["routing"]]), "routing", layers):
                    break
            else:
                fields[kind]["router_logits"] = None
                tried[f"router_logits ({kind})"] = (
                    f"no operation of {block.router} whose write changes the routing; "
                    f"tried {', '.join(names) or 'none'}"
                )
        if block.attention is not None and not _held(verdict, "probabilities", layers):
            paths = _probability_candidates(model, f"{where}.{block.attention}")
            names = [" / ".join(path) for path in paths]
            for path in paths:
                fields[kind]["probabilities"] = path
                checked = verify(mounted_twin(twin, build(fields)), [by_name["probabilities"]])
                if _held(checked, "probabilities", layers):
                    break
            else:
                fields[kind]["probabilities"] = None
                reason = (
                    "inferred: not through transformers' attention interface, and no operation after the softmax "
                    f"of {block.attention} passes the probabilities check; tried {', '.join(names) or 'none'}"
                )
                tried[f"attention_probabilities ({kind})"] = reason
                heads = "inferred: no head's probabilities were found whose zeroing equals zeroing the head's output"
                _decline(fields[kind], {"attention_probabilities": reason, "attention_head_outputs": heads})
