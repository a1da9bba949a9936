"""What the installed transformers has: its minor, and whether it has a model type. The one place that knows.

nncanon supports a range of transformers minors (see ``pyproject.toml`` and docs/install.md). A record
may name a model type that an older minor does not have (its variants are skipped by the suite with
`missing_from_transformers`'s reason), and a family whose modeling code changed between minors reads
`transformers_minor` to describe the code that is installed (GPT-J's blocks return a tuple before 5.24).
"""

from __future__ import annotations

from functools import cache

#: This nncanon's version (pyproject.toml's).
__version__ = "0.1.0"

#: The oldest and the newest transformers minor nncanon supports, each tested (docs/versions.md):
#: ``pyproject.toml`` asks for ``transformers>=5.21,<5.26`` (the suite checks that the two agree).
OLDEST_MINOR, NEWEST_MINOR = (5, 21), (5, 25)


_MINOR: dict[str, tuple[int, int]] = {}  # a plain dict: a functools cache cannot travel by value to a remote server


def transformers_minor() -> tuple[int, int]:
    """The installed transformers' ``(major, minor)``, e.g. ``(5, 24)``."""
    if "installed" not in _MINOR:
        import transformers

        major, minor = transformers.__version__.split(".")[:2]
        _MINOR["installed"] = int(major), int(minor)
    return _MINOR["installed"]


def untested_transformers(minor: tuple[int, int] | None = None) -> str | None:
    """Why the installed transformers (or ``minor``) is outside the tested range, else ``None``.

    >>> untested_transformers((5, 24)) is None
    True
    """
    import transformers

    minor = transformers_minor() if minor is None else minor
    if OLDEST_MINOR <= minor <= NEWEST_MINOR:
        return None
    oldest, newest = (".".join(map(str, m)) for m in (OLDEST_MINOR, NEWEST_MINOR))
    after = ".".join(map(str, (NEWEST_MINOR[0], NEWEST_MINOR[1] + 1)))
    return (
        f"transformers {'.'.join(map(str, minor))} ({transformers.__version__} installed) is outside the minors "
        f"nncanon was tested on ({oldest} to {newest}). Every value is still proved on a twin of the model at load "
        "and declined where the proof fails (model.support() gives the reason), but a family whose modeling code "
        f"changed may serve fewer values. For a tested minor: pip install \"transformers>={oldest},<{after}\""
    )


@cache
def missing_from_transformers(model_type: str, *class_names: str | None) -> str | None:
    """Why the installed transformers lacks ``model_type`` (or one of ``class_names``), else ``None``.

    The one place that knows whether a record's model type exists in the installed transformers:
    the type must be in transformers' own config mapping
    (``transformers.models.auto.configuration_auto.CONFIG_MAPPING_NAMES``) and each named class
    must be exported by the top-level ``transformers`` package.

    >>> missing_from_transformers("llama", "LlamaConfig") is None
    True
    """
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    version = transformers.__version__
    if model_type not in CONFIG_MAPPING_NAMES:
        return f"transformers {version} has no model type {model_type!r}"
    for name in class_names:
        if name is not None and not hasattr(transformers, name):
            return f"transformers {version} has no {name} (model type {model_type!r})"
    return None


def missing_libraries(names: tuple[str, ...] | list[str]) -> str | None:
    """Why a model class cannot be built here for want of a library it imports (``names``), else ``None``.

    Gemma-3n's multimodal class builds a timm vision tower: its record says ``"requires": ["timm"]``.

    >>> missing_libraries(["torch"]) is None
    True
    """
    from importlib.util import find_spec

    absent = [name for name in names if find_spec(name) is None]
    if not absent:
        return None
    return f"its model class needs {', '.join(absent)}, not installed here (pip install {' '.join(absent)})"
