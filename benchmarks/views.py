"""The attribution graph page at scale: a pruned graph of about 7,500 nodes, its page's size (bytes per node), the
time to build it, and the time until it is drawn and answers a click in headless Chromium.

Run:  python benchmarks/views.py [--repeats 5] [--json out.json]

The graph is `tests/views/graph_helpers.synthetic_graph` (random acyclic weights, circuit-tracer's node order:
25 layers x 20 positions, 14 features in every cell: 7,530 nodes, about 60,000 edges), given to the page as pruned
with every node and nonzero edge kept (a `PruneResult` of those masks: the page's cost depends on what is kept, and
random weights prune, with `--prune`, to far fewer nodes than a real graph of that size keeps);
the browser is the system Chromium (``apt-get install chromium chromium-driver``) driven by selenium. Times:
``ready`` is from the start of navigation to the end of the page's drawing script (``window.viewReady``, on the
page's own clock), ``painted`` to the first frame after it, ``click`` the handling of a click on a feature
(panel, edges redrawn), ``slider`` one move of the threshold slider.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.views.graph_helpers import synthetic_graph  # noqa: E402

from nncanon import graphs, views  # noqa: E402

CLICK = """
const done = arguments[arguments.length - 1];
const node = document.querySelector('#nodes .node.kind-0');
const t0 = performance.now();
node.dispatchEvent(new MouseEvent('click', {bubbles: true}));
const t1 = performance.now();
const slider = document.getElementById('threshold');
slider.value = 50; slider.dispatchEvent(new Event('input'));
const t2 = performance.now();
requestAnimationFrame(() => setTimeout(() => done([t1 - t0, t2 - t1]), 0));
"""

PAINTED = """
const done = arguments[arguments.length - 1];
requestAnimationFrame(() => setTimeout(() => done(performance.now()), 0));
"""


def driver():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium") or shutil.which("chromium-browser")
    for argument in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                     "--window-size=1280,900"):
        options.add_argument(argument)
    return webdriver.Chrome(service=Service(executable_path=shutil.which("chromedriver")), options=options)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", default=None)
    parser.add_argument("--prune", action="store_true",
                        help="prune with graphs.prune (random weights prune to far fewer nodes) instead of keeping "
                             "every node and every nonzero edge")
    args = parser.parse_args()
    start = time.perf_counter()
    graph = synthetic_graph(n_layers=25, n_pos=20, per_cell=14, n_logits=10, density=0.004, seed=0)
    made = time.perf_counter() - start
    start = time.perf_counter()
    pruned = graphs.prune(graph, node_threshold=1.0, edge_threshold=0.99) if args.prune else graphs.PruneResult(
        torch.ones(graph.n_nodes, dtype=torch.bool), graph.adjacency_matrix != 0, torch.zeros(graph.n_nodes))
    pruning = time.perf_counter() - start
    start = time.perf_counter()
    page = views.graph_page(graph, pruned=pruned, title="7,500-node benchmark graph")
    building = time.perf_counter() - start
    kept, edges = int(pruned.node_mask.sum()), len(views.graph_data(graph, pruned=pruned)["w"])
    folder = Path(tempfile.mkdtemp())
    path = page.write(folder / "graph.html")
    browser = driver()
    browser.set_script_timeout(60)
    ready, painted, click, slider = [], [], [], []
    try:
        for _ in range(args.repeats):
            browser.get(path.as_uri())
            while not browser.execute_script("return document.body && document.body.dataset.ready === '1'"):
                time.sleep(0.01)
            ready.append(browser.execute_script("return window.viewReady"))
            painted.append(browser.execute_async_script(PAINTED))
            count = browser.execute_script("return document.querySelectorAll('#nodes .node').length")
            assert count == kept, (count, kept)
            clicked, moved = browser.execute_async_script(CLICK)
            click.append(clicked)
            slider.append(moved)
        version = browser.capabilities.get("browserVersion")
    finally:
        browser.quit()
    result = {
        "nodes": kept, "edges": edges, "graph_nodes": graph.n_nodes, "page_bytes": page.size,
        "bytes_per_node": round(page.size / kept, 1), "build_page_s": round(building, 3),
        "prune_s": round(pruning, 3), "make_graph_s": round(made, 3),
        "ready_ms_median": round(statistics.median(ready), 1),
        "painted_ms_median": round(statistics.median(painted), 1),
        "painted_ms_max": round(max(painted), 1), "click_ms_median": round(statistics.median(click), 1),
        "slider_ms_median": round(statistics.median(slider), 1), "repeats": args.repeats,
        "chromium": version, "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        "load_average": os.getloadavg(), "torch": torch.__version__,
    }
    print(json.dumps(result, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
