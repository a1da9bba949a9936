"""``nncanon view`` on bad paths: a FIFO (never opened: a plain read would wait for a writer for ever), a symbolic
link loop or a link to nothing, a ``.pt`` graph or graph JSON that is cut or edited, a folder holding no page: each
`InvalidInput` naming the path (exit code 2, one line), nothing served. A graph's tokens show as text with
``--tokenizer`` or the tokenizer the graph names; a graph JSON is drawn as its nodes and links."""

from __future__ import annotations

import json
import os
import re

import pytest
import torch

from nncanon import InvalidInput, TokenizerNotFound, cli, graphs
from nncanon.cli import main
from nncanon.views.cli import prepare

from .graph_helpers import synthetic_graph


def _data(folder_page):
    folder, page = folder_page
    return json.loads(re.search(r'id="view-data">(.*?)</script>', (folder / page).read_text(), re.S).group(1))


def _saved(tmp_path, **cfg):
    graph = synthetic_graph()
    graph.cfg.update(cfg)
    graph.to_pt(tmp_path / "graph.pt")
    return graph


def _bad(case, tmp_path):
    """``(path, what the message says)`` for ``case``, the path made so."""
    path = tmp_path / "bad.pt"
    if case == "fifo":
        os.mkfifo(path)
        return path, "is a FIFO, not a page"
    if case == "link loop":
        os.symlink(tmp_path / "loop.pt", tmp_path / "loop.pt")
        return tmp_path / "loop.pt", "a symbolic link loop"
    if case == "link to nothing":
        os.symlink(tmp_path / "gone.pt", path)
        return path, "a symbolic link to nothing"
    if case == "cut .pt":
        _saved(tmp_path)
        path.write_bytes((tmp_path / "graph.pt").read_bytes()[:300])
        return path, "cannot be read as a saved attribution graph"
    if case == "not a graph .pt":
        torch.save([1, 2, 3], path)
        return path, "is not a saved attribution graph"
    if case == "edited .pt":
        _saved(tmp_path)
        record = torch.load(tmp_path / "graph.pt", weights_only=False)
        record["adjacency_matrix"] = record["adjacency_matrix"][:-1]
        torch.save(record, path)
        return path, "adjacency_matrix is .* a field comes from another graph"
    if case == "a list as a field":
        _saved(tmp_path)
        record = torch.load(tmp_path / "graph.pt", weights_only=False)
        record["input_tokens"] = record["input_tokens"].tolist()
        torch.save(record, path)
        return path, "input_tokens is a list, not a tensor"
    if case == "a pickle that runs code":
        torch.save({"adjacency_matrix": torch.zeros(1), "cfg": _RunsCode(tmp_path / "ran")}, path)
        return path, "holds objects other than tensors and plain data"
    graphs.write_graph_json(synthetic_graph(), tmp_path, "good", _Tokenizer())
    text = (tmp_path / "good.json").read_text()
    path = tmp_path / "bad.json"
    if case == "cut .json":
        path.write_text(text[: len(text) // 2])
        return path, "not valid JSON"
    record = json.loads(text)
    if case == "edited .json":
        record["links"][0]["target"] = "nowhere"
    elif case == "a weight that is text":
        record["links"][0]["weight"] = "heavy"
    path.write_text(json.dumps(record))
    return path, "is not a graph JSON nncanon or circuit-tracer wrote"


class _RunsCode:
    """An object whose unpickling makes a folder: what an edited ``.pt`` could do instead."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return os.mkdir, (self.marker,)


class _Tokenizer:
    def decode(self, ids):
        return "".join(f"<{int(i)}>" for i in ids)

    def __len__(self):
        return 1000


CASES = ["fifo", "link loop", "link to nothing", "cut .pt", "not a graph .pt", "edited .pt", "a list as a field",
         "a pickle that runs code", "cut .json", "edited .json", "a weight that is text"]


@pytest.mark.parametrize("case", CASES)
def test_a_bad_path_is_invalid_input_and_nothing_is_served(case, tmp_path, capsys):
    path, says = _bad(case, tmp_path)
    with pytest.raises(InvalidInput, match=says):
        prepare(path)
    assert main(["view", str(path), "--port", "0", "-q"]) == 2  # (refused before any server starts)
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("nncanon: view: InvalidInput: ") and str(path) in err, err
    assert not (tmp_path / "ran").exists()  # (nothing in the file ran)


def test_a_folder_without_pages_is_refused_and_a_graph_json_is_drawn(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "named.pt").mkdir()
    for folder in ("empty", "named.pt"):
        with pytest.raises(InvalidInput, match="holds no page"):
            prepare(tmp_path / folder)
    graph = synthetic_graph()
    graphs.write_graph_json(graph, tmp_path, "good", _Tokenizer())
    record = json.loads((tmp_path / "good.json").read_text())
    data = _data(prepare(tmp_path / "good.json"))
    assert data["tokens"] == record["metadata"]["prompt_tokens"] == [f"<{int(t)}>" for t in graph.input_tokens]
    assert len(data["nodes"]["kind"]) == len(record["nodes"]) and len(data["w"]) == len(record["links"])
    ids = [node["node_id"] for node in record["nodes"]]
    for e, link in enumerate(record["links"]):  # every link drawn between the nodes it names, with its weight
        assert (ids[data["src"][e]], ids[data["tgt"][e]]) == (link["source"], link["target"])
        assert data["w"][e] == pytest.approx(link["weight"], rel=1e-3)
    assert data["logits"] == [f"<{int(t)}>" for t in graph.logit_targets]


def test_tokens_show_as_text_with_the_tokenizer_given_or_named(tmp_path, capsys):
    tokenizer = cli._tokenizer("gpt2")
    graph = _saved(tmp_path, tokenizer="gpt2")
    expected = [tokenizer.decode([int(t)]) for t in graph.input_tokens]
    assert _data(prepare(tmp_path / "graph.pt", load_tokenizer=cli._tokenizer))["tokens"] == expected  # named
    assert _data(prepare(tmp_path / "graph.pt", tokenizer))["tokens"] == expected  # given (--tokenizer)
    assert _data(prepare(tmp_path / "graph.pt"))["tokens"] == [f"#{int(t)}" for t in graph.input_tokens]
    _saved(tmp_path, tokenizer=str(tmp_path / "no-tokenizer-here"))
    folder, page = prepare(tmp_path / "graph.pt", load_tokenizer=cli._tokenizer)  # named but not here: ids, said
    assert "names the tokenizer" in (folder / page).read_text() and _data((folder, page))["tokens"][0][0] == "#"
    with pytest.raises(TokenizerNotFound, match="no-tokenizer-here"):
        cli._tokenizer(str(tmp_path / "no-tokenizer-here"))
    assert main(["view", str(tmp_path / "graph.pt"), "--tokenizer", str(tmp_path / "nothing"), "-q"]) == 2
    assert "TokenizerNotFound: no tokenizer" in capsys.readouterr().err
