"""The views' pages without a browser: their data against the Graph / tensors they come from, escaping, named
errors on bad input, Jupyter's ``_repr_html_``, and ``nncanon view``."""

from __future__ import annotations

import html
import json
import re
import threading
import urllib.request
from dataclasses import replace

import pytest
import torch

import nncanon
from nncanon import graphs, views
from nncanon.cli import main
from nncanon.errors import InvalidInput
from nncanon.sae.tools import TopContexts
from nncanon.views.features import decoder_logits, feature_data
from nncanon.views.page import script_json
from nncanon.views.studies import study_data

from . import conftest
from .graph_helpers import synthetic_graph

PAYLOAD = "</script><script>window.PWNED=1</script>"


class Tokenizer:
    """Decodes id 0 as a script and the others as non-ASCII text (a stand-in for a hostile vocabulary)."""

    def __len__(self) -> int:
        return 50

    def decode(self, ids: list[int]) -> str:
        return PAYLOAD if ids[0] == 0 else f" 東京{ids[0]}<b>"


@pytest.fixture(scope="module")
def gpt2():
    return nncanon.demo_model("gpt2")


def embedded(page) -> dict:
    """The JSON a page embeds."""
    return json.loads(re.search(r'id="view-data">(.*?)</script>', str(page), re.S).group(1))


def test_embedded_json_cannot_close_its_script_and_round_trips():
    data = {"t": [PAYLOAD, "<!--", "a\u2028b", "&amp;", float("nan")]}
    text = script_json(data)
    assert "<" not in text and ">" not in text and "\u2028" not in text
    assert json.loads(text) == {"t": [PAYLOAD, "<!--", "a\u2028b", "&amp;", None]}


def test_graph_page_holds_the_kept_nodes_and_edges_of_prune():
    graph = synthetic_graph(n_layers=3, n_pos=4, per_cell=3, seed=1)
    graph.input_tokens[0] = 0  # the payload token
    page = views.graph_page(graph, Tokenizer(), node_threshold=1.0, edge_threshold=0.95)
    data = embedded(page)
    node_mask, edge_mask, _ = graphs.prune(graph, 1.0, 0.95)
    kept = node_mask.nonzero().flatten().tolist()
    assert len(data["nodes"]["kind"]) == len(kept) == int(node_mask.sum())
    assert data["nodes"]["kind"].count(2) == graph.n_pos and data["nodes"]["kind"].count(3) == graph.n_logits
    expected = {(kept.index(int(s)), kept.index(int(t)))
                for t, s in edge_mask.nonzero().tolist() if graph.adjacency_matrix[t, s] != 0
                and node_mask[s] and node_mask[t]}
    assert set(zip(data["src"], data["tgt"], strict=True)) == expected
    for src, tgt, weight in zip(data["src"], data["tgt"], data["w"], strict=True):
        assert weight == pytest.approx(float(graph.adjacency_matrix[kept[tgt], kept[src]]), rel=1e-3)
    assert data["tokens"][0] == PAYLOAD and PAYLOAD not in str(page)  # escaped in the page, intact in the data
    shares = [s for s, k in zip(data["nodes"]["share"], data["nodes"]["kind"], strict=True) if k == 1]
    assert shares and all(0 <= s <= 1 for s in shares)
    assert views.bytes_per_node(page) == pytest.approx(page.size / len(kept))
    assert isinstance(page, str) and page.startswith("<!DOCTYPE html>") and page.kind == "graph"


def test_graph_page_in_jupyter_is_a_sandboxed_iframe_of_the_page():
    page = views.graph_page(synthetic_graph())
    frame = page._repr_html_()
    assert frame.startswith("<iframe sandbox=") and "<script" not in frame
    assert html.unescape(re.search(r'srcdoc="(.*)"', frame, re.S).group(1)) == str(page)


@pytest.mark.parametrize("break_it, message", [
    (lambda g: replace(g, input_tokens=torch.arange(g.n_pos + 2)), "comes from another graph or model"),
    (lambda g: replace(g, activation_values=torch.full_like(g.activation_values, float("nan"))), "NaN"),
    (lambda g: replace(g, adjacency_matrix=g.adjacency_matrix * float("nan")), "NaN"),
    (lambda g: replace(g, logit_probabilities=g.logit_probabilities[:1]), "logit_probabilities"),
    (lambda g: replace(g, input_tokens=g.input_tokens + 1000), "another model"),
])
def test_a_graph_that_does_not_hold_together_is_refused_with_the_reason(break_it, message):
    with pytest.raises(InvalidInput, match=message):
        views.graph_page(break_it(synthetic_graph()), Tokenizer())


