"""The model registry: one JSON record per model type, with its tiny test configs and checkpoints.

The records live in ``model_registry/`` at the repository root (shipped inside the package as
``nncanon/model_registry`` when built). Each is data only::

    {"model_type": "llama", "config_class": "LlamaConfig",
     "checkpoints": ["meta-llama/Llama-3.2-1B"],
     "variants": {"llama": {"hidden_size": 32, ...}}}

A variant is one tiny configuration the invariant suite builds (``gpt_neox`` has a parallel and
a sequential one).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from .versions import missing_from_transformers, missing_libraries, transformers_minor


@dataclass(frozen=True)
class Variant:
    """One tiny configuration of a registered model type."""

    name: str
    model_type: str
    config_class: str
    config: dict
    model_class: str | None = None
    requires: tuple[str, ...] = ()

    def build_config(self, **overrides: Any) -> Any:
        """The transformers config object of this variant."""
        import transformers

        return getattr(transformers, self.config_class)(**{**self.config, **overrides})

    @property
    def unavailable(self) -> str | None:
        """Why this variant cannot be built here, or ``None`` when it can.

        A record may name a model type that an older transformers minor does not have yet
        (`nncanon.versions.missing_from_transformers`), or a model class that imports a library not
        installed (``"requires"``: `nncanon.versions.missing_libraries`), or the record says that the
        installed minor cannot run the variant (``"unavailable"``); the suite skips its variants with this reason.
        """
        return (missing_from_transformers(self.model_type, self.config_class, self.model_class)
                or missing_libraries(self.requires) or _unavailable_on_minor(self))


def _unavailable_on_minor(variant: Variant) -> str | None:
    """Why the installed transformers minor cannot run ``variant`` though it has the model type: the record's
    ``"unavailable"`` entries (``{"transformers": ["5.20"], "variants": [...], "why": ...}``; no ``"variants"``:
    every variant of the record)."""
    import transformers

    minor = "{}.{}".format(*transformers_minor())
    for entry in records().get(variant.model_type, {}).get("unavailable", []):
        if minor in entry["transformers"] and variant.name in entry.get("variants", [variant.name]):
            return f"transformers {transformers.__version__} cannot run variant {variant.name!r}: {entry['why']}"
    return None


def registry_dir() -> Path:
    """Where the records are: inside the installed package, else the repository root."""
    here = Path(__file__).resolve().parent
    for candidate in (here / "model_registry", here.parents[1] / "model_registry"):
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError("model_registry/ not found next to the package or at the repository root")


#: The status matrix `nncanon matrix` writes beside the records (not a record).
STATUS_FILE = "status.json"


@cache
def records() -> dict[str, dict]:
    """Every record, by model type."""
    found = {}
    for path in sorted(registry_dir().glob("*.json")):
        if path.name == STATUS_FILE:
            continue
        record = json.loads(path.read_text())
        found[record["model_type"]] = record
    return found


def variants(available: bool = False) -> list[Variant]:
    """Every tiny configuration of every record, in a stable order.

    ``available=True`` keeps only those the installed transformers can build (`Variant.unavailable`).
    """
    out = []
    for model_type, record in records().items():
        for name, config in record["variants"].items():
            out.append(Variant(name, model_type, record["config_class"], config, record.get("model_class"),
                               tuple(record.get("requires", ()))))
    return [v for v in out if v.unavailable is None] if available else out


def variant(name: str) -> Variant:
    """The variant called ``name``."""
    for candidate in variants():
        if candidate.name == name:
            return candidate
    raise KeyError(f"no registry variant {name!r}")
