"""Packaging hook: ship the repository's ``model_registry/`` inside the package, as ``nncanon/model_registry``.

The records are data at the repository root (one place to add a family); a built wheel carries them
where `nncanon.registry.registry_dir` looks first. Everything else is in ``pyproject.toml``.
"""

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

REGISTRY = Path(__file__).resolve().parent / "model_registry"


class BuildWithRegistry(build_py):
    """``build_py`` that also copies ``model_registry/*.json`` and ``*.md`` into the built package."""

    def run(self) -> None:
        super().run()
        if getattr(self, "editable_mode", False):  # an editable install reads the repository's own folder
            return
        target = Path(self.build_lib) / "nncanon" / "model_registry"
        target.mkdir(parents=True, exist_ok=True)
        for path in sorted(REGISTRY.iterdir()):
            if path.suffix in (".json", ".md"):
                shutil.copy2(path, target / path.name)


setup(cmdclass={"build_py": BuildWithRegistry})
