"""Every public name of nncanon, nncanon.tools, nncanon.nnterp, nncanon.sae and nncanon.graphs has an entry in the API
reference.

``mkdocs build --strict`` does not see a missing entry, nor one mkdocstrings resolves to something else:
``::: nncanon.tools`` with ``members: [logit_lens]`` renders the *module* ``nncanon.tools.logit_lens``,
which shadows the function of the same name. This test reads the ``:::`` directives of docs/ and
resolves each rendered path as mkdocstrings does (a submodule wins over an attribute of that name).
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import re
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

DOCS = Path(__file__).resolve().parents[1] / "docs"
PACKAGES = ["nncanon", "nncanon.tools", "nncanon.nnterp", "nncanon.sae", "nncanon.graphs"]
DIRECTIVE = re.compile(r"^::: (\S+)\n((?:    .*\n)*)", re.M)


def resolve(path: str) -> Any:
    """The object at ``path``, a submodule taking precedence over a package attribute of that name."""
    parts = path.split(".")
    found: Any = importlib.import_module(parts[0])
    prefix = parts[0]
    for part in parts[1:]:
        prefix = f"{prefix}.{part}"
        if hasattr(found, "__path__") and importlib.util.find_spec(prefix) is not None:
            found = importlib.import_module(prefix)
        else:
            found = getattr(found, part)
    return found


def rendered_paths(page: str) -> list[str]:
    """The dotted paths the ``:::`` directives of a page render an entry for."""
    paths = []
    for target, options in DIRECTIVE.findall(page):
        members = re.search(r"(?m)^\s+members: (.+)", options)
        paths.append(target)
        if members is None:
            obj = resolve(target)
            if isinstance(obj, ModuleType):
                names = getattr(obj, "__all__", None) or [
                    name for name, value in vars(obj).items()
                    if not name.startswith("_") and getattr(value, "__module__", None) == obj.__name__
                ]
                paths += [f"{target}.{name}" for name in names]
        elif members.group(1).strip() not in ("false", "no"):
            paths += [f"{target}.{name.strip()}" for name in members.group(1).strip("[] ").split(",")]
    return paths


def rendered_objects() -> list[Any]:
    return [resolve(path) for page in sorted(DOCS.glob("*.md")) for path in rendered_paths(page.read_text())]


PUBLIC = [(package, name) for package in PACKAGES for name in importlib.import_module(package).__all__]


@pytest.fixture(scope="module")
def rendered():
    return rendered_objects()


@pytest.mark.parametrize("package, name", PUBLIC, ids=[f"{p}.{n}" for p, n in PUBLIC])
def test_every_public_name_has_an_entry(package, name, rendered):
    obj = getattr(importlib.import_module(package), name)
    assert any(entry is obj for entry in rendered), (
        f"{package}.{name} has no entry in docs/api.md: add it to the ::: directive of its defining module "
        f"({getattr(obj, '__module__', package)})"
    )


def test_a_shadowed_name_is_caught():
    """The check itself: ``nncanon.tools.logit_lens`` resolves to the module, not the function."""
    from nncanon.tools import logit_lens

    assert inspect.ismodule(resolve("nncanon.tools.logit_lens"))
    assert resolve("nncanon.tools.logit_lens.logit_lens") is logit_lens
    assert all(entry is not logit_lens for entry in map(resolve, rendered_paths(
        "::: nncanon.tools\n    options:\n      members: [logit_lens]\n")))
