"""``nncanon view FILE_OR_DIR``: serve the views' pages on 127.0.0.1 and print the address.

A folder is served as it is (its ``.html`` pages listed; a folder holding none is refused); an ``.html`` file is
served from its folder; a saved attribution graph (``.pt``, `nncanon.graphs.Graph.to_pt`) or a graph JSON (``.json``,
circuit-tracer's ``create_graph_files`` format: `nncanon.graphs.write_graph_json`) is drawn as ``graph.html``
(`graph_page`, `nncanon.views.graph_json.graph_json_page`) in a temporary folder first. A graph's tokens show as text
with a tokenizer: ``--tokenizer`` (a demo model's name, a hub id or a folder), else the one the graph names
(``cfg["tokenizer"]``, written by ``nncanon graph``), else as ids. Only the loopback address is bound: the pages
are not published to the network.

Bad paths are `InvalidInput` naming the path, never waited on nor half-read: a FIFO, a socket or a device (never
opened), a symbolic link loop or a link to nothing, a ``.pt`` or ``.json`` that is cut or edited (or not a graph).
"""

from __future__ import annotations

import argparse
import errno
import functools
import io
import json
import os
import pickle
import stat
import sys
import tempfile
import threading
from collections.abc import Callable
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from .. import files
from ..errors import InvalidInput, NncanonError
from ..graphs.graph import Graph
from .graph import graph_page
from .graph_json import graph_json_page

HOST = "127.0.0.1"

#: A loader of tokenizers by name: ``(name, recorded) -> tokenizer`` (the CLI's: a demo model's name, a hub id or a
#: folder; ``recorded``: the name comes from the graph, so only local files are read).
TokenizerLoader = Callable[[str, bool], Any]


