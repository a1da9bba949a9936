"""``nncanon graph`` on the demo model with its shipped transcoders: the files it writes are the library's graph,
and bad input is refused with a named error (exit code 2, one line on stderr)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from nncanon import InvalidArgument, cli, demo_model, graphs, views
from nncanon.cli import EXIT_OK, EXIT_USAGE, main
from nncanon.graphs import formats

from .test_edges_out import _no_temporaries, _write

PROMPT = "The Eiffel Tower is in the city of"


@pytest.fixture(scope="module")
def gpt2():
    return demo_model("gpt2")


@pytest.fixture(autouse=True)
def loaded_once(gpt2, monkeypatch):
    """The command's loader gives the module's demo GPT-2 for ``gpt2`` (one load and one linearity proof for all the
    tests here, under eager); any other name or attention goes to the CLI's own loader."""
    load = cli._load
    monkeypatch.setattr(cli, "_load", lambda name, attn="eager": gpt2 if (name, attn) == ("gpt2", "eager")
                        else load(name, attn))


def test_graph_command_writes_the_librarys_graph(gpt2, tmp_path, capsys):
    out = tmp_path / "graphs"
    code = main(["graph", "--model", "gpt2", PROMPT, "--out", str(out), "--max-feature-nodes", "16",
                 "--max-n-logits", "2", "--slug", "eiffel", "-q"])
    assert code == EXIT_OK, capsys.readouterr().err
    printed = capsys.readouterr().out
    assert "logit targets: ' Paris'" in printed and "replacement score" in printed
    saved = graphs.Graph.from_pt(out / "eiffel.pt")
    expected = graphs.attribute(gpt2, PROMPT, graphs.demo_transcoders(gpt2), max_n_logits=2, max_feature_nodes=16)
    for name in ("input_tokens", "active_features", "selected_features", "logit_targets"):
        assert torch.equal(getattr(saved, name), getattr(expected, name)), name
    torch.testing.assert_close(saved.adjacency_matrix, expected.adjacency_matrix, rtol=1e-5, atol=1e-6)
    record = json.loads((out / "eiffel.json").read_text())
    assert record["metadata"]["slug"] == "eiffel" and record["metadata"]["prompt"] == saved.input_string
    kinds = {node["feature_type"] for node in record["nodes"]}
    assert {"embedding", "logit"} <= kinds and record["links"]
    ids = {node["node_id"] for node in record["nodes"]}
    assert all(link["source"] in ids and link["target"] in ids for link in record["links"])
    listing = json.loads((out / "graph-metadata.json").read_text())
    assert [g["slug"] for g in listing["graphs"]] == ["eiffel"]
    page = (out / "graph.html").read_text()   # the views' page of the saved graph, pruned as the JSON is
    assert page == views.graph_page(saved, gpt2.tokenizer, node_threshold=0.8, edge_threshold=0.98)
    assert "graph.html" in printed


def _narrow_set(folder, n_layers=4, width=64):
    """A circuit-tracer set of another width than the demo models' 128."""
    lines = ["feature_input_hook: mlp.hook_in", "feature_output_hook: mlp.hook_out", "transcoders:"]
    for layer in range(n_layers):
        save_file({"W_enc": torch.randn(8, width), "W_dec": torch.randn(8, width), "b_enc": torch.zeros(8),
                   "b_dec": torch.zeros(width)}, str(folder / f"layer_{layer}.safetensors"))
        lines += [f"- id: t{layer}", f"  layer: {layer}", f"  filepath: layer_{layer}.safetensors"]
    (folder / "config.yaml").write_text("\n".join(lines) + "\n")
    return folder


