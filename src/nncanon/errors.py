"""The errors nncanon raises. Each names what the user did and what to do instead."""

from __future__ import annotations

from nnsight.intervention.interleaver import OutOfOrderError


class NncanonError(Exception):
    """Base class of every error nncanon raises on purpose."""


class UnknownFamilyError(NncanonError, ValueError):
    """The model's ``config.model_type`` has no registered family."""


class OutOfScopeModel(UnknownFamilyError):
    """The model's type is one nncanon does not serve by design (an encoder, an encoder-decoder's decoder,
    a decoder whose stream is not a residual sum); the message says which and why."""


class ValueNotAvailable(NncanonError, AttributeError):
    """A standard value that this layer of this model does not have.

    An ``AttributeError``, so ``hasattr(layer.self_attn, "attention_probabilities")``
    answers ``False``; the message is the same reason ``model.support()`` gives.
    """


class SizeNotAvailable(NncanonError, ValueError):
    """A model-level size this model does not have (``num_heads`` of a model without softmax attention)."""


class InvalidWrite(NncanonError, ValueError):
    """A value written to the surface does not fit where it goes (shape, dtype, device, type)."""


class InvalidSkip(NncanonError, ValueError):
    """A ``skip_layers`` call whose layers or replacement cannot work."""


class ModelUnavailable(NncanonError, OSError):
    """A model that cannot be loaded from here: a hub id while the hub is unreachable (or ``HF_HUB_OFFLINE``
    is set) and the checkpoint is not in the local cache, a local path that does not exist, or (at the first
    trace, which loads the weights) a local folder with a config but no weight files.

    An ``OSError``, as transformers raises for a checkpoint it cannot find. The message is one line
    naming the ways in: a local folder, ``HF_HUB_OFFLINE=1`` with a cached checkpoint, the demo models.
    """


class GradientNotAvailable(NncanonError, RuntimeError):
    """A ``.grad`` asked where no gradient can come: outside ``with loss.backward():``, on a value
    the backward never reaches, a standard value first read inside the backward block, or a value whose
    gradient check failed on the load-time proof (the value is served, its gradient is not)."""


class InvalidLayer(NncanonError, IndexError, TypeError):
    """A layer index that is not an int, or is outside the model's blocks (an ``IndexError`` and a ``TypeError``)."""


class OutOfOrderRead(NncanonError, OutOfOrderError):
    """A value read after the model had run past it: nnsight's ``OutOfOrderError``, naming the value and the order."""


class InvalidInput(NncanonError, ValueError):
    """An input a trace or ``generate`` cannot run.

    No prompt, an empty prompt, a prompt longer than the model's positions, token ids that are not integers or
    have no row in the model's embedding; a ``project_on_vocab`` input that is not a residual-stream tensor.
    """


class NestedTrace(NncanonError, RuntimeError):
    """A trace (or a tool that runs one: a sweep, the lens, patching) started inside an open trace of the same
    model: nnsight runs one trace of a model at a time. Save what the tool needs and call it after the ``with``."""


class InvalidModel(NncanonError, TypeError):
    """What was passed as the model is not a transformers causal LM (no ``.config``), or it asks for (or was
    loaded with) transformers' hub kernels, which replace modules' forwards the load-time proof does not run."""


class UntestedTransformersWarning(UserWarning):
    """The installed transformers minor is outside the range nncanon was tested on (`nncanon.versions`)."""


class BatchCoupledWarning(UserWarning):
    """The model computes the tokens of a batch together (bitsandbytes LLM.int8's outlier columns), so an edit at one
    token or in one invoke moves the others' values: warned once per model, at its first trace."""


class TokenizerNotFound(NncanonError, FileNotFoundError):
    """No tokenizer to load: a local folder given as the model has no tokenizer files, or a built model that
    names no checkpoint was passed, and no ``tokenizer=`` was given."""


class NotInTrace(NncanonError, ValueError):
    """A standard value used, or written, outside a trace (or in a trace that runs nothing: no input and no
    invoke), or a tool that works inside a trace called outside one. Values exist while a forward runs: use them
    inside ``with model.trace(prompt):``. A ``ValueError``, as nnsight's own "outside of interleaving" error."""


class ConfigChanged(NncanonError, RuntimeError):
    """The model's config changed after its load-time proof, in a way that changes what the proof keyed on: the
    served values were proved (and are read) for the config as loaded. The message names what changed."""


class InvalidArgument(NncanonError, ValueError):
    """An argument of nncanon's own that takes one of a few values was given another (``verify="bogus"``)."""


class InvalidCheckpoint(NncanonError, OSError):
    """A checkpoint file that cannot be read: a ``config.json`` that is not a valid config, or a weight file
    that is not what its name says (truncated, or not a safetensors file). The message names the file; the
    library's own error is its cause. An ``OSError``, as transformers raises for a file it cannot read."""


class InvalidDictionary(NncanonError, ValueError):
    """A dictionary (sparse autoencoder or transcoder) that cannot be loaded or built: a folder without its
    config or weights, a truncated weight file, weights whose shapes disagree with the config, an architecture or
    setting nncanon does not run (the message lists those it does)."""


class DictionaryMismatch(NncanonError, ValueError):
    """A dictionary attached where it does not fit: its input (or output) width is not the site's, its dtype is not
    the model's, its head index is outside the site's heads; named before any forward."""


class UnknownHookName(NncanonError, ValueError):
    """A hook name that names no point of the model: not a TransformerLens hook name, an nncanon value or a module
    path of this model (a name with a meaning that this family lacks is `ValueNotAvailable`, with the reason)."""


class QuantizationUnavailable(NncanonError, ImportError):
    """A quantization method (``quantization_config=``, or a checkpoint quantized with it) whose package is not
    installed, or that does not run on this machine: one line naming the method and the package, raised before
    any weight is loaded."""


class ModelChanged(NncanonError, RuntimeError):
    """The model was changed since its load-time proof (a linear layer swapped for a quantized one, a cast to
    another dtype): the proof no longer speaks for it. Load it again as it now is."""


class InvalidCollection(NncanonError, ValueError):
    """An activation collection folder that cannot be read or resumed as asked: a manifest or shard that is
    missing, cut, edited, reordered, not a regular file or unwritable; another collector holding the folder; or a
    resume whose model, point, dtype, corpus or batch settings differ from the ones the folder was collected
    with. The message names the file or the setting."""


class CannotWrite(NncanonError, OSError):
    """Files nncanon was asked to write cannot be written there: the output path is a symbolic link, a FIFO, a file
    or a read-only folder; a file's name is held by something a rename must not replace; the disk is full; another
    process is writing the same folder. The message names the path. Nothing half-written is left under a file's
    name: each file is the old one or the whole new one (written to a temporary file, then renamed)."""


class DictionaryDetached(NncanonError, RuntimeError):
    """A dictionary's values (``features``, ``reconstruction``, ``error``...) used after ``detach()``: the
    dictionary no longer reads the model. Attach it again to read it."""
