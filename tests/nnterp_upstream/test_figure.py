"""The migration page states nnterp 1.3's suite figure and every deliberate difference (nncanon's own test)."""

from __future__ import annotations

from pathlib import Path

from .conftest import DIFFERENCES, SKIPPED_UPSTREAM, VENDORED, _difference

PAGE = Path(__file__).parents[2] / "docs" / "tools.md"


def test_the_migration_page_states_the_figure(request):
    items = [item for item in request.session.items if item.path.name in VENDORED]
    if {item.path.name for item in items} != set(VENDORED):
        return  # a selection of the suite: the figure is about all of it
    run = [item for item in items if item.originalname not in SKIPPED_UPSTREAM]
    failing = [item for item in run if _difference(item)]
    page = " ".join(PAGE.read_text().split())
    assert f"{len(run) - len(failing)} of the {len(run)} items" in page
    for reason in DIFFERENCES.values():
        assert " ".join(reason.split()) in page, reason
