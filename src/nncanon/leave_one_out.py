"""Leave-one-out: infer every registered model type with its own record unused, and compare, value by
value on the same tiny model, what the inferred (and proved) record serves with what the record serves.

A value is *recovered* where both serve it and the tensors are equal (``torch.equal``), *declined*
where the record serves it and the inferred record does not, *different* where both serve it and
the tensors differ (the proof must make this 0). Values: every per-layer value the record serves
(``support()``), the logits and the lens at the first block.
"""

from __future__ import annotations

import time
import traceback
from dataclasses import dataclass, field
from typing import Any

import torch

from .families import REGISTRY, registered_model_types
from .inference.infer import infer_family
from .model import StandardizedTransformer
from .proof.prompts import PROMPTS, tiny_tokenizer
from .proof.variants import tiny_hf_model
from .reading import in_execution_order, read
from .registry import records, variants
from .support import COMPONENTS, LAYER_VALUES

#: The kinds of model types the measures are given for.
DENSE, MIXED = "dense", "MoE/hybrid"


@dataclass
class Row:
    """One model type's comparison."""

    model_type: str
    variant: str
    kind: str
    recovered: list[str] = field(default_factory=list)
    declined: list[str] = field(default_factory=list)
    different: list[str] = field(default_factory=list)
    error: str = ""
    seconds: float = 0.0

    @property
    def complete(self) -> bool:
        """Every value the record serves is recovered."""
        return not self.error and not self.declined and not self.different and bool(self.recovered)


def kind_of(family: Any) -> str:
    """``"MoE/hybrid"`` where some block of the record has a router or a non-attention mixer."""
    layouts = family.all_layouts()
    mixed = any(f.router_logits is not None or f.mixer is not None for f in layouts) or len(layouts) > 1
    return MIXED if mixed else DENSE


def _values(model: Any) -> dict[str, torch.Tensor | Exception]:
    """Every value ``model`` serves, read on the first proof prompt: ``"layers[i].name"`` -> tensor."""

    report = model.support()
    out: dict[str, Any] = {}
    for index in range(model.num_layers):
        names = [n for n in LAYER_VALUES if n not in COMPONENTS and report.available(n, layer=index)]
        names = in_execution_order(model, index, names)
        saved: dict = {}
        try:
            with torch.no_grad(), model.trace(PROMPTS[0]):
                for name in names:
                    saved[name] = read(model, index, name).save()
        except Exception as error:  # the record's own tiny model cannot read it: reported, not counted
            saved = {name: error for name in names}
        out.update({f"layers[{index}].{name}": value for name, value in saved.items()})
    for name in ("logits", "project_on_vocab"):
        try:
            model._model_value_check(name)
            with torch.no_grad(), model.trace(PROMPTS[0]):
                value = model.logits.save() if name == "logits" else model.project_on_vocab(
                    model.layers[0].layer_output).save()
            out[name] = value
        except Exception as error:
            out[name] = error
    return out


def compare(model_type: str) -> Row:
    """Leave-one-out for ``model_type`` on its first registry variant."""

    spec = next(v for v in variants() if v.model_type == model_type)
    row = Row(model_type, spec.name, kind_of(REGISTRY[model_type]))
    try:
        record_hf = tiny_hf_model(spec)
        tokenizer = tiny_tokenizer(record_hf.config.get_text_config().vocab_size)
        record = StandardizedTransformer(record_hf, tokenizer=tokenizer, verify="never")
        expected = _values(record)
        start = time.perf_counter()
        inferred = infer_family(record_hf.config, type(record_hf))
        mine = StandardizedTransformer(tiny_hf_model(spec), tokenizer=tokenizer, family=inferred.family)
        row.seconds = round(time.perf_counter() - start, 2)
        actual = _values(mine)
    except Exception as error:
        row.error = f"{type(error).__name__}: {error}".splitlines()[0][:200]
        if __debug__ and False:  # pragma: no cover
            traceback.print_exc()
        return row
    for name, value in expected.items():
        if isinstance(value, Exception):
            continue
        got = actual.get(name)
        if got is None or isinstance(got, Exception):
            row.declined.append(name)
        elif got.shape == value.shape and torch.equal(got, value):
            row.recovered.append(name)
        else:
            row.different.append(name)
    return row


def leave_one_out(model_types: list[str] | None = None, progress: bool = False) -> list[Row]:
    """`compare` every registered model type (or those given), in name order."""

    types = [t for t in (model_types or registered_model_types()) if t in records()]
    rows = []
    for model_type in types:
        row = compare(model_type)
        if progress:
            print(f"{row.model_type}: {len(row.recovered)} recovered, {len(row.declined)} declined, "
                  f"{len(row.different)} different {row.error}", flush=True)
        rows.append(row)
    return rows


def _short(names: list[str]) -> str:
    """``attention_probabilities (2 layers), logits``: value names with the count of layers."""
    counts: dict[str, int] = {}
    for name in names:
        counts[name.split(".", 1)[-1]] = counts.get(name.split(".", 1)[-1], 0) + 1
    return ", ".join(f"{n} ({c})" if c > 1 else n for n, c in counts.items())


def totals(rows: list[Row]) -> dict[str, dict[str, float]]:
    """Per kind: model types, complete ones, their share, values recovered/declined/different."""
    out = {}
    for kind in (DENSE, MIXED):
        mine = [r for r in rows if r.kind == kind]
        complete = sum(r.complete for r in mine)
        out[kind] = {
            "types": len(mine), "complete": complete, "share": complete / len(mine) if mine else 0.0,
            "recovered": sum(len(r.recovered) for r in mine), "declined": sum(len(r.declined) for r in mine),
            "different": sum(len(r.different) for r in mine), "errors": sum(bool(r.error) for r in mine),
        }
    return out


def markdown(rows: list[Row]) -> str:
    """The table and the totals, as Markdown."""
    lines = ["| model type | kind | recovered | declined | different | what is declined |", "|---|---|---|---|---|---|"]
    for r in rows:
        what = r.error or _short(r.declined + r.different) or "-"
        lines.append(f"| `{r.model_type}` | {r.kind} | {len(r.recovered)} | {len(r.declined)} | "
                     f"{len(r.different)} | {what.replace('|', '/')} |")
    lines.append("")
    for kind, t in totals(rows).items():
        lines.append(f"- {kind}: {t['complete']} of {t['types']} model types recover every value "
                     f"({100 * t['share']:.0f}%); values recovered {t['recovered']}, declined {t['declined']}, "
                     f"different {t['different']}; inference errors {t['errors']}.")
    return "\n".join(lines)
