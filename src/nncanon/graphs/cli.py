"""``nncanon graph``: an attribution graph of a prompt, written where circuit-tracer's frontend reads it.

`run` takes the parsed arguments (``nncanon.cli.build_parser``'s ``graph`` command) and a loader of models by name
(the CLI's: a demo model's name, a hub id or a local folder), builds `nncanon.graphs.attribute` over the
transcoders asked for (the demo set of a demo model by default), and writes into ``--out``: ``<slug>.json`` and
``graph-metadata.json`` (`nncanon.graphs.write_graph_json`: the graph pruned by influence, as circuit-tracer's
``create_graph_files`` writes it), ``<slug>.pt`` (the unpruned `Graph`, circuit-tracer's ``Graph.to_pt`` layout,
its ``cfg`` naming the model and tokenizer for ``nncanon view``) and, from the CLI, ``graph.html`` (the page of
`nncanon.views`, pruned as the JSON is).

``--out`` is checked before the model loads: a symbolic link, a FIFO, a file, a read-only folder or a listing that
is cut or edited is `CannotWrite`. The files are written together (`nncanon.files.write_all`: each to a temporary
file, all renamed once all are whole, the listing last) while the folder's lock is held (another ``nncanon graph``
writing the same folder waits for it, `nncanon.graphs.formats.LOCK_WAIT` seconds at most): a folder holding earlier
graphs keeps them (the listing names every slug; ``graph.html`` is the latest graph's page), and a graph of the same
slug is replaced whole.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .. import files
from ..errors import CannotWrite, InvalidArgument, InvalidDictionary, InvalidInput, NncanonError
from ..sae import Dictionary
from .attribution import check_offload
from .demo import DEMO_TRANSCODERS, demo_name, demo_transcoders
from .formats import check_slug, graph_files, load_transcoders, read_listing, writing
from .graph import Graph
from .proof import attribute
from .prune import graph_scores, prune

#: A maker of a graph's page: ``(graph, tokenizer, **options) -> html`` (`nncanon.views.graph_page`).
PageMaker = Callable[..., str]

#: Exit codes (the CLI's): success, bad usage or input (the message on stderr).
OK, USAGE = 0, 2


def check_arguments(args: argparse.Namespace) -> None:
    """What can be refused before a model loads: an empty prompt, thresholds outside [0, 1], a count below 1, a slug
    that is no file name; an ``--out`` that is a symbolic link, a FIFO, a file or not writable, or holds a listing
    that is cut or edited; an ``--offload-dir`` without ``--offload disk``, missing or read-only. Raises
    `InvalidInput`, `InvalidArgument` or `CannotWrite`."""
    if not args.prompt.strip():
        raise InvalidInput("the prompt is empty: an attribution graph needs at least one token")
    for name in ("node_threshold", "edge_threshold", "desired_logit_prob"):
        value = getattr(args, name)
        if not 0 <= value <= 1:
            raise InvalidArgument(f"--{name.replace('_', '-')} must be in [0, 1], not {value}")
    for name in ("max_feature_nodes", "max_n_logits", "batch_size"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise InvalidArgument(f"--{name.replace('_', '-')} must be at least 1, not {value}")
    slug = args.slug if args.slug is not None else default_slug(args.prompt)
    check_slug(slug)
    check_offload(getattr(args, "offload", None), getattr(args, "offload_dir", None))
    problem = files.folder_problem(Path(args.out))
    if problem is not None:
        raise CannotWrite(f"--out {args.out}: {problem}; give a folder to write the graph files into")
    if Path(args.out).is_dir():
        read_listing(args.out)
        for name in (f"{slug}.pt", f"{slug}.json", "graph.html"):  # (a FIFO or folder there: refused now)
            files.check_replaceable(Path(args.out) / name, CannotWrite)


def transcoders_for(model: Any, spec: str | None) -> list[Dictionary]:
    """The transcoders ``--transcoders`` names: ``None`` or ``"demo"``, the demo set of a demo model; a demo model's
    name, its set; anything `load_transcoders` reads (a circuit-tracer config or its folder, a cross-layer
    transcoder's folder, a path with ``{layer}``: Gemma Scope's folders...)."""
    if spec is None or spec == "demo":
        if demo_name(model) is None:
            raise InvalidArgument("this model is not a demo model (gpt2, llama, hybrid), so it has no demo "
                                  "transcoders: pass --transcoders CONFIG.yaml (a circuit-tracer transcoder set)")
        return demo_transcoders(model)
    if spec in DEMO_TRANSCODERS:
        return demo_transcoders(spec, dtype=model.dtype)
    if "{layer}" not in spec and not Path(spec).exists():
        raise InvalidDictionary(f"--transcoders {spec}: no such file (a circuit-tracer config .yaml, a folder with "
                                "config.yaml, a cross-layer transcoder's folder, a path with {layer}, or a demo set: "
                                f"{', '.join(DEMO_TRANSCODERS)})")
    return load_transcoders(spec, dtype=model.dtype)


def build(args: argparse.Namespace, model: Any, make_page: PageMaker | None = None) -> tuple[Graph, list[str]]:
    """The graph of ``args.prompt`` on ``model`` and the lines that describe it, the files written (``make_page``:
    a maker of the graph's page, `nncanon.views.graph_page`, called with the pruning thresholds)."""
    transcoders = transcoders_for(model, args.transcoders)
    graph = attribute(model, args.prompt, transcoders, max_n_logits=args.max_n_logits,
                      desired_logit_prob=args.desired_logit_prob, max_feature_nodes=args.max_feature_nodes,
                      batch_size=args.batch_size, offload=getattr(args, "offload", None),
                      offload_dir=getattr(args, "offload_dir", None))
    graph.cfg.update(model_name=args.model, tokenizer=tokenizer_name(args.model))
    out, slug = Path(args.out), args.slug if args.slug is not None else default_slug(args.prompt)
    scan = args.transcoders if args.transcoders not in (None, "demo") else f"nncanon-demo-{demo_name(model)}"
    kept = prune(graph, args.node_threshold, args.edge_threshold)
    replacement, completeness = graph_scores(graph)
    page = None
    if make_page is not None:
        page = make_page(graph, model.tokenizer, node_threshold=args.node_threshold,
                         edge_threshold=args.edge_threshold, pruned=kept)
    with writing(out):
        contents: dict[str, files.Content] = {f"{slug}.pt": graph.to_pt}
        if page is not None:
            contents["graph.html"] = str.__str__(page).encode("utf-8")
        contents.update(graph_files(graph, out, slug, model.tokenizer, scan=str(scan),
                                    node_threshold=args.node_threshold, edge_threshold=args.edge_threshold))
        files.write_all(out, contents, CannotWrite, "nncanon graph")
    path = out / f"{slug}.json"
    decode = model.tokenizer.decode
    targets = ", ".join(f"{decode([int(t)])!r} {float(p):.3f}"
                        for t, p in zip(graph.logit_targets, graph.logit_probabilities, strict=True))
    lines = [f"{graph.n_pos} tokens, {len(graph.active_features)} active features, {graph.n_features} feature nodes, "
             f"{graph.n_nodes} nodes",
             f"logit targets: {targets}",
             f"pruned (node {args.node_threshold}, edge {args.edge_threshold}): {int(kept.node_mask.sum())} nodes, "
             f"{int(kept.edge_mask.sum())} edges",
             f"replacement score {replacement:.3f}, completeness {completeness:.3f}",
             f"wrote {path} (circuit-tracer's frontend: graph-metadata.json beside it) and "
             f"{out / (slug + '.pt')}"]
    if page is not None:
        lines.append(f"wrote {out / 'graph.html'} (the graph's page: `nncanon view {out}` serves it)")
    return graph, lines


def run(args: argparse.Namespace, load: Callable[[str], Any], make_page: PageMaker | None = None) -> int:
    """``nncanon graph``: the exit code; the graph's summary on stdout, a refusal as one line on stderr
    (``make_page``: as `build` takes it)."""
    try:
        check_arguments(args)
    except NncanonError as error:
        return _refused(error)
    try:
        model = load(args.model)
    except (OSError, ValueError) as error:
        message = " ".join(str(error).split()) or type(error).__name__
        print(message if isinstance(error, NncanonError) else f"cannot load {args.model!r}: {message}",
              file=sys.stderr)
        return USAGE
    try:
        _, lines = build(args, model, make_page)
    except NncanonError as error:
        return _refused(error)
    print("\n".join(lines))
    return OK


def _refused(error: Exception) -> int:
    print(f"nncanon graph: {type(error).__name__}: " + " ".join(str(error).split()), file=sys.stderr)
    return USAGE


def tokenizer_name(model: str) -> str:
    """How ``nncanon view`` finds the tokenizer of a model named ``model`` (a demo model's name, a hub id, or a local
    folder: its absolute path)."""
    path = Path(model)
    return str(path.resolve()) if path.is_dir() else model


def default_slug(prompt: str) -> str:
    """A file name from the prompt's first words (``the-eiffel-tower-is``)."""
    words = ["".join(c for c in word.lower() if c.isalnum()) for word in prompt.split()]
    return "-".join(w for w in words if w)[:40] or "graph"