def test_a_prune_of_another_graph_is_refused():
    other = graphs.prune(synthetic_graph(n_pos=4), 1.0, 1.0)
    with pytest.raises(InvalidInput, match="a prune of another graph"):
        views.graph_page(synthetic_graph(n_pos=3), pruned=other)


def test_an_empty_graph_makes_a_page_that_says_so():
    empty = synthetic_graph(n_pos=1, per_cell=1)
    empty = replace(empty, input_tokens=empty.input_tokens[:0], active_features=empty.active_features[:0],
                    activation_values=empty.activation_values[:0], selected_features=empty.selected_features[:0],
                    logit_targets=empty.logit_targets[:0], logit_probabilities=empty.logit_probabilities[:0],
                    adjacency_matrix=torch.zeros(0, 0))
    page = views.graph_page(empty)
    assert "This graph is empty" in str(page) and embedded(page)["nodes"]["kind"] == []


def test_patterns_lenses_and_activations_of_another_length_are_refused():
    with pytest.raises(InvalidInput, match=r"layer 0 is \[2, 3, 3\], but the prompt has 2 tokens"):
        views.attention_page(tokens=["a", "b"], patterns={0: torch.rand(2, 3, 3)})
    with pytest.raises(InvalidInput, match="the prompt has 3 tokens"):
        views.lens_page(tokens=["a", "b", "c"], top_tokens=[["x", "y"]], probabilities=[[0.5, 0.5]])
    with pytest.raises(InvalidInput, match="text 0 has 2 tokens but 3 activations"):
        feature_data([["a", "b"]], [torch.rand(3)], feature=0)
    with pytest.raises(InvalidInput, match="takes a model and a prompt"):
        views.attention_page()


def test_nan_is_drawn_as_missing_and_said():
    page = views.attention_page(tokens=["a", "b"], patterns={0: torch.full((1, 2, 2), float("nan"))},
                                reasons={1: "layers[1] is a linear mixer"})
    data = embedded(page)
    assert data["layers"][0]["heads"] == [[[None, None], [None, None]]]
    assert data["layers"][1] == {"layer": 1, "reason": "layers[1] is a linear mixer"}
    assert "holds 4 NaN values" in str(page)
    data = feature_data([["a", "b", "c"]], [torch.tensor([float("nan"), 2.0, 1.0])], feature=7, k=5)
    assert data["nan"] == 1 and [c["value"] for c in data["contexts"]] == [2.0, 1.0]
    assert sum(data["histogram"]["counts"]) == 2


def test_study_data_says_exact_or_estimated():
    effects = {"m": torch.tensor([[0.1, float("nan")], [0.2, -0.3]])}
    exact = study_data(effects, " Paris")
    assert exact["kind"] == "exact" and exact["models"][0]["grid"] == [[0.1, None], [0.2, -0.3]]
    estimated = study_data(effects, " Paris", estimated="log_odds")
    assert estimated["kind"] == "estimated" and "estimated drop in the log-odds" in estimated["quantity"]


