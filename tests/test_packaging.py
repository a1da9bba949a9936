"""The built wheel is self-contained: it carries the model registry, so an installed nncanon reads it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from nncanon.registry import registry_dir

ROOT = Path(__file__).resolve().parents[1]


def test_the_wheel_ships_the_registry_and_an_installed_package_reads_it(tmp_path):
    """Builds the wheel from a copy of the project (no network, no build isolation), checks every registry file
    is in it as ``nncanon/model_registry/``, and reads the registry from the unpacked wheel, outside the repo."""
    project = tmp_path / "project"
    project.mkdir()
    for name in ("pyproject.toml", "setup.py", "MANIFEST.in", "README.md"):
        shutil.copy2(ROOT / name, project / name)
    shutil.copytree(ROOT / "model_registry", project / "model_registry")
    shutil.copytree(ROOT / "src", project / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "--no-index", ".",
         "-w", str(tmp_path / "dist")],
        cwd=project, capture_output=True, text=True, timeout=300,
    )
    assert built.returncode == 0, built.stderr
    (wheel,) = (tmp_path / "dist").glob("nncanon-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        archive.extractall(tmp_path / "installed")
    expected = {f"nncanon/model_registry/{path.name}" for path in registry_dir().iterdir()
                if path.suffix in (".json", ".md")}
    assert expected and expected <= names, sorted(expected - names)[:5]

    script = (
        "import nncanon.registry as r; from nncanon.cli import main; "
        "print(r.registry_dir()); print(len(r.records())); raise SystemExit(main(['families', '-q', '-k', 'gpt2']))"
    )
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "installed")}
    ran = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=300)
    assert ran.returncode == 0, ran.stderr
    where, count, *table = ran.stdout.splitlines()
    assert Path(where) == tmp_path / "installed" / "nncanon" / "model_registry"
    assert int(count) == len([p for p in registry_dir().glob("*.json") if p.name != "status.json"])
    assert any(line.startswith("gpt2 ") and line.rstrip().endswith("ok") for line in table), ran.stdout
