"""A dictionary attached to a model: its features a standard value of every trace, spliced into the model.

``attached = attach(model, dictionary)`` puts the dictionary at the point its ``hook_name`` names (or the one
given). In a trace, ``attached.features`` is ``[b, s, d_sae]``, read, saved and written like any value (this
invoke's rows, checked writes, ``.grad``), ``attached.reconstruction`` and ``attached.error`` are readable, and the
features are spliced into the model with the error term:

    value  ->  value + (decode(features as edited) - decode(features))

computed as the decoder's linear part of the edit alone (`Dictionary.delta`). Unedited, nothing is handed to the
model but what a plain read hands back: the run is the clean run, bit for bit. With ``error_term=False`` the value
is replaced by the reconstruction in every trace, whether or not it reads the features (an nnsight edit of the
model, which runs first at each visit of the point and travels with a remote request).

How it is served: reading the features reads the point as nncanon reads its values (`nncanon.sae.sites`), encodes
it, and leaves nnsight a write-back (``Mediator.transform``, as a served value does) that maps the features, when
the worker moves on, back into the model's value. Under gradients the features are the dictionary's own leaf of the
graph: the model's value is ``x + (f - f_clean)·W_dec``, which is ``x`` bit for bit, so every other gradient is the
clean run's and ``features.grad`` is ``W_dec · ∂L/∂value``.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Any

import torch
from nnsight.intervention.eproperty import WriteBack
from nnsight.intervention.interleaver import Mediator, OutOfOrderError

from ..errors import DictionaryDetached, DictionaryMismatch, InvalidInput, InvalidWrite, NestedTrace, OutOfOrderRead
from ..gradients import in_backward, mark, refuse_gradient
from ..mounted import MountedModel
from ..served import check_write
from ..traced import outside_trace, refuse_outside_trace
from .dictionary import Dictionary, Normalization
from .fit import check_fit
from .names import Point, resolve
from .ordering import Reader, Step, arrange, block_ranks, execution_rank, learn_order, sites
from .processing import IDENTITY, Mapping, mapping
from .sites import (
    PointRead,
    first_location,
    hand_back_now,
    handed,
    keep_stream_before,
    late_edit,
    open_point,
    refuse_late_edits,
)

#: Where an invoke's mediator lists the dictionaries it read (for the out-of-order message).
READ_HERE = "_nncanon_sae_read"

#: Where an invoke's mediator keeps each dictionary's visits (attachment key -> visits, in the order read): a read
#: after the model passed the point is served from the visit made at it.
VISITS = "_nncanon_sae_visits"

#: Where an invoke's mediator keeps transcoders' inputs read before another read passed them: key -> (visit, input).
INPUTS = "_nncanon_sae_inputs"

#: Where attached dictionaries are listed on a model (``model.__dict__``): name -> `AttachedDictionary`. The
#: surface reads it for ``support()`` only.
REGISTRY = "_nncanon_attached"


class AttachedDictionary:
    """A dictionary attached to a model (`attach`). Inside a trace:

    - ``features`` ``[b, s, d_sae]``: the dictionary's features of the point's value; read, ``.save()``, write
      in place or by assignment (a write of the wrong shape, dtype or device is `InvalidWrite`), ``.grad`` inside a
      backward block. An edit reaches the model as ``decode(edited) - decode(features)`` added to the value.
    - ``reconstruction`` ``[b, s, ...]`` (the value's shape): ``decode(features)`` as they stand (edits included).
    - ``error`` ``[b, s, ...]``: the value minus the reconstruction of its clean features: what the splice keeps.

    A transcoder reads ``point`` and writes ``point_out``: its features are served at ``point_out``, after the
    model computed it (read values of the sites between the two before them).

    Attributes:
        name: The attachment's name (``support()`` lists it).
        dictionary: The `Dictionary`.
        point: Where it reads (a `Point`).
        point_out: Where it writes (``point`` for an SAE).
        error_term: Whether the value keeps its error term (default) or is replaced by the reconstruction.
    """

    def __init__(self, model: Any, dictionary: Dictionary, point: Point, point_out: Point, error_term: bool,
                 name: str) -> None:
        self.model = model
        self.dictionary = dictionary
        self.point = point
        self.point_out = point_out
        self.error_term = error_term
        self.name = name
        self.key = uuid.uuid4().hex
        self._edit: Any = None
        self._copies: dict[Any, Dictionary] = {}
        #: What the point reads and the output point writes under the dictionary's processing
        #: (`nncanon.sae.processing`): identity where it was trained on the unprocessed model.
        self.reading: Mapping = IDENTITY
        self.writing: Mapping = IDENTITY

    # -- values ---------------------------------------------------------------------------------------

    @property
    def features(self) -> torch.Tensor:
        """The features ``[b, s, d_sae]`` of this invoke's rows at the point (inside a trace; outside one, a
        placeholder whose use raises `NotInTrace`, as every value's)."""
        self._refuse_detached("features")
        outside = outside_trace(self.model, f"{self.label}.features")
        return outside if outside is not None else self._visit().features

    @features.setter
    def features(self, value: Any) -> None:
        self._refuse_detached("features")
        refuse_outside_trace(self.model, f"{self.label}.features was written")
        visit = self._visit()
        if visit.handed:
            raise InvalidWrite(late_edit(f"{self.label}.features", visit.read.location))
        current = visit.features
        check_write(value, current, f"{self.label}.features")
        current.copy_(value.expand_as(current))

    @property
    def reconstruction(self) -> torch.Tensor:
        """``decode(features)`` as they stand, in the value's shape (inside a trace; read-only)."""
        self._refuse_detached("reconstruction")
        outside = outside_trace(self.model, f"{self.label}.reconstruction")
        return outside if outside is not None else self._visit().reconstruction()

    @reconstruction.setter
    def reconstruction(self, value: Any) -> None:
        raise InvalidWrite(f"{self.label}.reconstruction is read-only (decode(features)); write the features instead")

    @property
    def error(self) -> torch.Tensor:
        """The value minus the reconstruction of its clean features, in the value's shape (inside a trace;
        read-only): the term the splice keeps."""
        self._refuse_detached("error")
        outside = outside_trace(self.model, f"{self.label}.error")
        return outside if outside is not None else self._visit().error()

    @error.setter
    def error(self, value: Any) -> None:
        raise InvalidWrite(f"{self.label}.error is read-only (value - decode(clean features)); write the features "
                           "or the value instead")

    @property
    def input(self) -> torch.Tensor:
        """What the dictionary reads (``x``, under its processing: the centred stream of a
        ``center_writing_weights`` dictionary), in the point's shape (inside a trace; read it to save it)."""
        self._refuse_detached("input")
        outside = outside_trace(self.model, f"{self.label}.input")
        return outside if outside is not None else self._visit().x_in

    @property
    def label(self) -> str:
        """``"sae 'res3' at layers[3].layer_output"``."""
        where = self.point.label + (f" -> {self.point_out.label}" if self.point_out != self.point else "")
        return f"dictionary {self.name!r} at {where}"

    def describe(self) -> str:
        """One line for ``support()``."""
        cfg = self.dictionary.cfg
        term = "with its error term" if self.error_term else "replacing the value by the reconstruction"
        return (f"{self.name}: {cfg.architecture}, {cfg.d_sae} features, at {self.point.label}"
                + (f" -> {self.point_out.label}" if self.point_out != self.point else "")
                + (f" ({self.point.name})" if self.point.name and self.point.name != self.point.label else "")
                + f", {term}, reads under {self.dictionary.processing.describe()}"
                + "".join(f"; {note}" for note in dict.fromkeys(self.reading.notes + self.writing.notes)))

    def __repr__(self) -> str:
        return f"AttachedDictionary({self.describe()})"

    # -- lifetime -------------------------------------------------------------------------------------

    def detach(self) -> None:
        """Take the dictionary off the model (its edit too, with ``error_term=False``); the model is as it was."""
        registry = self.model.__dict__.get(REGISTRY, {})
        if registry.get(self.name) is self:
            del registry[self.name]
        if self._edit is not None:
            edits = self.model._edits
            if self._edit in edits:
                edits.remove(self._edit)
            self._edit = None

    def __enter__(self) -> AttachedDictionary:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.detach()

    @property
    def attached(self) -> bool:
        """Whether the dictionary is still on the model."""
        return self.model.__dict__.get(REGISTRY, {}).get(self.name) is self

    # -- serving --------------------------------------------------------------------------------------

    def _on(self, device: torch.device) -> Dictionary:
        """The dictionary on ``device`` (a model placed on several devices reads each point where it is)."""
        found = self._copies.get(device)
        if found is None:
            found = self._copies[device] = self.dictionary.to(device)
        return found

    def _refuse_detached(self, what: str) -> None:
        """`DictionaryDetached` where the dictionary was taken off the model (its values would read a model it no
        longer splices)."""
        if not self.attached:
            raise DictionaryDetached(f"{self.label}.{what} was used after detach(): the dictionary no longer reads "
                                     "the model. Attach it again (attach(model, dictionary)) to read it")

    def _visit(self) -> _Visit:
        """This invoke's visit at the point: the pending one; a new read where the model is still at the point (the
        read continues from the pending write-back there); the one made at this step where the model passed it."""
        self._refuse_detached("features")
        mediator = Mediator.current(f"{self.label}.features")
        waiting = mediator.transform
        holder = getattr(getattr(waiting, "fn", None), "__self__", None)
        if isinstance(holder, _Visit) and holder.owner.key == self.key and \
                waiting.occurrence == mediator.wanted(waiting.location):
            return holder
        made = mediator.__dict__.get(VISITS, {}).get(self.key)
        last = made[-1] if made else None
        if last is not None and hasattr(holder, "take_over") and waiting.occurrence == last.read.occurrence:
            if waiting.location == last.read.location:  # the model is still there: read again, after the pending
                return self._start(whole=False, reuse=last)
            return last  # read before (another dictionary's read passed it): served; an edit now is refused
        return self._start(whole=False)

    def _start(self, whole: bool, reuse: _Visit | None = None) -> _Visit:
        """Read the point(s) and encode; leave the splice as the worker's pending write-back. ``reuse``: this
        step's earlier visit, whose input a transcoder reads again (the model is past it)."""
        label = f"{self.label}.features"
        steps = [] if whole or reuse is not None else self._earlier(label)  # (an error_term=False edit: its own)
        try:
            return self._open_visit(label, whole, reuse, steps)
        except OutOfOrderRead as error:
            later = self._later_in_block()
            if later is None:
                raise
            raise OutOfOrderRead(
                f"{label} was read after {later.label}'s features in the same invoke: this dictionary reads "
                f"{self.point.label}, whose value (and the contribution an edit of it goes through) the model computes "
                f"before {later.point_out.label}, which that read passed. Read {self.name!r}'s features first "
                "(feature_attribution orders several dictionaries itself), or in another invoke") from error

    def _points(self) -> tuple[Point, ...]:
        return (self.point,) if self.point_out == self.point else (self.point, self.point_out)

    def _earlier(self, label: str) -> list[tuple[int, Step]]:
        """The other dictionaries of this block whose points this read would pass, to read first in the model's
        order (`nncanon.sae.ordering.arrange`), so that a read of their features later in this invoke is served."""
        layer = self.point.layer
        registry = self.model.__dict__.get(REGISTRY, {})
        if len(registry) < 2 or self.point_out.layer != layer or in_backward():
            return []
        rank = block_ranks(self.model, layer)
        mediator = Mediator.current(label)
        made = mediator.__dict__.get(VISITS, {})
        own = Reader(self, self._points(), tuple(sites(self.model, point) for point in self._points()))
        step = mediator.wanted(first_location(self.model, layer, own.sites[0][0]))
        others = [Reader(other, other._points(), tuple(sites(self.model, point) for point in other._points()))
                  for other in registry.values()
                  if other is not self and other.point.layer == layer and other.point_out.layer == layer
                  and not any(visit.read.occurrence == step for visit in made.get(other.key, ()))]
        if not others:
            return []

        def passed(value: str) -> bool:
            return mediator.occurrence(first_location(self.model, layer, value)) > step

        return arrange(own, others, rank, passed)

    def _read_earlier(self, steps: Sequence[tuple[int, Step]], phase: int, label: str) -> None:
        """Make the reads of ``steps`` due before this read's ``phase``-th point (`_earlier`)."""
        for at, each in steps:
            if at != phase:
                continue
            other = each.reader.owner if each.reader is not None else None
            if each.keep is not None:
                keep_stream_before(self.model, each.keep, label)
            elif each.input_only:
                read_in = open_point(self.model, other.point, f"{other.label}.features")
                hand_back_now(read_in)
                read_in.mediator.__dict__.setdefault(INPUTS, {})[other.key] = (read_in.occurrence, read_in.x)
            else:
                other._open_visit(f"{other.label}.features", whole=False)

    def _later_in_block(self) -> AttachedDictionary | None:
        """Another dictionary of this block read in this invoke whose points the model reaches after this one's."""
        own = execution_rank(self.point)
        mediator = Mediator.current(f"{self.label}.features")
        for other in mediator.__dict__.get(READ_HERE, ()):
            if other is not self and other.point.layer == self.point.layer and execution_rank(other.point_out) > own:
                return other
        return None

    def _open_visit(self, label: str, whole: bool, reuse: _Visit | None = None,
                    steps: Sequence[tuple[int, Step]] = ()) -> _Visit:
        self._read_earlier(steps, 0, label)
        if self.point_out != self.point:
            early = Mediator.current(label).__dict__.get(INPUTS, {}).pop(self.key, None)
            if reuse is not None:
                x_in = reuse.x_raw
            elif early is not None and early[0] == Mediator.current(label).wanted(
                    first_location(self.model, self.point_out.layer, sites(self.model, self.point_out)[0])):
                x_in = early[1]  # read before another read passed it (`_earlier`)
            else:
                read_in = open_point(self.model, self.point, label)
                x_in = read_in.x
                hand_back_now(read_in)
                self._read_earlier(steps, 1, label)
            read = open_point(self.model, self.point_out, label)
        else:
            read = open_point(self.model, self.point, label)
            x_in = read.x
        records = _records(read.mediator)
        count = read.mediator.interleaver.counts.get(read.location, 0) if read.mediator.interleaver else 0
        record = None if whole or self.error_term else records.get((self.key, read.location, count))
        if not self.error_term and not whole and record is None:
            raise InvalidInput(f"{self.label} replaces the value by the reconstruction, but its edit did not run in "
                               "this trace (was the dictionary detached, or the model copied?); attach it again")
        visit = _Visit(self, read, x_in, record)
        read.mediator.__dict__.setdefault(READ_HERE, []).append(self)
        if not whole:
            read.mediator.__dict__.setdefault(VISITS, {}).setdefault(self.key, []).append(visit)
        if whole:
            records[(self.key, read.location, count)] = visit
        read.mediator.transform = WriteBack(visit.flush, visit.features, self, read.location, read.occurrence)
        return visit


class _Visit:
    """The dictionary at one visit of its point in one invoke: the features served, and the splice."""

    def __init__(self, owner: AttachedDictionary, read: PointRead, x_in: torch.Tensor,
                 record: _Visit | None) -> None:
        self.owner, self.read = owner, read
        self.x_raw = x_in  # what the point read, before the dictionary's processing
        self.handed = False  # whether the splice went to the model (an edit now would not reach it)
        dictionary = owner._on(x_in.device)
        self.dictionary = dictionary
        # Under gradients the features are in the graph even where nothing before the point is (a trace that asks
        # the features' gradient alone): the model is then handed its value through the splice.
        graph = read.graph or (torch.is_grad_enabled() and not torch.is_inference_mode_enabled())
        read.graph = graph
        self.graph = graph
        if record is not None:  # error_term=False: the edit encoded the whole batch at this visit
            rows = _rows(read.mediator)
            self.x_in = _narrow(record.x_in, rows)
            self.x_out = _narrow(record.x_out, rows)
            self.state = Normalization(_narrow(record.state.scale, rows), _narrow(record.state.shift, rows))
            clean = _narrow(record.features.detach(), rows)
            self.clean = clean
            self.features = refuse_gradient(clean.clone(), NO_GRADIENT)
            self.replaced = True  # the model's value is the reconstruction already
        else:
            self.x_out = owner.writing.read(read.x)
            x_in = owner.reading.read(x_in)
            self.replaced = False
            if graph and owner.error_term:
                self.x_in = x_in.detach()
                with torch.no_grad():
                    clean, self.state = dictionary.encode_with_state(self.x_in)
                self.clean = clean
                self.features = clean + torch.zeros((), dtype=clean.dtype, device=clean.device, requires_grad=True)
            else:
                self.x_in = x_in if graph else x_in.detach()
                self.features, self.state = dictionary.encode_with_state(self.x_in)
                # The clean features, kept to tell an edit from them at the write-back (a copy: cheaper than encoding
                # again, and nothing can change it).
                self.clean = self.features.detach().clone() if owner.error_term else None
                if graph and not self.features.requires_grad:  # nothing before the point tracks gradients
                    self.features = self.features + torch.zeros((), dtype=self.features.dtype,
                                                                device=self.features.device, requires_grad=True)
        self.version = self.features._version
        mark(self.features, f"{owner.label}.features")

    def _clean(self) -> torch.Tensor:
        """The features as the dictionary encoded them (kept at the read; encoded again where not kept)."""
        if self.clean is None:
            with torch.no_grad():
                self.clean = self.dictionary.encode(self.x_in)
        return self.clean

    def _shaped(self, out: torch.Tensor) -> torch.Tensor:
        return out.reshape(self.read.x.shape).to(self.read.x.dtype)

    def reconstruction(self) -> torch.Tensor:
        """In the model's space: the dictionary's processing undone (value == reconstruction + error)."""
        return self.owner.writing.back(self._shaped(self.dictionary.decode(self.features, self.state, self.x_in)),
                                       self.read.x)

    def error(self) -> torch.Tensor:
        return self.x_out - self._shaped(self.dictionary.decode(self._clean(), self.state, self.x_in))

    def take_over(self) -> PointRead:
        """The splice applied now, for a later read of the same site at this visit to continue from."""
        self.flush()
        return self.read

    def flush(self) -> Any:
        """The raw value the model is handed when the worker moves on (nnsight's write-back); an edit of features
        handed before raises (`refuse_late_edits`), and these are watched from now on."""
        refuse_late_edits(self.read.mediator)
        handed_back = self._hand_back()
        self.handed = True
        handed(self.read.mediator, self.features, f"{self.owner.label}.features", self.read.location)
        return handed_back

    def _hand_back(self) -> Any:
        read, features = self.read, self.features
        edited = features._version != self.version
        if not self.owner.error_term and not self.replaced:  # the edit: the value becomes the reconstruction
            decoded = self._shaped(self.dictionary.decode(features, self.state, self.x_in))
            return read.apply(self.owner.writing.back(decoded, read.x))
        if not edited and not (self.graph and features.requires_grad):
            return read.keep()
        clean = self._clean() if edited else features.detach()
        return read.shift(self._shaped(self.dictionary.delta(features - clean, self.state)))


#: Why an ``error_term=False`` dictionary's features have no gradient.
NO_GRADIENT = ("with error_term=False the model runs on the reconstruction its edit computed before the trace's code "
               "ran, so the features read here are not in the graph the loss comes from. Attach it with "
               "error_term=True (the default) for gradients and feature_attribution")


def _records(mediator: Any) -> dict:
    """The whole-batch visits of this run's edits (``error_term=False``), by attachment, location and visit."""
    interleaver = mediator.interleaver
    batcher = getattr(interleaver, "batcher", None) if interleaver is not None else None
    holder = batcher if batcher is not None else interleaver
    return holder.__dict__.setdefault("_nncanon_sae_visits", {}) if holder is not None else {}


def _rows(mediator: Any) -> tuple[int, int] | None:
    batcher = getattr(mediator.interleaver, "batcher", None)
    if batcher is None or not batcher.batching or mediator.batch_group is None:
        return None
    start, size = mediator.batch_group
    return start, size


def _narrow(tensor: torch.Tensor | None, rows: tuple[int, int] | None) -> torch.Tensor | None:
    if tensor is None or rows is None:
        return tensor
    return tensor.narrow(0, rows[0], rows[1])


def _replace_every_visit(attachment: AttachedDictionary) -> None:
    """The body of an ``error_term=False`` attachment's edit: at every visit of the point (each generation step),
    encode the whole batch and hand the model the reconstruction; ends when the run does."""
    mediator = Mediator.current(f"{attachment.label}.features")
    step = 0
    while True:
        mediator.iteration = step
        try:
            attachment._start(whole=True)
        except OutOfOrderError:  # the run is over (or never reached the point): the edit ends here
            return
        step += 1


def attached(model: Any) -> dict[str, AttachedDictionary]:
    """The dictionaries attached to ``model``, by name."""
    return dict(model.__dict__.get(REGISTRY, {}))


def attach(model: Any, dictionary: Dictionary, hook_name: str | Point | None = None, *, name: str | None = None,
           error_term: bool = True, hook_name_out: str | Point | None = None, head: int | None = None
           ) -> AttachedDictionary:
    """Attach ``dictionary`` to ``model``: its features become a value of every trace (see `AttachedDictionary`).

    Held until ``.detach()``; as a context manager (``with attach(model, d) as sae:``) detached on exit.

    Args:
        model: A `StandardizedTransformer`.
        dictionary: A `Dictionary` (`Dictionary.load`, `Dictionary.from_tensors`).
        hook_name: Where it reads: a TransformerLens hook name, an nncanon value or a module path (`resolve`);
            default: the dictionary's ``hook_name``.
        name: The attachment's name (default: the dictionary's name; a second one at the same name is numbered).
        error_term: Keep the error term (default): the value becomes ``value + decode(edited) - decode(features)``
            and an unedited run is the clean run bit for bit. ``False``: the value is replaced by the reconstruction
            in every trace while attached.
        hook_name_out: A transcoder's output point (default: the dictionary's ``hook_name_out``).
        head: Read one head of a per-head value (default: the dictionary's ``hook_head_index``).

    Raises:
        UnknownHookName, InvalidLayer, ValueNotAvailable: the hook name (`resolve`).
        NestedTrace: called inside a trace of the model.
        DictionaryMismatch: before any forward: the dictionary's input (output) width is not the point's, its dtype
            is not the model's, its head is outside the point's heads, the point is not one a dictionary reads, or
            the processing it was trained under cannot be reproduced at its point (`nncanon.sae.processing`).
    """
    if not isinstance(model, MountedModel):
        raise InvalidInput(f"attach takes a StandardizedTransformer, not a {type(model).__name__}")
    if not isinstance(dictionary, Dictionary):
        raise InvalidInput(f"attach takes an nncanon.sae.Dictionary (Dictionary.load(folder), Dictionary.from_tensors),"
                           f" not a {type(dictionary).__name__}")
    if model.interleaver.interleaving:
        raise NestedTrace("attach was called inside a trace of the model: it learns the point's width from a trace of "
                          "its own, and an error_term=False dictionary is an edit of every later trace. Attach before "
                          "the trace (`with attach(model, dictionary) as item:` around it scopes it to the block)")
    if head is not None and (isinstance(head, bool) or not isinstance(head, int)):
        raise DictionaryMismatch(f"head={head!r}: a head index is an int (0 for the first head), or None")
    cfg = dictionary.cfg
    where = hook_name if hook_name is not None else cfg.hook_name
    if where is None:
        raise DictionaryMismatch(f"{dictionary.name} names no hook: pass hook_name= (e.g. 'blocks.3.hook_resid_post' "
                                 "or 'layers.3.layer_output')")
    point = where if isinstance(where, Point) else resolve(model, where, cfg.hook_head_index if head is None else head)
    where_out = hook_name_out if hook_name_out is not None else cfg.hook_name_out
    if cfg.transcoder and where_out is None:
        raise DictionaryMismatch(f"{dictionary.name} is a transcoder ({cfg.architecture}) with no output point: pass "
                                 "hook_name_out= (e.g. 'blocks.3.hook_mlp_out')")
    point_out = point
    if where_out is not None:
        point_out = where_out if isinstance(where_out, Point) else resolve(model, where_out, cfg.hook_head_index_out)
    for each in (point, point_out):
        if each.layer is None:
            raise DictionaryMismatch(f"{dictionary.name} reads {each.label} ({each.name}): a dictionary attaches at a "
                                     "block's value; read a model-level value with nncanon.sae.value_at")
    check_fit(model, dictionary, point, point_out)
    reading = mapping(model, dictionary.processing, point)
    writing = reading if point_out == point else mapping(model, dictionary.processing, point_out)
    registry = model.__dict__.setdefault(REGISTRY, {})
    base = name or dictionary.name
    name, number = base, 1
    while name in registry:
        number += 1
        name = f"{base}#{number}"
    attachment = AttachedDictionary(model, dictionary, point, point_out, error_term, name)
    attachment.reading, attachment.writing = reading, writing
    if not error_term:
        before = list(model._edits)
        with model.edit(inplace=True):
            _replace_every_visit(attachment)
        added = [edit for edit in model._edits if all(edit is not old for old in before)]
        attachment._edit = added[0] if added else None
    registry[name] = attachment
    for layer in {point.layer, point_out.layer}:  # (the block's order, for reads of several dictionaries)
        learn_order(model, layer, [value for other in registry.values() for where in other._points()
                                   if where.layer == layer for value in sites(model, where)])
    return attachment