def test_decoder_logits_are_the_row_through_the_final_norm_and_head(gpt2):
    model = gpt2
    direction = torch.randn(model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    module = model._module
    with torch.no_grad():
        norm, head = module.transformer.ln_f, module.lm_head
        expected = head(norm(direction[None])) - head(norm(torch.zeros(1, model.config.hidden_size)))
    assert torch.allclose(decoder_logits(model, direction), expected[0], atol=1e-5)
    assert decoder_logits(model, torch.zeros(3)) is None


def test_nncanon_view_serves_a_folder_and_a_saved_graph(tmp_path, monkeypatch, capsys):
    page = views.graph_page(synthetic_graph()).write(tmp_path / "graph.html")
    synthetic_graph().to_pt(tmp_path / "graph.pt")
    bodies = []

    def visit_then_stop(thread, timeout=None):  # the server runs; the user reads the address, visits, presses Ctrl-C
        address = re.search(r"serving (http://127\.0\.0\.1:\d+/\S*)", capsys.readouterr().out).group(1)
        root = address.rsplit("/", 1)[0]
        bodies.append(urllib.request.urlopen(f"{root}/graph.html", timeout=10).read().decode())
        raise KeyboardInterrupt

    monkeypatch.setattr(threading.Thread, "join", visit_then_stop)
    assert main(["view", str(tmp_path), "--port", "0", "-q"]) == 0
    assert main(["view", str(tmp_path / "graph.pt"), "--port", "0", "-q"]) == 0
    monkeypatch.undo()
    assert bodies[0] == page.read_text()
    assert bodies[1].startswith("<!DOCTYPE html>") and 'data-view="graph"' in bodies[1]
    assert main(["view", str(tmp_path / "missing")]) == 2
    assert "no such file or folder" in capsys.readouterr().err
    (tmp_path / "notes.txt").write_text("not a page")
    assert main(["view", str(tmp_path / "notes.txt")]) == 2
    assert "not a page (.html), a saved graph (.pt), a graph JSON (.json) or a folder" in capsys.readouterr().err


def test_nncanon_ablate_writes_its_page_beside_the_png(tmp_path, capsys, gpt2):
    assert main(["ablate", "--model", "gpt2", "--fast", "--out", str(tmp_path), "--quiet"]) == 0
    assert f"{tmp_path / 'ablate.html'}" in capsys.readouterr().out
    data = embedded((tmp_path / "ablate.html").read_text())
    assert data["kind"] == "estimated" and [model["name"] for model in data["models"]] == ["gpt2"]
    assert len(data["models"][0]["grid"]) == gpt2.num_layers
    assert list(data["studies"]) == [label for label in data["studies"] if label.startswith("gpt2 (layer ")]
    assert (tmp_path / "head_effects.png").exists()


def test_attention_and_lens_pages_hold_what_plain_transformers_computes(gpt2):
    model = gpt2
    prompt = "The Eiffel Tower is in"
    inputs = model.tokenizer(prompt, return_tensors="pt")
    with torch.no_grad():
        out = model._module(**inputs, output_attentions=True)
    layers = embedded(views.attention_page(model, prompt))["layers"]
    assert [layer["layer"] for layer in layers] == list(range(model.num_layers))
    for layer, reference in zip(layers, out.attentions, strict=True):
        assert torch.allclose(torch.tensor(layer["heads"]), reference[0].float(), atol=6e-4)
    lens = embedded(views.lens_page(model, prompt))
    last = model.tokenizer.convert_ids_to_tokens(out.logits[0].argmax(-1).tolist())
    assert lens["top"][-1] == [model.tokenizer.convert_tokens_to_string([t]) for t in last]
    assert lens["p"][-1] == pytest.approx(out.logits[0].softmax(-1).amax(-1).tolist(), abs=1e-3)


def test_graph_contexts_from_top_contexts_tables_reach_the_page():
    graph = synthetic_graph(n_layers=2, n_pos=3, per_cell=2, seed=3)
    table = TopContexts(features=torch.tensor([0, 1]), values=torch.tensor([[3.0, float("nan")], [1.0, 0.5]]),
                        text=torch.tensor([[0, -1], [0, 0]]), position=torch.tensor([[1, -1], [0, 2]]),
                        tokens=[["Le", " café", " <b>", "!"]])
    data = embedded(views.graph_page(graph, contexts={0: table, 1: table}, node_threshold=1.0, edge_threshold=1.0))
    kinds, layers, features = (data["nodes"][key] for key in ("kind", "layer", "feature"))
    shown = {f"{layer}_{feature}" for kind, layer, feature in zip(kinds, layers, features, strict=True)
             if kind == 0 and feature in (0, 1)}
    assert shown and set(data["contexts"]) == shown
    for key in shown:
        expected = [[3.0, "Le", " café", " <b>!"]] if key.endswith("_0") else [[1.0, "", "Le", " café <b>!"],
                                                                              [0.5, "Le café", " <b>", "!"]]
        assert data["contexts"][key] == expected


def test_feature_data_ranks_the_logits_and_refuses_a_vocabulary_of_another_size():
    logits = torch.tensor([0.5, -2.0, 3.0, float("nan"), -1.0])
    data = feature_data([["a"]], [torch.tensor([1.0])], feature=0, logits=logits, vocab=list("vwxyz"), n_logits=2)
    assert data["promoted"] == [["x", 3.0], ["v", 0.5]] and data["suppressed"] == [["w", -2.0], ["z", -1.0]]
    assert feature_data([["a"]], [torch.tensor([1.0])], 0, logits=logits, vocab=lambda i: f"#{i}",
                        n_logits=1)["promoted"] == [["#2", 3.0]]
    with pytest.raises(InvalidInput, match="5 logits but 3 vocabulary strings"):
        feature_data([["a"]], [torch.tensor([1.0])], feature=0, logits=logits, vocab=["a", "b", "c"])


def test_without_chromium_the_browser_tests_skip_saying_how_to_install_it(monkeypatch):
    monkeypatch.setattr(conftest.shutil, "which", lambda name: None)
    assert conftest._chromium()[:2] == (None, None)
    assert "apt-get install -y chromium chromium-driver" in conftest._chromium()[2]


def test_attention_page_of_chosen_layers():
    model = nncanon.demo_model("hybrid")
    layers = embedded(views.attention_page(model, "The Eiffel Tower", layers=[2, 3]))["layers"]
    assert [layer["layer"] for layer in layers] == [2, 3]
    assert "reason" in layers[0] and len(layers[1]["heads"]) == model.config.num_attention_heads