@pytest.mark.parametrize("case", ["empty prompt", "bad threshold", "unknown model", "another width", "no such set"])
def test_graph_command_refuses_bad_input_by_name(case, tmp_path, capsys):
    args = {"empty prompt": ["graph", "  ", "--out", str(tmp_path)],
            "bad threshold": ["graph", PROMPT, "--node-threshold", "1.5", "--out", str(tmp_path)],
            "unknown model": ["graph", "--model", str(tmp_path / "missing"), PROMPT, "--out", str(tmp_path)],
            "another width": ["graph", PROMPT, "--transcoders", str(_narrow_set(tmp_path)), "--out", str(tmp_path)],
            "no such set": ["graph", PROMPT, "--transcoders", str(tmp_path / "nothing.yaml"), "--out", str(tmp_path)],
            }[case]
    assert main([*args, "--quiet"]) == EXIT_USAGE
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    expected = {"empty prompt": "InvalidInput: the prompt is empty", "bad threshold": "--node-threshold must be in",
                "unknown model": "cannot load", "another width": "InvalidDictionary",
                "no such set": "InvalidDictionary: --transcoders"}[case]
    assert expected in err, err
    if case == "another width":
        assert "64 -> 64" in err and "128 wide" in err
    assert not list(tmp_path.glob("*.json"))


def test_demo_transcoders_are_one_per_block_and_refuse_other_models():
    for name in ("gpt2", "llama", "hybrid"):
        transcoders = graphs.demo_transcoders(name)
        assert len(transcoders) == 4
        assert all(t.cfg.d_in == 128 and t.cfg.architecture == "jumprelu_transcoder" for t in transcoders)
        assert all(t.dtype == torch.float32 for t in transcoders)
    with pytest.raises(InvalidArgument, match="no demo transcoders for 'qwen3'"):
        graphs.demo_transcoders("qwen3")


def test_a_folder_of_earlier_graphs_keeps_them_and_a_slug_is_replaced_whole(tmp_path, capsys):
    _write(tmp_path, "first", seed=1)
    _write(tmp_path, "eiffel", seed=2)
    kept = (tmp_path / "first.json").read_bytes()
    code = main(["graph", "--model", "gpt2", PROMPT, "--out", str(tmp_path), "--slug", "eiffel",
                 "--max-feature-nodes", "4", "--max-n-logits", "1", "-q"])
    assert code == EXIT_OK, capsys.readouterr().err
    listing = json.loads((tmp_path / formats.LISTING).read_text())
    assert [g["slug"] for g in listing["graphs"]] == ["first", "eiffel"]  # the same slug's entry replaced, not doubled
    assert (tmp_path / "first.json").read_bytes() == kept
    saved = graphs.Graph.from_pt(tmp_path / "eiffel.pt")
    assert saved.cfg["model_name"] == "gpt2" and saved.cfg["tokenizer"] == "gpt2"
    record = json.loads((tmp_path / "eiffel.json").read_text())
    assert record["metadata"]["prompt"] == saved.input_string and listing["graphs"][1] == record["metadata"]
    assert 'data-view="graph"' in (tmp_path / "graph.html").read_text()  # the latest graph's page
    assert _no_temporaries(tmp_path)


def test_attn_sdpa_builds_the_eager_graph(tmp_path, capsys):
    """``--attn sdpa`` loads the model under sdpa (the pattern frozen through the kernel's query and key) and writes
    the graph ``--attn eager`` writes, within rounding."""
    saved = {}
    for attn in ("eager", "sdpa"):
        code = main(["graph", "--model", "gpt2", PROMPT, "--out", str(tmp_path / attn), "--slug", "g", "--attn", attn,
                     "--max-feature-nodes", "8", "--max-n-logits", "2", "-q"])
        assert code == EXIT_OK, capsys.readouterr().err
        saved[attn] = graphs.Graph.from_pt(tmp_path / attn / "g.pt")
        assert saved[attn].cfg["attn_implementation"] == attn
    assert torch.equal(saved["eager"].active_features, saved["sdpa"].active_features)
    assert torch.equal(saved["eager"].selected_features, saved["sdpa"].selected_features)
    torch.testing.assert_close(saved["sdpa"].adjacency_matrix, saved["eager"].adjacency_matrix, rtol=0, atol=1e-5)
    assert saved["eager"].adjacency_matrix.abs().max() > 1e-2
