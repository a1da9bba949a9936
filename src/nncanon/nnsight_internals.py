"""Every part of nnsight nncanon reaches that is not nnsight's documented API, with why, in one table.

nncanon serves its values through nnsight's public mechanisms (envoys, ``eproperty``, ``.source``, ``.skip``,
``.grad``), but a few things need nnsight's insides: the module under an envoy, the interleaver's mediators, the
hook that batches invokes, the backward ``.grad``. Each is listed here, and ``tests/test_nnsight_internals.py``
holds, for each, a test that fails if nnsight 0.8 stops behaving as nncanon relies on (so a new nnsight release
breaks a named test, not a user's values), and a test that the table is complete: no other private name of
nnsight (an attribute with a leading underscore that nnsight defines), no other override of an nnsight method,
and no other import from nnsight is used anywhere in the package.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Internal:
    """One use of nnsight's insides.

    Attributes:
        name: The attribute, method or imported name (``Envoy._module``, ``TransformersModel._batch``...).
        kind: ``"attribute"`` (a private attribute read or written), ``"override"`` (an nnsight method a
            subclass replaces), ``"patch"`` (an nnsight function replaced at import) or ``"import"`` (a name
            imported from a module of nnsight's internals).
        why: What nncanon needs it for, and why the public API does not do it.
        relies_on: The behaviour the test in ``tests/test_nnsight_internals.py`` pins.
    """

    name: str
    kind: str
    why: str
    relies_on: str


#: Private attributes of nnsight objects that nncanon reads or writes.
ATTRIBUTES: tuple[Internal, ...] = (
    Internal("_module", "attribute",
             "the torch module under an envoy: hooks, weights and plain references are taken on it (nnsight has "
             "no public accessor)",
             "an Envoy's _module is the module it wraps"),
    Internal("_aliases", "attribute",
             "a standard name (self_attn, mlp) made an alias of the family's native module name on a block, so "
             "native paths keep working beside it (rename= applies to the whole model, not one block)",
             "Envoy._aliases maps an alias bound on an envoy to the child's name, and its repr labels the child "
             "'alias/name'"),
    Internal("_child_map", "attribute",
             "the envoy of a child by its module's own name, where the family's own attribute of that name "
             "(a router, a mixer) hides the child",
             "Envoy._child_map maps a child's name to its envoy"),
    Internal("_location", "attribute",
             "the interleaver location of a model value (logits), to swap a checked write in",
             "eproperty._location(host) is '<path>.<key>'"),
    Internal("_preprocess", "attribute",
             "the logits' own view of the raw output, to check a written value against it; and a served "
             "value's callbacks, pickled with it for remote requests",
             "eproperty keeps the decorated stub as _preprocess (and _postprocess, _transform)"),
    Internal("_postprocess", "attribute",
             "an eproperty rebuilt from its parts when a remote request unpickles it",
             "eproperty keeps the decorated stub as _preprocess (and _postprocess, _transform)"),
    Internal("_transform", "attribute",
             "an eproperty rebuilt from its parts when a remote request unpickles it",
             "eproperty keeps the decorated stub as _preprocess (and _postprocess, _transform)"),
    Internal("_edits", "attribute",
             "a dictionary attached with error_term=False (nncanon.sae) is an in-place edit of the model "
             "(model.edit(inplace=True)), taken off again by detach: nnsight's clear_edits would clear the user's "
             "edits too, and an edit has no public handle",
             "model.edit(inplace=True) appends one Mediator to Envoy._edits, which every later trace runs first, "
             "over the whole batch, and removing it there stops it"),
)

#: nnsight methods `nncanon.mounted.MountedModel` replaces, and nnsight functions replaced at import.
OVERRIDES: tuple[Internal, ...] = (
    Internal("_batch_size", "override",
             "an invoke with no prompt (None, []) refused by name before nnsight counts its rows",
             "TransformersModel._batch_size(*inputs, **kwargs) is called with each invoke's inputs"),
    Internal("_batch", "override",
             "the batched input of all invokes checked (token ids in the vocabulary, no empty row, no prompt "
             "longer than the positions) before the forward: there is no public hook between batching and "
             "the forward",
             "TransformersModel._batch(invokes, fn) returns (args, kwargs) of the batched forward"),
    Internal("_remoteable_class", "override",
             "remote requests are keyed as the plain TransformersModel a server hosts (nncanon's code travels "
             "by value)",
             "Envoy._remoteable_class() names the class a remote request is keyed as"),
    Internal("generate", "override",
             "generate under the model's trace lock, and inside a trace of this thread only (another thread's "
             "running trace is not 'inside'): nnsight's traceable wrapper decides that on the interleaver alone; "
             "the override reuses the wrapped method and the tracer's capture",
             "TransformersModel.generate.__wrapped__ is the bare method; Tracer.capture() raises "
             "WithBlockNotFoundError outside a with block"),
    Internal("_grad_property", "patch",
             "a served value whose gradient never arrives raises GradientNotAvailable naming it (nnsight's "
             "OutOfOrderError names an internal location), and a refused or read-only gradient is refused: "
             "nncanon wraps nnsight's backward .grad property",
             "nnsight.intervention.backward._grad_property(interleaver, seen, hooks) returns the .grad property "
             "installed on tensors inside a backward block"),
)

#: Names imported from nnsight's internal modules (``nnsight.NNsight`` and ``nnsight.register`` are its API).
IMPORTS: tuple[Internal, ...] = (
    Internal("nnsight.modeling.transformers.TransformersModel", "import",
             "the loader nncanon subclasses (LanguageModel is deprecated in 0.8)", "its constructor loads a "
             "transformers causal LM"),
    Internal("nnsight.intervention.envoy.Envoy", "import",
             "the envoy classes of blocks and components subclass it", "Envoy subclasses mount with envoys="),
    Internal("nnsight.intervention.eproperty.eproperty", "import",
             "served values are eproperties", "eproperty.__get__ reads Mediator.value(location)"),
    Internal("nnsight.intervention.eproperty.WriteBack", "import",
             "the attention probabilities bind their write-back as an eproperty does",
             "WriteBack(fn, view, eproperty, location, occurrence)"),
    Internal("nnsight.intervention.interleaver.Mediator", "import",
             "the invoke a read belongs to (its rows, its noted reads and skips) and checked swaps",
             "Mediator.current(location), Mediator.value, Mediator.swap, mediator.wanted"),
    Internal("nnsight.intervention.interleaver.OutOfOrderError", "import",
             "a read after the model ran past it, renamed (OutOfOrderRead) and named",
             "raised on a read of a location already passed"),
    Internal("nnsight.intervention.tracer.InterleavingTracer", "import",
             "SerialTracer (one trace of a model at a time across threads) subclasses it",
             "trace(tracer_cls=...) takes a subclass"),
    Internal("nnsight.intervention.util.first_input", "import",
             "the stream a block receives, from its hook arguments", "first_input(args, kwargs)"),
    Internal("nnsight.intervention.util.replace_first_input", "import",
             "a block's input replaced in its hook arguments", "replace_first_input(args, kwargs, value)"),
    Internal("nnsight.intervention.backward", "import",
             "the module whose _grad_property nncanon wraps (see OVERRIDES)", "it defines _grad_property"),
    Internal("nnsight.modeling.quantization.resolve_load_kwargs", "import",
             "nnsight's dtype shorthand (dtype=\"nf4\", \"int8\") read as the quantization_config nnsight loads with, "
             "so the proof's twin is quantized the same way",
             "resolve_load_kwargs({'dtype': 'nf4'}) gives a 4-bit NF4 BitsAndBytesConfig and a float dtype"),
    Internal("nnsight.tracing.tracer.WithBlockNotFoundError", "import",
             "generate outside a with block runs at once (see OVERRIDES)", "raised by Tracer.capture()"),
)

#: Every entry, in one table.
INTERNALS: tuple[Internal, ...] = ATTRIBUTES + OVERRIDES + IMPORTS
