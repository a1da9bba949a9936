"""The package's imports run one way: each module imports only its own layer and the layers below it.

The layers, bottom to top, are `LAYERS` (README, "Layout", shows the same picture): the foundation (errors,
versions, the registry's data), the surface (served values, components, families, mounting, the mounted model),
the proof (twin, checks, verdict, cache), the inference of unregistered families, the model
(`StandardizedTransformer` = load + mount + proof + provenance), research code built on it (tools, nnterp
compat, dictionaries, studies), and the entry points (CLI, docs tables, demo models, tiny test models).

Every import counts, those inside functions too: an import that runs upward, a cycle between modules, or a
package module importing ``nncanon.testing`` (tests and examples only) fails here.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import nncanon

PACKAGE = Path(nncanon.__file__).parent
README = PACKAGE.parents[1] / "README.md"

#: Bottom to top: each layer's modules and folders (dotted names under ``nncanon``; ``""`` is the package root).
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("foundation", ("errors", "files", "versions", "quiet", "threads", "hub", "registry", "scope",
                    "nnsight_internals", "quantization")),
    ("surface", ("order", "gradients", "served", "components", "families", "mounting", "support", "reading",
                 "resuming", "steering", "inputs", "skipping", "traced", "mounted", "model_sites")),
    ("proof", ("proof",)),
    ("inference", ("inference",)),
    ("model", ("loading", "model")),
    ("research", ("tools", "nnterp", "study", "sae", "graphs", "views")),
    ("entry points", ("cli", "__main__", "matrix", "docs_tables", "leave_one_out", "demo", "testing", "")),
)


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _exists(name: str) -> bool:
    base = PACKAGE.joinpath(*name.split(".")) if name else PACKAGE
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def imports_of(path: Path) -> set[str]:
    """The package modules ``path`` imports (dotted, without ``nncanon.``), at module level or inside functions."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".") if package else []
                parts = parts[: len(parts) - (node.level - 1)]
                target = ".".join([*parts, *([node.module] if node.module else [])])
            elif node.module and (node.module == "nncanon" or node.module.startswith("nncanon.")):
                target = node.module.removeprefix("nncanon").removeprefix(".")
            else:
                continue
            for alias in node.names:
                child = f"{target}.{alias.name}" if target else alias.name
                found.add(child if _exists(child) else target)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "nncanon" or alias.name.startswith("nncanon."):
                    found.add(alias.name.removeprefix("nncanon").removeprefix("."))
    found.discard(name)
    return found


def graph() -> dict[str, set[str]]:
    return {module_name(path): imports_of(path) for path in sorted(PACKAGE.rglob("*.py"))}


def layer_of(module: str) -> int:
    best, index = -1, None
    for number, (_, members) in enumerate(LAYERS):
        for member in members:
            if module == member or (member and module.startswith(member + ".")):
                if len(member) > best:
                    best, index = len(member), number
    assert index is not None, f"nncanon.{module} is in no layer of LAYERS: add it where it belongs (and to the README)"
    return index


def test_every_module_has_a_layer():
    for module in graph():
        layer_of(module)


def test_imports_run_downward():
    upward = [f"nncanon.{module} ({LAYERS[layer_of(module)][0]}) imports nncanon.{target} "
              f"({LAYERS[layer_of(target)][0]})"
              for module, targets in graph().items() for target in sorted(targets)
              if layer_of(target) > layer_of(module)]
    assert upward == []


def test_no_import_cycles():
    edges = graph()
    # the package root imports its modules to export their names, and every module's import runs it first:
    # that is Python's package mechanism, not a dependency of the module on the root
    edges = {module: {t for t in targets if t} for module, targets in edges.items()}
    cycles = [sorted(component) for component in _strongly_connected(edges) if len(component) > 1]
    assert cycles == []


def test_nothing_in_the_package_imports_testing():
    importers = sorted(module for module, targets in graph().items() if "testing" in targets)
    assert importers == []


def _strongly_connected(edges: dict[str, set[str]]) -> list[set[str]]:
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[set[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in edges.get(node, ()):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.add(member)
                if member == node:
                    break
            found.append(component)

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


def test_the_readme_shows_every_layer_and_folder():
    """The README's layout section names every layer of `LAYERS` in order and every module and folder in it."""
    text = README.read_text()
    section = text[text.index("## Layout"):]
    section = section[: section.index("\n## ", 4)] if "\n## " in section[4:] else section
    positions = [section.find(f"**{name}**") for name, _ in LAYERS]
    assert -1 not in positions and positions == sorted(positions), "README's layout: one **layer** line each, in order"
    named = set(re.findall(r"`([\w./]+)`", section))
    for _, members in LAYERS:
        for member in members:
            if not member or member == "__main__":
                continue
            spelled = member.replace(".", "/") + ("/" if (PACKAGE / member).is_dir() else ".py")
            if (PACKAGE / member).is_dir() or (PACKAGE / f"{member}.py").is_file():
                assert spelled in named, f"README's layout does not name {spelled}"


def test_no_file_over_600_lines():
    long = {module_name(path): n for path in PACKAGE.rglob("*.py")
            if (n := len(path.read_text().splitlines())) > 600}
    assert long == {}


#: Modules that may import package modules inside functions: the CLI, whose commands load what they run only
#: when they run (``nncanon --help`` imports no torch model code).
LAZY = {"cli"}


def test_imports_are_at_module_level():
    """An import inside a function hides a dependency (and was how cycles were dodged): only `LAZY` has them."""
    inside = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if module_name(path) in LAZY:
            continue
        for function in ast.walk(ast.parse(path.read_text())):
            if isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
                inside += [f"nncanon.{module_name(path)}:{node.lineno} (in {function.name})"
                           for node in ast.walk(function) if isinstance(node, ast.ImportFrom)
                           and (node.level or (node.module or "").startswith("nncanon"))]
    assert inside == []
