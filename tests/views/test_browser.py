"""Every view in a real browser (headless Chromium, `conftest`): it loads with no console error and no network
request, its DOM holds one element per node / head / cell of the data it was made from, a click on a feature shows
its contexts, its screenshot is not blank (and is the docs' picture: docs/assets/views), and text from the data
never runs as script."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
import torch
from filelock import FileLock

import nncanon
from nncanon import demo_dictionary, graphs, views
from nncanon.sae import attach
from nncanon.study import head_effects, linear_head_layers

from .conftest import open_page, screenshot

PROMPT = "The Eiffel Tower is in the city of"
PAYLOAD = "</script><script>window.PWNED=1</script>"
#: The pictures docs/views.md shows (docs/assets/views/<name>.png); the graph's is taken with a feature clicked.
DOCS_PICTURES = {"attention", "lens", "feature", "study"}
HOSTILE = [PAYLOAD, " café ☃ 東京", "<img src=x onerror=\"window.PWNED=2\">", "&amp; \u2028"]


def _contexts(layer: int, feature: int) -> list[tuple[float, str]]:
    """Made-up contexts with markup, script and non-ASCII in them (they must show as text)."""
    return [(2.5, f"Paris, France: the [[ Eiffel]] Tower (L{layer} #{feature}) {PAYLOAD}"),
            (1.25, "Le café [[ près]] de la tour ☃ <b>bold?</b>")]


def _build(out: Path) -> dict:
    """Write every view's page into ``out``; returns ``{name: what the page must hold}`` (counts from the Graph and
    tensors it was made from)."""
    gpt2 = nncanon.demo_model("gpt2")  # (eager attention: its patterns can be frozen)
    transcoders = graphs.random_transcoders(gpt2, n_features=16)
    graph = graphs.attribute(gpt2, PROMPT, transcoders, max_n_logits=3, desired_logit_prob=0.95,
                             max_feature_nodes=48)
    pruned = graphs.prune(graph, node_threshold=1.0, edge_threshold=0.99)
    views.write_graph_page(graph, out / "graph.html", gpt2.tokenizer, contexts=_contexts, pruned=pruned)
    facts: dict = {"graph": {"kept": int(pruned.node_mask.sum())}}
    hybrid = nncanon.demo_model("hybrid")
    views.attention_page(hybrid, PROMPT).write(out / "attention.html")
    report = hybrid.support()
    served = [layer for layer in range(hybrid.num_layers) if report.available("attention_probabilities", layer=layer)]
    facts["attention"] = {"heads": len(served) * hybrid.config.num_attention_heads,
                          "declined": hybrid.num_layers - len(served)}
    views.lens_page(gpt2, PROMPT).write(out / "lens.html")
    facts["lens"] = {"cells": gpt2.num_layers * len(gpt2.tokenizer(PROMPT)["input_ids"])}
    corpus = (nncanon.demo.DEMO_DIR / "corpus.txt").read_text().splitlines()[:48]
    with attach(gpt2, demo_dictionary()) as item:
        views.feature_page(gpt2, item, corpus, 232, k=8).write(out / "feature.html")
    effects = {"gpt2": head_effects(gpt2, PROMPT, " Paris", fast=True),
               "hybrid": head_effects(hybrid, PROMPT, " Paris", fast=True)}
    views.study_page(effects, " Paris", PROMPT, estimated="log_odds",
                     linear_layers={"hybrid": linear_head_layers(hybrid)}).write(out / "study.html")
    facts["study"] = {"cells": sum(grid.numel() for grid in effects.values()),
                      "nan": sum(int(grid.isnan().sum()) for grid in effects.values())}
    patterns = {0: torch.softmax(torch.randn(2, 4, 4), -1), 1: torch.full((2, 4, 4), float("nan"))}
    views.attention_page(tokens=HOSTILE, patterns=patterns).write(out / "hostile_attention.html")
    views.lens_page(tokens=HOSTILE, top_tokens=[HOSTILE, HOSTILE[::-1]],
                    probabilities=[[0.1, 0.5, float("nan"), 1.0]] * 2).write(out / "hostile_lens.html")
    return facts


@pytest.fixture(scope="module")
def pages(tmp_path_factory):
    """Every view's page, built once per run (under xdist, by the first worker; the others wait and read it):
    ``{name: (path, facts)}``."""
    base = tmp_path_factory.getbasetemp()
    root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    out = root / "views-pages"
    with FileLock(str(root / "views-pages.lock")):
        if not (out / "facts.json").exists():
            out.mkdir(exist_ok=True)
            (out / "facts.json").write_text(json.dumps(_build(out)))
    facts = json.loads((out / "facts.json").read_text())
    names = ["graph", "attention", "lens", "feature", "study", "hostile_attention", "hostile_lens"]
    return {name: (out / f"{name}.html", facts.get(name, {})) for name in names}


@pytest.mark.parametrize("name", ["graph", "attention", "lens", "feature", "study", "hostile_attention",
                                  "hostile_lens"])
def test_page_loads_offline_without_errors_and_draws_something(browser, pages, name):
    result = open_page(browser, pages[name][0])
    assert result["errors"] == [], result["errors"]
    assert result["requests"] == [], f"the page asked the network for {result['requests']}"
    assert browser.execute_script("return window.PWNED") is None, "text from the data ran as script"
    variance = screenshot(browser, name, save=name in DOCS_PICTURES)
    assert variance > 100, f"the screenshot of {name} is blank (grey-level variance {variance:.1f})"


def test_graph_page_has_one_element_per_kept_node_and_a_click_shows_contexts(browser, pages):
    path, facts = pages["graph"]
    open_page(browser, path)
    kept = facts["kept"]
    assert browser.execute_script("return document.querySelectorAll('#nodes .node').length") == kept
    features = browser.find_elements("css selector", "#nodes .node.kind-0")
    assert features, "no feature node survived pruning: the fixture must keep some"
    browser.execute_script("arguments[0].dispatchEvent(new MouseEvent('click', {bubbles: true}))", features[0])
    contexts = browser.find_element("css selector", "#contexts").text
    assert "Eiffel" in contexts and PAYLOAD in contexts and "café" in contexts, contexts
    assert browser.find_element("css selector", "#activation").text.startswith("activation ")
    assert browser.execute_script("return window.PWNED") is None
    browser.execute_script("arguments[0].dispatchEvent(new MouseEvent('click', {bubbles: true}))", features[-1])
    exported = browser.execute_script("return window.exportPinned()")
    assert len(exported["nodes"]) == (2 if len(features) > 1 else 0), exported
    json.dumps(exported)
    edges = browser.find_element("css selector", "#edges-shown").text
    browser.execute_script("const s = document.getElementById('threshold'); s.value = 90; "
                           "s.dispatchEvent(new Event('input'))")
    assert browser.find_element("css selector", "#edges-shown").text != edges, "the slider hid no edge"
    screenshot(browser, "graph_clicked")


def test_attention_page_has_one_thumbnail_per_head_and_says_where_there_is_none(browser, pages):
    path, facts = pages["attention"]
    open_page(browser, path)
    assert browser.execute_script("return document.querySelectorAll('canvas.head').length") == facts["heads"] > 0
    declined = browser.execute_script("return document.querySelectorAll('.no-attention').length")
    assert declined == facts["declined"] > 0


def test_lens_and_study_pages_have_one_cell_per_value(browser, pages):
    path, facts = pages["lens"]
    open_page(browser, path)
    assert browser.execute_script("return document.querySelectorAll('#lens .cell').length") == facts["cells"]
    open_page(browser, pages["study"][0])
    text = browser.find_element("css selector", "#kind").text
    assert text.startswith("ESTIMATED (--fast)"), text
    cells = browser.execute_script("return document.querySelectorAll('.model .cell').length")
    assert cells == pages["study"][1]["cells"] > 0
    nan = pages["study"][1]["nan"]
    assert browser.execute_script("return document.querySelectorAll('.model .cell.nan').length") == nan


def test_feature_page_has_one_span_per_context_token_one_bar_per_bin_one_row_per_logit(browser, pages):
    path, _ = pages["feature"]
    data = json.loads(re.search(r'id="view-data">(.*?)</script>', path.read_text()).group(1))
    assert len(data["contexts"]) == 8
    open_page(browser, path)
    count = "return document.querySelectorAll(arguments[0]).length"
    assert browser.execute_script(count, "#contexts .ctx-tok") == sum(len(c["tokens"]) for c in data["contexts"])
    assert browser.execute_script(count, "#contexts .ctx-tok.at") == 8
    assert browser.execute_script(count, "#histogram .bin") == len(data["histogram"]["counts"]) == 30
    assert browser.execute_script(count, "tr.logit") == 20


def test_hostile_text_shows_as_text(browser, pages):
    open_page(browser, pages["hostile_lens"][0])
    body = browser.find_element("css selector", "#lens").text
    assert "</script><" in body and "東京" in body and "<img src=x" in body  # (cells show 10 characters)
    assert browser.execute_script("return document.querySelectorAll('main img, main script').length") == 0
    assert browser.execute_script("return document.querySelectorAll('.cell.nan').length") == 2


def test_the_jupyter_frame_runs_the_page(browser, tmp_path):
    """``_repr_html_``'s sandboxed iframe, as a notebook shows it: the page inside runs and draws."""
    from selenium.webdriver.support.ui import WebDriverWait

    page = views.lens_page(tokens=["a", " b"], top_tokens=[["x", "y"]], probabilities=[[0.25, 0.75]])
    notebook = tmp_path / "notebook.html"
    notebook.write_text(f"<!DOCTYPE html><html><body>{page._repr_html_()}</body></html>")
    browser.get_log("browser")
    browser.get(notebook.as_uri())
    browser.switch_to.frame(browser.find_element("css selector", "iframe"))
    try:
        WebDriverWait(browser, 10).until(lambda d: d.execute_script("return document.body.dataset.ready === '1'"))
        assert browser.execute_script("return document.querySelectorAll('#lens .cell').length") == 2
    finally:
        browser.switch_to.default_content()
    assert [e["message"] for e in browser.get_log("browser") if e["level"] == "SEVERE"] == []
