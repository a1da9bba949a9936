"""Pictures in the browser: each view one self-contained HTML page (no network), also shown inline in Jupyter.

- `graph_page`, `write_graph_page` (``graph``): a pruned attribution graph (`nncanon.graphs.Graph`);
  `graph_json_page` (``graph_json``): a graph JSON (circuit-tracer's format, `nncanon.graphs.write_graph_json`).
- `attention_page` (``attention``): every layer's and head's attention pattern, tokens on both axes.
- `lens_page` (``lens``): the logit lens, layers x positions with the top token and its probability.
- `feature_page` (``features``): a dictionary feature's dashboard (top contexts, histogram, promoted logits).
- `study_page` (``studies``): the ablation / patching heatmaps of ``nncanon ablate``, models side by side.
- `Page` (``page``): a page (``str(page)``, ``page.write(path)``, ``_repr_html_``).

``nncanon view FILE_OR_DIR`` serves pages on 127.0.0.1. See ``docs/views.md``.
"""

from .attention import attention_data, attention_page
from .features import feature_data, feature_page
from .graph import bytes_per_node, graph_data, graph_page, write_graph_page
from .graph_json import graph_json_page
from .lens import lens_data, lens_page
from .page import Page
from .studies import study_page

__all__ = ["Page", "attention_data", "attention_page", "bytes_per_node", "feature_data", "feature_page",
           "graph_data", "graph_json_page", "graph_page", "lens_data", "lens_page", "study_page", "write_graph_page"]
