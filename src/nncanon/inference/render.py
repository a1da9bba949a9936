"""An inferred record as the code and data a contributor adds: `family_source`, `registry_record`."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from ..families.base import Embeddings, Family
from ..served import Site

_DEFAULT = Family(name="", model_types=())
_SITE_DEFAULT = Site()
_EMBEDDINGS_DEFAULT = Embeddings()
_VOLATILE = {"transformers_version", "_name_or_path", "architectures", "dtype", "torch_dtype", "auto_map",
             "_attn_implementation_autoset"}


def site_source(site: Site) -> str:
    """``Site("self_attn", index=0)``: the fields that differ from the defaults."""
    parts = [repr(site.module)]
    for f in dataclasses.fields(Site):
        if f.name == "module":
            continue
        value = getattr(site, f.name)
        if value != getattr(_SITE_DEFAULT, f.name):
            parts.append(f"{f.name}={value!r}")
    return f"Site({', '.join(parts)})"


def _value_source(value: Any) -> str:
    if isinstance(value, Site):
        return site_source(value)
    if isinstance(value, Embeddings):  # the fields that differ from the defaults
        parts = [f"{f.name}={getattr(value, f.name)!r}" for f in dataclasses.fields(Embeddings)
                 if getattr(value, f.name) != getattr(_EMBEDDINGS_DEFAULT, f.name)]
        return f"Embeddings({', '.join(parts)})"
    if isinstance(value, tuple) and value and all(hasattr(v, "op") for v in value):
        return "(" + ", ".join(f"LogitStep({s.op!r}, {s.attribute!r})" for s in value) + ",)"
    return repr(value)


def _fields_source(fields: dict, indent: str, base: Family = _DEFAULT) -> list[str]:
    """One ``name=value,`` line per field whose value is not ``base``'s."""
    lines = []
    for name, value in fields.items():
        if name in ("declines", "layouts", "layout_of"):
            continue
        if name in {f.name for f in dataclasses.fields(Family)} and value == getattr(base, name, object()):
            continue
        lines.append(f"{indent}{name}={_value_source(value)},")
    return lines


def _declines_comments(fields: dict, indent: str) -> list[str]:
    declines = fields.get("declines")
    if declines is None:
        return []
    return [f"{indent}# declined {name}: {reason}" for name, reason in declines.reasons]


def family_source(inferred: Any) -> str:
    """The Python of ``inferred.family`` (paste-able into a module of ``nncanon/families/``)."""
    family = inferred.family
    own = {f.name: getattr(family, f.name) for f in dataclasses.fields(Family)}
    own["name"] = family.model_types[0]
    lines = [
        "from nncanon.families.base import Embeddings, Family, LogitStep",
        "from nncanon.served import Site",
        "",
        f"{family.model_types[0].upper().replace('-', '_')} = Family(",
        *_declines_comments(own, "    "),
        f"    name={own.pop('name')!r},",
        f"    model_types={own.pop('model_types')!r},",
        *_fields_source(own, "    "),
    ]
    if family.layouts:
        lines.append("    layouts={")
        for kind, fields in family.layouts.items():
            lines += _declines_comments(fields, "        ")
            lines.append(f"        {kind!r}: dict(")
            lines += _fields_source(fields, "            ", family)
            lines.append("        ),")
        lines.append("    },")
        lines.append(f"    layout_of={family.layout_of.source()},")
    lines.append(")")
    return "\n".join(lines)


def registry_record(inferred: Any) -> dict:
    """The ``model_registry/<model_type>.json`` record, with the twin's config as its variant."""
    config = inferred.twin_config
    values = {k: v for k, v in config.to_diff_dict().items() if k not in _VOLATILE and k != "model_type"}
    model_type = inferred.family.model_types[0]
    json.dumps(values)  # only plain data goes into a record
    return {
        "model_type": model_type,
        "config_class": type(config).__name__,
        "checkpoints": [],
        "variants": {model_type: values},
    }
