"""The ``nncanon`` command line (also ``python -m nncanon``).

Commands:
    nncanon ablate [--model M] ...    the ablation study (clean, mixer, MLP, each head, a skip) and a
                                      layer x head heatmap; with no --model, the three demo models side by side
    nncanon support MODEL [--json]    the support() table of a hub id or local folder
    nncanon families [-k FILTER]      build every registered family's tiny model, check it, print a table
    nncanon matrix [-k FILTER]        run the invariant suite on every registered family; write the status matrix
    nncanon infer MODEL_OR_FOLDER     infer the family record of a model from a twin of its config, prove it, and
                                      print the proof table, the Family(...) and a model_registry record
    nncanon infer --leave-one-out     infer every registered model type with its own record unused; compare
    nncanon view FILE_OR_DIR          serve the views' pages (nncanon.views), a saved graph (.pt, --tokenizer) or a
                                      graph JSON on 127.0.0.1 and print the address

Exit codes: 0 success, 1 a check failed, 2 bad usage or a model that cannot be loaded.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

from .files import unwritable

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


def identity_error(model, prompt: str) -> float | None:
    """Max ``|layer_input + contributions - layer_output|`` over the layers whose every contribution is
    served (attention's, a linear mixer's, the MLP's: those the block has), or ``None`` if no layer's is."""
    import torch

    from .reading import CONTRIBUTIONS, in_execution_order, read
    from .support import COMPONENT_OF

    report = model.support()
    plans = {}
    for index in range(model.num_layers):
        present = [v for v in CONTRIBUTIONS if report.available(COMPONENT_OF[v], layer=index)]
        if all(report.available(v, layer=index) for v in present):
            plans[index] = in_execution_order(model, index, ["layer_input", *present, "layer_output"])
    if not plans:
        return None
    saved: dict[int, list] = {index: [] for index in plans}
    with torch.no_grad(), model.trace(prompt):
        for index, names in plans.items():
            for name in names:
                saved[index].append(read(model, index, name).save())
    errors = []
    for values in saved.values():
        entering, *contributions, leaving = values
        errors.append(float((entering + sum(contributions) - leaving).abs().max()))
    return max(errors)


def _families(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from .model import StandardizedTransformer
    from .proof.prompts import PROMPTS, tiny_tokenizer
    from .proof.variants import tiny_hf_model
    from .registry import variants

    selected = [v for v in variants() if not args.k or args.k in v.name or args.k in v.model_type]
    if not selected:
        print(f"no registered family matches {args.k!r}", file=sys.stderr)
        return EXIT_USAGE
    rows, failed, skipped = [], 0, 0
    for spec in tqdm(selected, desc="families", unit="variant", file=sys.stderr, disable=args.quiet):
        if spec.unavailable:  # a model type an older transformers minor does not have: not a failure
            rows.append((spec.name, spec.model_type, "-", "-", "-", "-", f"skipped: {spec.unavailable}"))
            skipped += 1
            continue
        try:
            hf = tiny_hf_model(spec)
            model = StandardizedTransformer(hf, tokenizer=tiny_tokenizer(hf.config.get_text_config().vocab_size),
                                            verify="never")
            report = model.support()
            error = identity_error(model, PROMPTS[0])
            declined = report.declined()
            ok = error is None or error <= 1e-5
            status = "ok" if ok else "IDENTITY FAILS"
            rows.append((spec.name, spec.model_type, model.family.name, model.num_layers,
                         "declined" if error is None else f"{error:.1e}", ", ".join(declined) or "-", status))
        except Exception as exception:
            ok = False
            error_text = f"ERROR {type(exception).__name__}: {exception}"
            rows.append((spec.name, spec.model_type, "?", "?", "-", "-", error_text))
        failed += not ok
    header = ("variant", "model_type", "family", "layers", "identity err", "declined values", "status")
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header) - 1)]
    for row in [header, *rows]:
        print("  ".join(f"{c!s:<{w}}" for c, w in zip(row, widths, strict=False)) + "  " + str(row[-1]))
    print(f"\n{len(rows) - failed - skipped} of {len(rows)} variants pass ({len({r[1] for r in rows})} model types)"
          + (f", {skipped} skipped (not buildable here: see status)." if skipped else "."))
    return EXIT_FAILED if failed else EXIT_OK


def _usage(message: str) -> int:
    """Print a usage error as one line on stderr; the exit code of bad usage."""
    print("nncanon: " + " ".join(str(message).split()), file=sys.stderr)
    return EXIT_USAGE


def _support(args: argparse.Namespace) -> int:
    try:
        model = _load(args.model, args.attn)
    except CANNOT_LOAD as error:
        _cannot_load(args.model, error)
        return EXIT_USAGE
    report = model.support()
    print(json.dumps(report.to_dict(), indent=2) if args.json else report)
    return EXIT_OK


#: What loading a model the user named raises when it cannot be loaded (bad id, no network, no family).
CANNOT_LOAD = (OSError, ValueError)


def _cannot_load(model: str, error: Exception) -> None:
    """One line on stderr: nncanon's own errors already name the model and the way out."""
    from .errors import NncanonError

    message = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    print(message if isinstance(error, NncanonError) else f"cannot load {model!r}: {message}", file=sys.stderr)


def _load(model: str, attn: str | None = "eager") -> Any:
    """A demo model by name (``gpt2``, ``llama``, ``hybrid``), else a hub id or local folder."""
    from . import StandardizedTransformer
    from .demo import DEMO_MODELS, demo_model

    options = {"attn_implementation": attn} if attn else {}
    if model in DEMO_MODELS:
        return demo_model(model, **options)
    return StandardizedTransformer(model, **options)


def _run_order(run: str) -> tuple[int, int]:
    """The ablation page's row order: clean, the mixer, the MLP, the heads by number, the skip."""
    order = {"clean": 0, "attention": 1, "linear mixer": 2, "mlp": 3}
    if run.startswith("head "):
        return 4, int(run.split()[1])
    return order.get(run, 5), 0


def _ablate(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    out = Path(args.out)  # (the usage errors first: before torch, transformers and nnsight are imported)
    problem = unwritable(out)
    if problem is not None:
        return _usage(f"--out {args.out!r}: {problem}; give a folder you can write to")
    if not args.prompt:
        return _usage("--prompt is empty: give the text whose next token is scored")
    from .demo import DEMO_MODELS
    from .study import (
        ablation_study,
        head_effects,
        linear_head_layers,
        mixer_of,
        plot_head_effects,
        strongest_layer,
        target_notes,
    )

    names = args.model or list(DEMO_MODELS)
    models = {}
    for name in names:  # every model and its target token checked before any study runs
        try:
            models[name] = model = _load(name)
            model.dispatch()  # the weights, now: a folder with a config alone is refused before any study runs
        except CANNOT_LOAD as error:
            _cannot_load(name, error)
            return EXIT_USAGE
        if not model.tokenizer(args.target, add_special_tokens=False).input_ids:
            return _usage(f"--target {args.target!r} encodes to no token for {name}; give the token to score, "
                          "e.g. --target ' Paris'")
        for note in target_notes(model, args.target):  # a multi-token target: which token is scored
            print(f"note ({name}): {note}", file=sys.stderr)
        if args.layer is not None and not -model.num_layers <= args.layer < model.num_layers:
            return _usage(f"--layer {args.layer} is out of range for {name} ({model.num_layers} layers)")
    studies: dict[str, dict[str, float]] = {}
    effects, linear = {}, {}
    for name, model in tqdm(models.items(), desc="ablate", unit="model", file=sys.stderr, disable=args.quiet):
        effects[name] = head_effects(model, args.prompt, args.target, fast=args.fast)
        linear[name] = linear_head_layers(model)
        layer = args.layer % model.num_layers if args.layer is not None else strongest_layer(effects[name])
        label = f"{name} (layer {layer}, {'attention' if mixer_of(model, layer)[0] == 'self_attn' else 'linear'})"
        studies[label] = ablation_study(model, args.prompt, args.target, layer)
    runs = sorted(dict.fromkeys(run for study in studies.values() for run in study), key=_run_order)
    width = max(len(run) for run in runs)
    print(f"prompt {args.prompt!r}, target {args.target!r}: P(target) at the last position\n")
    print(f"{'run':<{width}}  " + "  ".join(f"{label:>{len(label)}}" for label in studies))
    for run in runs:
        cells = []
        for label, study in studies.items():
            cells.append(f"{study[run]:>{len(label)}.3f}" if run in study else f"{'-':>{len(label)}}")
        print(f"{run:<{width}}  " + "  ".join(cells))
    out.mkdir(parents=True, exist_ok=True)
    from .views.studies import study_page

    page = study_page(effects, args.target, args.prompt, estimated="log_odds" if args.fast else None,
                      linear_layers=linear, shared_scale=args.shared_scale, studies=studies).write(out / "ablate.html")
    print(f"\nthe heatmaps and the table as a page: {page} (nncanon view {out})")
    try:
        path = plot_head_effects(effects, args.target, str(out / "head_effects.png"), prompt=args.prompt,
                                 shared_scale=args.shared_scale, linear_layers=linear,
                                 estimated="log_odds" if args.fast else None)
    except ImportError:
        print("\n(no heatmap: install matplotlib, pip install 'nncanon[plot]')", file=sys.stderr)
        return EXIT_OK
    kind = ("estimated (attribution patching) effect on the log-odds of P(target)" if args.fast
            else "exact effect on P(target)")
    print(f"\nheatmap of every layer x head {kind}: {path}")
    return EXIT_OK


def _view(args: argparse.Namespace) -> int:
    from .views.cli import run_view

    return run_view(args, _tokenizer)


def _tokenizer(name: str, recorded: bool = False) -> Any:
    """A tokenizer by name, as ``nncanon graph`` loads models: a demo model's (``gpt2``, ``llama``, ``hybrid``), a
    local folder's or a hub id's (``recorded``: a name a graph holds, so local files only, no download);
    `TokenizerNotFound` naming it where there is none."""
    from transformers import AutoTokenizer

    from .demo import DEMO_MODELS, demo_path
    from .errors import TokenizerNotFound

    source = str(demo_path(name)) if name in DEMO_MODELS else name
    try:
        return AutoTokenizer.from_pretrained(source, local_files_only=recorded)
    except (OSError, ValueError) as error:
        message = " ".join(str(error).split())[:200] or type(error).__name__
        raise TokenizerNotFound(f"no tokenizer {name!r} here (a demo model's name, a hub id or a folder holding "
                                f"tokenizer files): {message}") from None


def _attention(value: str) -> str:
    """``--attn``: an attention implementation transformers knows (or a kernel repo id), else a usage error."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    known = ["eager", *ALL_ATTENTION_FUNCTIONS.valid_keys()]
    if value in known or "/" in value:
        return value
    raise argparse.ArgumentTypeError(f"{value!r} is not an attention implementation; one of {', '.join(known)}")


class _Parser(argparse.ArgumentParser):
    """An argument parser whose usage errors are one line on stderr, exit code 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: {message} (see {self.prog} --help)\n")


def _graph(args: argparse.Namespace) -> int:
    from .graphs.cli import run
    from .views.graph import graph_page

    return run(args, lambda model: _load(model, args.attn), graph_page)


def _matrix(args: argparse.Namespace) -> int:
    from .matrix import run_matrix

    return run_matrix(args.k, quiet=args.quiet, workers=args.workers, out=args.out)


class _HelpFormatter(argparse.HelpFormatter):
    """Every option's help ends with its default, written as Python would (``' Paris'``, leading space kept)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or action.default in (None, argparse.SUPPRESS) or isinstance(action, argparse._HelpAction):
            return text
        if isinstance(action, argparse._StoreTrueAction):
            return f"{text} (default: off)"
        return f"{text} (default: {action.default!r})"


def _infer(args: argparse.Namespace) -> int:
    from .errors import UnknownFamilyError

    if args.leave_one_out:
        from .families import registered_model_types
        from .leave_one_out import leave_one_out, markdown

        types = [t for t in registered_model_types() if not args.k or args.k in t]
        rows = leave_one_out(types, progress=not args.quiet)
        print(markdown(rows))
        return EXIT_FAILED if any(row.different for row in rows) else EXIT_OK
    if not args.model:
        print("nncanon infer needs MODEL_OR_FOLDER (a hub id or a local folder), or --leave-one-out", file=sys.stderr)
        return EXIT_USAGE
    from transformers import AutoConfig

    from .inference import infer_family
    from .inference.loading import model_class_of
    from .proof.load import prove

    options = {"trust_remote_code": True} if args.trust_remote_code else {}
    try:
        config = AutoConfig.from_pretrained(args.model, **options)
        model_class = model_class_of(args.model, config, options)
        inferred = infer_family(config, model_class)
    except (UnknownFamilyError, OSError, ValueError) as error:
        print(f"cannot infer a family for {args.model!r}: {error}", file=sys.stderr)
        return EXIT_USAGE
    proof = prove(config, inferred.family, model_class, "always")
    print(f"# inferred in {inferred.seconds:.2f} s, proved in {proof.seconds:.2f} s on a twin of this config")
    print("# the proof (one line per check; a value whose check failed is declined at load):")
    print("\n".join(f"#   {line}" for line in proof.verdict.table().splitlines()))
    for what, reason in inferred.tried.items():
        print(f"# not inferred, {what}: {reason}")
    print("\n# nncanon/families/<family>.py (FAMILIES = [...] there):")
    print(inferred.source())
    model_type = inferred.family.model_types[0]
    print(f"\n# model_registry/{model_type}.json:")
    print(json.dumps(inferred.registry_record(), indent=2))
    return EXIT_OK


def build_parser() -> argparse.ArgumentParser:
    formatter = _HelpFormatter
    parser = _Parser(
        prog="nncanon", formatter_class=formatter,
        description="The nncanon command line (also: python -m nncanon). Exit codes: 0 success, 1 a check "
                    "failed, 2 bad usage or a model that cannot be loaded.",
    )
    commands = parser.add_subparsers(dest="command", required=True)

    def command(name: str, help: str) -> argparse.ArgumentParser:
        return commands.add_parser(name, help=help, description=help, formatter_class=formatter)

    ablate = command(
        "ablate", "the ablation study as a table, and a layer x head heatmap (default: the three demo models)"
    )
    ablate.add_argument(
        "--model", action="append",
        help="hub id, local folder or demo model (gpt2, llama, hybrid); repeatable (default: the three demo models)",
    )
    ablate.add_argument("--prompt", default="The Eiffel Tower is in the city of", help="the prompt to run")
    ablate.add_argument(
        "--target", default=" Paris",
        help="the token whose probability is measured (its first token; mind the leading space)",
    )
    ablate.add_argument(
        "--layer", type=int, default=None, help="the block to ablate (default: the one holding the strongest head)"
    )
    ablate.add_argument("--out", default="nncanon-ablate", help="folder for the heatmap PNG")
    ablate.add_argument(
        "--shared-scale", action="store_true", help="one colour scale for every model's heatmap (default: one each)"
    )
    ablate.add_argument(
        "--fast", action="store_true",
        help="heatmap from attribution patching (a first-order estimate of the drop in the target's log-odds, one "
             "backward, marked 'estimated') instead of the exact sweep",
    )
    ablate.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    ablate.set_defaults(run=_ablate)

    matrix = command("matrix", "run the invariant suite on every registered family and write model_registry/status.*")
    matrix.add_argument(
        "-k", default="", help="only variants whose name contains this, a pytest -k expression (default: all)"
    )
    matrix.add_argument("-n", "--workers", default="0", help="pytest-xdist workers (default 0: in process)")
    matrix.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    matrix.add_argument("--out", default=None, help="write status.json/status.md here (default: model_registry/)")
    matrix.set_defaults(run=_matrix)

    families = command(
        "families", "build every registered family's tiny model, run support() and the contribution identity"
    )
    families.add_argument("-k", default="", help="only variants whose name or model_type contains this (default: all)")
    families.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    families.set_defaults(run=_families)

    infer = command("infer", "infer and prove the family record of an unregistered model; print it as Python and JSON")
    infer.add_argument("model", nargs="?", help="hub id or local folder")
    infer.add_argument("--trust-remote-code", action="store_true",
                       help="run the folder's own modeling code (custom-code models); never set otherwise")
    infer.add_argument("--leave-one-out", action="store_true",
                       help="infer every registered model type with its record unused and compare value by value")
    infer.add_argument("-k", default="", help="with --leave-one-out: only model types containing this")
    infer.add_argument("-q", "--quiet", action="store_true", help="no progress lines")
    infer.set_defaults(run=_infer)

    graph = command("graph", "an attribution graph of a prompt (circuit tracing over transcoders), written as "
                             "circuit-tracer's frontend reads it")
    graph.add_argument("prompt", help="the prompt (mind that it is one argument: quote it)")
    graph.add_argument("--model", default="gpt2", help="hub id, local folder or demo model (gpt2, llama, hybrid)")
    graph.add_argument("--out", default="nncanon-graph", help="folder for <slug>.json, graph-metadata.json, <slug>.pt")
    graph.add_argument("--transcoders", default=None,
                       help="a circuit-tracer transcoder config (.yaml, or a folder holding config.yaml) or a demo "
                            "set's name (default: the demo model's own set)")
    graph.add_argument("--slug", default=None, help="the graph's name (default: the prompt's first words)")
    graph.add_argument("--max-feature-nodes", type=int, default=None,
                       help="feature nodes at most, by influence on the logits (default: every active feature)")
    graph.add_argument("--max-n-logits", type=int, default=10, help="logit targets at most")
    graph.add_argument("--desired-logit-prob", type=float, default=0.95, help="logit targets until this probability")
    graph.add_argument("--node-threshold", type=float, default=0.8, help="pruning: cumulative node influence kept")
    graph.add_argument("--edge-threshold", type=float, default=0.98, help="pruning: cumulative edge influence kept")
    graph.add_argument("--batch-size", type=int, default=64, help="targets per backward pass")
    graph.add_argument("--offload", choices=["cpu", "disk"], default=None,
                       help="where finished rows live: host memory (cpu) or memory-mapped files (disk) (default: host)")
    graph.add_argument("--offload-dir", default=None,
                       help="with --offload disk: the folder of the rows' files (default: TMPDIR, else /tmp)")
    graph.add_argument("--attn", choices=["eager", "sdpa"], default="eager",
                       help="attention to load with: eager (the probabilities frozen, circuit-tracer's convention) or "
                            "sdpa (the kernel's query and key frozen: memory linear in the prompt's length)")
    graph.add_argument("-q", "--quiet", action="store_true", help="no progress bars")
    graph.set_defaults(run=_graph)

    support = command("support", "the support() table of a hub id, a local folder or a demo model")
    support.add_argument("model", help="hub id, local folder or demo model name (gpt2, llama, hybrid)")
    support.add_argument("--json", action="store_true", help="print the report as JSON")
    support.add_argument(
        "--attn", default=None, type=_attention,
        help="attn_implementation to load with, eager or sdpa (default: eager for a demo model, else the checkpoint's)",
    )
    support.set_defaults(run=_support)

    view = command("view", "serve a view's page (.html), a saved graph (.pt) or a folder of pages on 127.0.0.1")
    view.add_argument("path", help="an .html page of nncanon.views, a graph saved with Graph.to_pt (.pt), a graph "
                                   "JSON (.json, nncanon graph / circuit-tracer), or a folder")
    view.add_argument("--tokenizer", default=None,
                      help="decode a .pt graph's tokens: a demo model's name, a hub id or a folder (default: the "
                           "tokenizer the graph names, else token ids)")
    view.add_argument("--port", type=int, default=8765, help="the port (0: any free port; the address is printed)")
    view.add_argument("-q", "--quiet", action="store_true", help="no request log")
    view.set_defaults(run=_view)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``nncanon``; returns the exit code."""
    from .quiet import kernel_notices_filtered, progress_bars_hidden

    args = build_parser().parse_args(argv)
    # the CLI's forwards are nncanon's, not the user's; --quiet hides transformers' bars too
    with kernel_notices_filtered(), progress_bars_hidden(getattr(args, "quiet", False)):
        return args.run(args)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