class _Quiet(SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass


def _mode(target: Path, path: str | Path) -> int:
    """``target``'s mode, links followed; `InvalidInput` for a path that is missing, a loop or unreadable."""
    try:
        return os.stat(target).st_mode
    except OSError as error:
        if error.errno == errno.ELOOP:
            raise InvalidInput(f"{path}: a symbolic link loop (it resolves to itself): give the file or folder "
                               "itself") from None
        if os.path.islink(target):
            raise InvalidInput(f"{path}: a symbolic link to nothing ({os.readlink(target)}): no such file or "
                               "folder") from None
        if error.errno == errno.ENOENT:
            raise InvalidInput(f"{path}: no such file or folder") from None
        raise InvalidInput(f"{path} cannot be read ({error.strerror})") from None


def load_graph(path: str | Path) -> Graph:
    """The graph saved at ``path`` (`Graph.to_pt`), read as a regular file (never a FIFO) and unpickled as tensors and
    plain data only (an edited file runs no code); `InvalidInput` where it is cut, edited, not a saved graph, or holds
    other objects."""
    real = Path(os.path.realpath(path))
    data = files.read_regular(real, "a saved attribution graph", InvalidInput)
    try:
        graph = Graph.from_pt(io.BytesIO(data), weights_only=True)  # (a file from elsewhere runs no code here)
    except InvalidInput:
        raise InvalidInput(f"{path} is not a saved attribution graph (no adjacency_matrix)") from None
    except pickle.UnpicklingError as error:
        if "weights_only" not in str(error) and "Weights only" not in str(error):
            raise InvalidInput(f"{path} cannot be read as a saved attribution graph (UnpicklingError): it was cut "
                               "or edited, or is not a graph saved by Graph.to_pt") from None
        raise InvalidInput(f"{path} holds objects other than tensors and plain data (circuit-tracer's graphs hold "
                           "its config object): nncanon view does not unpickle them, which would run code from the "
                           "file. If you trust it: Graph.from_pt(path).to_pt(new_path), then view new_path") from None
    except Exception as error:  # (torch.load of a cut or edited archive raises many kinds)
        message = " ".join(str(error).split())[:200]
        raise InvalidInput(f"{path} cannot be read as a saved attribution graph ({type(error).__name__}: "
                           f"{message}): it was cut or edited, or is not a graph saved by Graph.to_pt") from None
    for name in ("input_tokens", "active_features", "activation_values", "selected_features", "adjacency_matrix",
                 "logit_targets", "logit_probabilities"):
        if not hasattr(getattr(graph, name), "shape"):
            raise InvalidInput(f"{path}: the graph's {name} is a {type(getattr(graph, name)).__name__}, not a "
                               "tensor: it was edited")
    return graph


def _graph_page(path: str | Path, tokenizer: Any, load_tokenizer: TokenizerLoader | None) -> str:
    """The page of the graph saved at ``path``, its tokens decoded by ``tokenizer`` or the one it names."""
    graph = load_graph(path)
    notes = []
    recorded = graph.cfg.get("tokenizer") if isinstance(graph.cfg, dict) else None
    if tokenizer is None and recorded and load_tokenizer is not None:
        try:
            tokenizer = load_tokenizer(str(recorded), True)
        except Exception as error:  # (a best effort: whatever keeps the named tokenizer from loading is said)
            notes.append(f"The graph names the tokenizer {recorded!r}, which cannot be loaded here "
                         f"({' '.join(str(error).split())[:160]}): tokens are shown by id; pass --tokenizer.")
    try:
        return graph_page(graph, tokenizer, notes=notes)
    except InvalidInput as error:
        raise InvalidInput(f"{path}: {error}") from None
    except (TypeError, AttributeError, IndexError, RuntimeError, ValueError) as error:
        raise InvalidInput(f"{path}: the graph's fields cannot be drawn ({type(error).__name__}: {error}): it was "
                           "edited") from None


def _json_page(path: str | Path) -> str:
    data = files.read_regular(Path(os.path.realpath(path)), "a graph JSON", InvalidInput)
    try:
        record = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as error:
        raise InvalidInput(f"{path} is not a graph JSON nncanon or circuit-tracer wrote: it is not valid JSON "
                           f"({error}); it was cut or edited") from None
    try:
        return graph_json_page(record)
    except InvalidInput as error:
        raise InvalidInput(f"{path} is {error}") from None


def prepare(path: str | Path, tokenizer: Any = None, load_tokenizer: TokenizerLoader | None = None
            ) -> tuple[Path, str]:
    """``(folder to serve, page to open)`` for ``path``: a folder, an ``.html`` page, a ``.pt`` graph or a ``.json``
    graph (``tokenizer``: decodes a ``.pt`` graph's tokens; else ``load_tokenizer`` loads the one it names).

    Raises:
        InvalidInput: no such path, a link loop, a FIFO or device, a folder without pages, a file that is neither
            a page nor a graph, a graph that is cut or edited.
    """
    target = Path(path)
    mode = _mode(target, path)
    if stat.S_ISDIR(mode):
        if not any(entry.name.endswith(".html") for entry in os.scandir(target)):
            raise InvalidInput(f"{path} holds no page (.html) to serve: give a folder nncanon graph or a view's "
                               "write() wrote, or a graph (.pt, .json) itself")
        index = "index.html" if (target / "index.html").exists() else ""
        return target, index
    if not stat.S_ISREG(mode):
        raise InvalidInput(f"{path} is {files.kind(mode)}, not a page (.html), a saved graph (.pt), a graph JSON "
                           "(.json) or a folder; it is not opened")
    if target.suffix == ".html":
        return target.parent, target.name
    if target.suffix in (".pt", ".json"):
        page = _graph_page(path, tokenizer, load_tokenizer) if target.suffix == ".pt" else _json_page(path)
        folder = Path(tempfile.mkdtemp(prefix="nncanon-view-"))
        (folder / "graph.html").write_text(page, encoding="utf-8")
        return folder, "graph.html"
    raise InvalidInput(f"{path}: not a page (.html), a saved graph (.pt), a graph JSON (.json) or a folder")


def make_server(path: str | Path, port: int = 0, quiet: bool = True, tokenizer: Any = None,
                load_tokenizer: TokenizerLoader | None = None) -> tuple[ThreadingHTTPServer, str]:
    """A server of `prepare`'s folder on 127.0.0.1 (``port`` 0: a free one) and the page's address."""
    folder, page = prepare(path, tokenizer, load_tokenizer)
    handler = functools.partial(_Quiet if quiet else SimpleHTTPRequestHandler, directory=str(folder))
    server = ThreadingHTTPServer((HOST, port), handler)
    return server, f"http://{HOST}:{server.server_address[1]}/{page}"


def run_view(args: argparse.Namespace, load_tokenizer: TokenizerLoader | None = None) -> int:
    """``nncanon view``: serve ``args.path`` on ``args.port`` until interrupted; exit code 2 on a bad path, a
    tokenizer that cannot be loaded or a port in use (``load_tokenizer``: the CLI's loader of tokenizers)."""
    try:
        tokenizer = None
        if getattr(args, "tokenizer", None):
            if load_tokenizer is None:
                raise InvalidInput("--tokenizer needs a loader of tokenizers")
            tokenizer = load_tokenizer(args.tokenizer, False)
        server, url = make_server(args.path, args.port, quiet=args.quiet, tokenizer=tokenizer,
                                  load_tokenizer=load_tokenizer)
    except (OSError, ValueError) as error:
        name = f"{type(error).__name__}: " if isinstance(error, NncanonError) else ""
        print(f"nncanon: view: {name}" + " ".join(str(error).split()), file=sys.stderr)
        return 2
    print(f"serving {url}  (Ctrl-C to stop)", flush=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        thread.join()
    except KeyboardInterrupt:
        pass
    finally:
        server.shutdown()
        server.server_close()
    return 0
