"""``nncanon view FILE_OR_DIR``: serve the views' pages on 127.0.0.1 and print the address.

A folder is served as it is (its ``.html`` pages listed); an ``.html`` file is served from its folder; a saved
attribution graph (``.pt``, `nncanon.graphs.Graph.to_pt`) is drawn as ``graph.html`` (`graph_page`) in a temporary
folder first. Only the loopback address is bound: the pages are not published to the network.
"""

from __future__ import annotations

import argparse
import functools
import sys
import tempfile
import threading
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from ..graphs.graph import Graph
from .graph import write_graph_page

HOST = "127.0.0.1"


class _Quiet(SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass


def prepare(path: str | Path) -> tuple[Path, str]:
    """``(folder to serve, page to open)`` for ``path``: a folder, an ``.html`` page or a ``.pt`` graph.

    Raises:
        FileNotFoundError: no such path.
        ValueError: a file that is neither a page nor a saved graph.
    """
    target = Path(path)
    if not target.exists():
        raise FileNotFoundError(f"{path}: no such file or folder")
    if target.is_dir():
        index = "index.html" if (target / "index.html").exists() else ""
        return target, index
    if target.suffix == ".html":
        return target.parent, target.name
    if target.suffix == ".pt":
        folder = Path(tempfile.mkdtemp(prefix="nncanon-view-"))
        write_graph_page(Graph.from_pt(target), folder / "graph.html")
        return folder, "graph.html"
    raise ValueError(f"{path}: not a page (.html), a saved graph (.pt) or a folder")


def make_server(path: str | Path, port: int = 0, quiet: bool = True) -> tuple[ThreadingHTTPServer, str]:
    """A server of `prepare`'s folder on 127.0.0.1 (``port`` 0: a free one) and the page's address."""
    folder, page = prepare(path)
    handler = functools.partial(_Quiet if quiet else SimpleHTTPRequestHandler, directory=str(folder))
    server = ThreadingHTTPServer((HOST, port), handler)
    return server, f"http://{HOST}:{server.server_address[1]}/{page}"


def run_view(args: argparse.Namespace) -> int:
    """``nncanon view``: serve ``args.path`` on ``args.port`` until interrupted; exit code 2 on a bad path or a port
    in use."""
    try:
        server, url = make_server(args.path, args.port, quiet=args.quiet)
    except (OSError, ValueError) as error:
        print(f"nncanon: view: {error}", file=sys.stderr)
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
