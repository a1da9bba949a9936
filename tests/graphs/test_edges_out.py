"""Where a graph is written: ``nncanon graph --out`` and `write_graph_json` refuse a path that is a symbolic link, a
FIFO, a file, a read-only folder or holds a cut listing (`CannotWrite`, before the model loads); a folder of earlier
graphs keeps them and a graph of the same slug is replaced whole; a write that fails midway leaves the earlier files
as they were and no temporary; two writers of one folder (threads, processes) are serialised by its lock, or the
one that waits too long is told who holds it. ``offload="disk"``'s folder: missing, a file or read-only is
`CannotWrite`, a full disk `GraphTooLarge`, each before anything is left there."""

from __future__ import annotations

import errno
import json
import multiprocessing
import os
import tempfile
import threading
from pathlib import Path

import pytest
import torch

from nncanon import CannotWrite, InvalidArgument, cli, files, graphs
from nncanon.cli import EXIT_USAGE, main
from nncanon.graphs import formats
from nncanon.graphs.memory import GraphTooLarge

from ..views.graph_helpers import synthetic_graph
from .conftest import PROMPT


class _Tokenizer:
    """What `write_graph_json` asks of a tokenizer."""

    def decode(self, ids):
        return "".join(f"<{int(i)}>" for i in ids)


def _write(folder, slug, seed=0):
    return graphs.write_graph_json(synthetic_graph(seed=seed), folder, slug, _Tokenizer())


def _snapshot(folder):
    """Every file of ``folder`` (names and bytes; a FIFO or link by its kind)."""
    out = {}
    for entry in sorted(os.scandir(folder), key=lambda e: e.name):
        regular = entry.is_file(follow_symlinks=False)
        out[entry.name] = Path(entry.path).read_bytes() if regular else files.kind(os.lstat(entry.path).st_mode)
    return out


def _no_temporaries(folder):
    return not [name for name in os.listdir(folder) if name.startswith(files.TEMPORARY_PREFIX)]


# -- --out refused before the model loads ------------------------------------------------------------------------


def _bad_out(case, tmp_path, monkeypatch):
    """``(the --out path, what the message says)`` for ``case``, the path made so."""
    target = tmp_path / "elsewhere"
    target.mkdir()
    out = tmp_path / "out"
    if case == "symlink":
        out.symlink_to(target)
        return out, "is a symbolic link"
    if case == "dangling symlink":
        out.symlink_to(tmp_path / "nothing")
        return out, "is a symbolic link"
    if case == "fifo":
        os.mkfifo(out)
        return out, "is a FIFO, not a folder"
    if case == "file":
        out.write_text("precious")
        return out, "is a regular file, not a folder"
    if case == "read-only folder":  # (root writes anywhere: the access check is what refuses, so it is simulated)
        out.mkdir()
        real = os.access
        monkeypatch.setattr(files.os, "access", lambda p, mode, **kw: False if str(p) == str(out) else real(p, mode))
        return out, "cannot write into"
    if case == "below a file":
        (tmp_path / "a-file").write_text("x")
        return tmp_path / "a-file" / "out", "a-file is a file"
    out.mkdir()
    if case == "cut listing":
        _write(out, "earlier")
        listing = out / formats.LISTING
        listing.write_bytes(listing.read_bytes()[:40])
        return out, "graph-metadata.json is not a list of graphs"
    if case == "fifo listing":
        os.mkfifo(out / formats.LISTING)
        return out, "graph-metadata.json is a FIFO"
    if case == "folder at the page's name":
        (out / "graph.html").mkdir()
        return out, "graph.html is a folder, not a regular file"
    raise AssertionError(case)


BAD_OUT = ["symlink", "dangling symlink", "fifo", "file", "read-only folder", "below a file", "cut listing",
           "fifo listing", "folder at the page's name"]


