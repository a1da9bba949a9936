"""Every example of docs/tools.md runs as written (offline, on the trained demo Llama)."""

from __future__ import annotations

import re
import runpy
from pathlib import Path

import pytest

DOC = Path(__file__).parents[2] / "docs" / "tools.md"
SECTIONS = re.findall(r"^## (.+?)\n(.*?)(?=^## |\Z)", DOC.read_text(), re.S | re.M)
EXAMPLES = [(title, re.findall(r"```python\n(.*?)```", body, re.S)) for title, body in SECTIONS]


def test_every_section_has_an_example():
    assert len(EXAMPLES) >= 9
    for title, blocks in EXAMPLES:
        assert len(blocks) == 1, title
        assert 'demo_model("llama"' in blocks[0] or "demo_path(\"llama\")" in blocks[0], title


@pytest.mark.parametrize("title, blocks", EXAMPLES, ids=[title for title, _ in EXAMPLES])
def test_example_runs(title, blocks, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    script = tmp_path / "example.py"  # nnsight reads a trace's source from its file
    script.write_text(blocks[0])
    runpy.run_path(str(script), run_name="__main__")
    capsys.readouterr()
    if title == "Logit lens":
        assert (tmp_path / "logit_lens.png").read_bytes()[:4] == b"\x89PNG"
