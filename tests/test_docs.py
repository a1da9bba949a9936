"""Every Python example in docs/ and the README runs, so no page can rot; generated pages are current."""

from __future__ import annotations

import re
import runpy
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[1] / "docs"
NO_RUN = "# docs: no-run"


def _examples(page: Path) -> str:
    blocks = re.findall(r"```python\n(.*?)```", page.read_text(), re.S)
    return "\n\n".join(block for block in blocks if not block.lstrip().startswith(NO_RUN))


PAGES = sorted(p for p in DOCS.glob("*.md") if _examples(p).strip())


@pytest.mark.parametrize("page", PAGES, ids=[p.stem for p in PAGES])
def test_page_examples_run(page, tmp_path, monkeypatch):
    script = tmp_path / f"{page.stem.replace('-', '_')}_examples.py"  # nnsight reads a trace's source from its file
    script.write_text(_examples(page))
    monkeypatch.chdir(tmp_path)
    runpy.run_path(str(script), run_name="__main__")


def test_families_page_is_current():
    from nncanon.docs_tables import families_page

    assert (DOCS / "families.md").read_text() == families_page(), "run: python -m nncanon.docs_tables"


def test_proofs_page_tables_are_current():
    from nncanon.docs_tables import checks_table, shrinking_table

    page = (DOCS / "proofs.md").read_text()
    assert shrinking_table() in page, "the twin's table changed: run python -m nncanon.docs_tables"
    assert checks_table() in page, "the checks changed: run python -m nncanon.docs_tables"
