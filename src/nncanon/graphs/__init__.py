"""Attribution graphs (circuit tracing over transcoders) on the standard surface.

- `Graph` (``graph``): circuit-tracer's graph record and node order, saved and loaded as ``.pt``.
- `attribute`, `support` (``proof``): a graph of a prompt over per-layer transcoders (``attribution``: circuit-tracer's
  algorithm) on the frozen replacement model (``replacement``: every norm's scale and attention pattern written back
  with the clean run's, MLP outputs fixed), on a model `support` proved linear (or why not); `verify`
  (``verify``): the checks that a graph's edges are exact (completeness, removal effects).
- `prune`, `graph_scores` (``prune``): circuit-tracer's pruning by influence and its replacement / completeness
  scores.
- `write_graph_json`, `load_transcoders`, `load_clt`, `save_clt` (``formats``): the graph JSON of circuit-tracer's
  frontend and Neuronpedia, circuit-tracer's transcoder sets and cross-layer transcoders; Google's Gemma Scope
  transcoders and CLTs (``gemma_scope``), read by `load_transcoders`.
- `CrossLayerTranscoder` (``coders``): circuit-tracer's CLT; `random_clt`, `random_transcoders`: random sets for
  checks.
- `qk_attribution`, `QKAttribution` (``qk``): one attention score split into pairs of a graph's source nodes,
  checked by `verify_qk`.
- `demo_transcoders` (``demo``): the demo models' shipped transcoders; ``cli``: the ``nncanon graph`` command.

See ``docs/graphs.md``.
"""

from .coders import CrossLayerTranscoder
from .demo import demo_transcoders
from .formats import graph_json, load_clt, load_transcoders, save_clt, write_graph_json
from .graph import Graph
from .memory import GraphTooLarge, MemoryEstimate
from .proof import attribute, support
from .prune import PruneResult, graph_scores, node_influence, prune
from .qk import QKAttribution, qk_attribution
from .verify import GraphCheck, QKCheck, random_clt, random_transcoders, verify, verify_qk

__all__ = ["CrossLayerTranscoder", "Graph", "GraphCheck", "GraphTooLarge", "MemoryEstimate", "PruneResult",
           "QKAttribution", "QKCheck", "attribute", "demo_transcoders", "graph_json", "graph_scores", "load_clt",
           "load_transcoders", "node_influence", "prune", "qk_attribution", "random_clt", "random_transcoders",
           "save_clt", "support", "verify", "verify_qk", "write_graph_json"]