@pytest.mark.parametrize("case", BAD_OUT)
def test_a_bad_out_is_cannot_write_before_the_model_loads(case, tmp_path, monkeypatch, capsys):
    out, says = _bad_out(case, tmp_path, monkeypatch)
    before = _snapshot(tmp_path)

    def never(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(cli, "_load", never)
    assert main(["graph", PROMPT, "--out", str(out), "-q"]) == EXIT_USAGE
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "CannotWrite: " in err and says in err, err
    assert _snapshot(tmp_path) == before  # nothing written, created or replaced, the link's target untouched
    if case not in ("below a file", "read-only folder", "folder at the page's name"):
        with pytest.raises(CannotWrite, match=says):  # the library's writer: the same rules
            _write(out, "graph")
        assert _snapshot(tmp_path) == before


@pytest.mark.parametrize(("options", "says"), [
    (["--offload", "disk", "--offload-dir", "nowhere"], "CannotWrite: offload='disk': the folder of the rows' files"),
    (["--offload-dir", "."], "InvalidArgument: offload_dir='.' is for offload='disk'"),
])
def test_an_offload_folder_is_refused_before_the_model_loads(options, says, tmp_path, monkeypatch, capsys):
    def never(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(cli, "_load", never)
    assert main(["graph", PROMPT, "--out", str(tmp_path), *options, "-q"]) == EXIT_USAGE
    assert says in capsys.readouterr().err and os.listdir(tmp_path) == []


@pytest.mark.parametrize("slug", ["../escape", ".hidden", "a/b", ""])
def test_a_slug_that_is_no_file_name_is_refused(slug, tmp_path, capsys):
    assert main(["graph", PROMPT, "--out", str(tmp_path), "--slug", slug, "-q"]) == EXIT_USAGE
    assert "InvalidArgument" in capsys.readouterr().err
    with pytest.raises(InvalidArgument, match="slug"):
        _write(tmp_path, slug)
    assert os.listdir(tmp_path) == [] and not (tmp_path.parent / "escape.json").exists()


# -- earlier graphs, failures midway, two writers -----------------------------------------------------------------


def test_a_write_failing_midway_replaces_nothing(tmp_path, monkeypatch):
    _write(tmp_path, "graph", seed=1)
    before = _snapshot(tmp_path)
    real, calls = os.fsync, []

    def full(descriptor):  # the disk fills on the second file (the listing): the graph's JSON was written whole
        calls.append(descriptor)
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(descriptor)

    monkeypatch.setattr(files.os, "fsync", full)
    with pytest.raises(CannotWrite, match=r"graph-metadata.json cannot be written \(No space left on device\); "
                                          "nothing was replaced"):
        _write(tmp_path, "graph", seed=2)
    assert _snapshot(tmp_path) == before and _no_temporaries(tmp_path)


def test_a_writer_waiting_too_long_is_told_who_holds_the_folder(tmp_path, monkeypatch):
    monkeypatch.setattr(formats, "LOCK_WAIT", 0.2)
    with formats.writing(tmp_path):
        before = _snapshot(tmp_path)
        with pytest.raises(CannotWrite, match=rf"being written by pid {os.getpid()} .*\(waited 0.2 s\)"):
            _write(tmp_path, "late")
        assert _snapshot(tmp_path) == before
    _write(tmp_path, "late")  # the lock is dropped with the holder
    assert [g["slug"] for g in json.loads((tmp_path / formats.LISTING).read_text())["graphs"]] == ["late"]


def _writer(folder, slugs):
    for slug in slugs:
        _write(folder, slug, seed=len(slug))


@pytest.mark.parametrize("how", ["threads", "processes"])
def test_two_writers_of_one_folder_lose_no_graph(how, tmp_path):
    """Without the lock, the listing's read-modify-write let one writer drop the other's entries."""
    slugs = [[f"a{i}" for i in range(6)] + ["same"], [f"b{i}" for i in range(6)] + ["same"]]
    if how == "threads":
        workers = [threading.Thread(target=_writer, args=(tmp_path, s)) for s in slugs]
    else:
        context = multiprocessing.get_context("fork")
        workers = [context.Process(target=_writer, args=(tmp_path, s)) for s in slugs]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(60)
        assert getattr(worker, "exitcode", 0) == 0
    listing = json.loads((tmp_path / formats.LISTING).read_text())
    assert sorted(g["slug"] for g in listing["graphs"]) == sorted({*slugs[0], *slugs[1]})
    for slug in {*slugs[0], *slugs[1]}:
        assert json.loads((tmp_path / f"{slug}.json").read_text())["metadata"]["slug"] == slug
    assert _no_temporaries(tmp_path)


# -- offload="disk": the rows' folder -----------------------------------------------------------------------------


@pytest.mark.parametrize("case", ["missing", "a file", "read-only", "full", "not disk", "no temporary folder"])
def test_the_offload_folder_refused_by_name_and_left_empty(case, model, transcoders, tmp_path, monkeypatch):
    folder = tmp_path / "rows"
    folder.mkdir()
    error, says = CannotWrite, "does not exist or is not a folder"
    options = {"offload": "disk", "offload_dir": folder}
    if case == "missing":
        options["offload_dir"] = tmp_path / "nowhere"
    elif case == "a file":
        (tmp_path / "a-file").write_text("x")
        options["offload_dir"] = tmp_path / "a-file"
    elif case == "read-only":
        monkeypatch.setattr(files.os, "access", lambda p, mode, **kw: False)
        says = "cannot write into"
    elif case == "full":
        def full(descriptor, offset, length):
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(os, "posix_fallocate", full)
        error, says = GraphTooLarge, r"needs .* GiB in .*rows, which cannot hold it \(No space left on device\)"
    elif case == "not disk":
        options["offload"], error, says = None, InvalidArgument, "is for offload='disk'"
    else:
        def nowhere():
            raise FileNotFoundError(2, "No usable temporary directory found")

        monkeypatch.setattr(tempfile, "gettempdir", nowhere)
        options["offload_dir"], says = None, "no temporary folder to hold the rows' files"
    with pytest.raises(error, match=says):
        graphs.attribute(model, PROMPT, transcoders, max_n_logits=2, max_feature_nodes=4, **options)
    assert os.listdir(folder) == []


def test_rows_in_the_offload_folder_are_the_same_graph_and_leave_nothing(model, transcoders, tmp_path, monkeypatch):
    options = {"max_n_logits": 2, "max_feature_nodes": 6}
    reference = graphs.attribute(model, PROMPT, transcoders, **options)
    monkeypatch.setenv("TMPDIR", str(tmp_path / "not-this"))  # (offload_dir wins over TMPDIR)
    graph = graphs.attribute(model, PROMPT, transcoders, offload="disk", offload_dir=tmp_path, **options)
    assert torch.equal(graph.adjacency_matrix, reference.adjacency_matrix)
    assert os.listdir(tmp_path) == []  # (the files' names are removed once mapped)
