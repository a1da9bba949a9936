"""`StandardizedTransformer`: any registered decoder-only model, one surface."""

from __future__ import annotations

import copy
import os
import warnings
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from nnsight.modeling.transformers import TransformersModel

from .components.layer import layer_index
from .errors import (
    InvalidInput,
    InvalidLayer,
    InvalidModel,
    InvalidSkip,
    InvalidWrite,
    ModelUnavailable,
    NestedTrace,
    OutOfOrderRead,
    SizeNotAvailable,
    TokenizerNotFound,
    UntestedTransformersWarning,
    ValueNotAvailable,
)
from .families import Family
from .mounting import mount
from .quiet import kernel_notices_filtered, wrapping_quietly
from .served import _rows, check_write, model_value, served_as_stacked
from .versions import untested_transformers

_HUB_KERNELS = (
    "transformers' hub kernels (`use_kernels=True`, `kernel_config=`, `kernelize`) replace modules' forwards "
    "with kernels downloaded from the hub, which the load-time proof's twin does not run, so nncanon could not "
    "vouch for a value read inside them"
)


def _without_hub_kernels(model: Any, kwargs: dict) -> None:
    """Load with transformers' hub kernels off (``use_kernels=False``; transformers 5.25 turns them on by
    default in ``from_pretrained``); refuse them where the user asked for them or passed a kernelized model."""
    if kwargs.get("use_kernels") or kwargs.get("kernel_config") is not None:
        raise InvalidModel(f"{_HUB_KERNELS}. Leave out use_kernels= and kernel_config= (nncanon loads without them).")
    if isinstance(model, torch.nn.Module):
        if getattr(model, "use_kernels", False):
            raise InvalidModel(
                f"{type(model).__name__} was loaded with hub kernels: {_HUB_KERNELS}. Load it with "
                "from_pretrained(..., use_kernels=False), or pass its hub id or folder to StandardizedTransformer."
            )
    else:
        kwargs["use_kernels"] = False


def _config_of(model: Any, kwargs: dict) -> Any:
    """The config of what the user passed, read without loading weights."""
    if kwargs.get("config") is not None:
        return kwargs["config"]
    if isinstance(model, torch.nn.Module):
        config = getattr(model, "config", None)
        if config is None or not hasattr(config, "get_text_config"):
            raise InvalidModel(
                f"StandardizedTransformer was given a {type(model).__name__} with no transformers config "
                "(.config): it serves transformers causal LMs. Pass a hub id, a saved folder, or a "
                "PreTrainedModel (AutoModelForCausalLM...) with tokenizer=."
            )
        return config
    if not isinstance(model, (str, os.PathLike)):
        raise InvalidModel(
            f"StandardizedTransformer was given a {type(model).__name__}; pass a hub id, a local folder or "
            "a transformers PreTrainedModel."
        )
    model = os.fspath(model)
    from transformers import AutoConfig

    from .hub import alternatives, check_reachable

    options = {k: kwargs[k] for k in ("revision", "trust_remote_code", "token") if k in kwargs}
    check_reachable(model, options)
    try:
        return AutoConfig.from_pretrained(model, **options)
    except OSError as error:
        if _offline_miss(error):
            raise ModelUnavailable(alternatives(model)) from error
        raise


def _offline_miss(error: OSError) -> bool:
    """Whether transformers' error says the files are neither reachable nor cached (``HF_HUB_OFFLINE=1``...)."""
    text = str(error)
    return "couldn't connect" in text or "offline mode" in text or "local_files_only" in text


def _causal_lm_config(config: Any, text: Any = None) -> Any:
    """The config the causal-LM class is built from.

    A multimodal checkpoint whose causal-LM class is its text model (Qwen3.5, Qwen3.5-MoE, Llama-4)
    is built from its text config (``model_type`` ``qwen3_5_text``...); transformers maps the
    checkpoint's language-model weights onto it. Others are built from the config itself. ``text``:
    ``config.get_text_config()``, where the caller has it.
    """
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    text = config.get_text_config() if text is None else text
    if text is config or type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        return config
    built = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    return text if getattr(built, "config_class", None) is type(text) else config


def _tokenizer_of(model: str, kwargs: dict) -> Any:
    """The checkpoint's tokenizer (transformers 5.24's pipeline no longer infers it for nnsight's meta load)."""
    from transformers import AutoTokenizer

    folder = os.path.expanduser(os.fspath(model))
    if os.path.isdir(folder) and not any(os.path.exists(os.path.join(folder, name)) for name in _TOKENIZER_FILES):
        raise TokenizerNotFound(
            f"the folder {model!r} has no tokenizer files (none of {', '.join(_TOKENIZER_FILES)}): save the "
            "tokenizer beside the model (tokenizer.save_pretrained(folder)), or pass tokenizer=."
        )
    options = {k: kwargs[k] for k in ("revision", "trust_remote_code", "token") if k in kwargs}
    return AutoTokenizer.from_pretrained(model, **options)


#: Suffixes of the weight files transformers loads from a folder (safetensors, torch pickles, their shard indices).
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf", ".index.json")


def _refuse_folder_without_weights(model: Any, kwargs: dict) -> None:
    """Raise `ModelUnavailable` where ``model`` is a local folder with no weight file (a config alone).

    Such a folder loads on meta (``support()`` and the proof need no weights); running it needs them, and
    transformers' own error arrives wrapped in nnsight's, tracebacks and all, from the first trace.
    """
    if not isinstance(model, (str, os.PathLike)) or kwargs.get("gguf_file") or kwargs.get("subfolder"):
        return
    folder = os.path.expanduser(os.fspath(model))
    if not os.path.isdir(folder) or any(name.endswith(_WEIGHT_SUFFIXES) for name in os.listdir(folder)):
        return
    raise ModelUnavailable(
        f"the folder {os.fspath(model)!r} has a config but no weights (no model.safetensors, pytorch_model.bin or "
        "shard index): nncanon builds it on meta without them, which serves support() and the load-time proof, "
        "but running the model needs its weights. Save them beside the config (model.save_pretrained(folder)), "
        "or load the folder that holds them."
    )


#: Files of which a saved tokenizer has at least one.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt",
                    "spiece.model", "sentencepiece.bpe.model", "tekken.json")


def _note_transformers_error(error: Exception, config: Any) -> None:
    """Add one line to an error transformers raised building the model: it came from the config, not nncanon."""
    import traceback

    frames = traceback.extract_tb(error.__traceback__)
    if frames and f"{os.sep}transformers{os.sep}" in frames[-1].filename:
        error.add_note(
            f"(transformers raised this building a model of this {type(config).__name__} "
            f"(model_type {getattr(config, 'model_type', None)!r}) from its config, before nncanon ran on it: "
            "transformers itself cannot build this config; fix the config, or report it to transformers)"
        )


def apply_logit_steps(logits: torch.Tensor, family: Family, config: Any) -> torch.Tensor:
    """The family's logit post-processing, in the model's own order of operations."""
    for step in family.logit_steps:
        factor = step.factor(config)
        if factor is None or step.op in ("divide_input", "divide_stream"):
            continue
        if step.op == "truncate":
            logits = logits[..., :factor] if factor < logits.shape[-1] else logits
        elif step.op == "softcap":
            logits = logits / factor
            logits = torch.tanh(logits)
            logits = logits * factor
        elif step.op == "divide":
            logits = logits / factor
        elif step.op == "multiply":
            logits = logits * factor
        else:  # pragma: no cover - a family definition error
            raise ValueError(f"unknown logit step {step.op!r}")
    return logits


class StandardizedTransformer(TransformersModel):
    """A decoder-only transformers model with one surface for every family.

    Args:
        model: A hub id, a local folder, or a built ``PreTrainedModel`` (then pass ``tokenizer=``).
        verify: ``"auto"`` (default): prove every value on a twin of this config (a shrunk copy with
            random weights, on the CPU) unless the proof cache has that proof; ``"always"``: prove it
            again; ``"never"``: serve the values unproved (``support()`` says so). A value whose proof
            fails is declined, naming the failed check and its numbers. See "How nncanon knows a
            value is right" in the docs.
        family: The `Family` to serve the model with, instead of the registered one for its model type.
        **kwargs: Go to transformers and nnsight as they do for ``TransformersModel``:
            ``device="cpu"``, ``device_map``, ``dtype``, ``attn_implementation``, ``dispatch``...

    The tokenizer pads on the left, so ``[:, -1]`` is every prompt's last token in a batch.
    Loading runs no forward pass on the model (the proof runs on the twin).

    Example:
        >>> model = StandardizedTransformer("openai-community/gpt2", attn_implementation="eager")
        >>> with model.trace("The Eiffel Tower is in the city of"):
        ...     attention = model.layers[9].self_attn.attention_output.save()
        ...     probs = model.next_token_probs.save()
    """

    def __init__(
        self, model: Any, *args: Any, tokenizer: Any = None, verify: str = "auto", family: Family | None = None,
        **kwargs: Any,
    ) -> None:
        from .proof.load import VERIFY_MODES

        if verify not in VERIFY_MODES:
            raise ValueError(f"verify={verify!r} is not one of {', '.join(map(repr, VERIFY_MODES))}")
        given = _config_of(model, kwargs)
        given_text = given.get_text_config()
        config = _causal_lm_config(given, given_text)
        inferred = None
        if family is None:
            from .inference.loading import family_for_load

            family, inferred = family_for_load(config, model, kwargs)
        _without_hub_kernels(model, kwargs)
        untested = untested_transformers()
        if untested is not None:
            warnings.warn(untested, UntestedTransformersWarning, stacklevel=2)
        if not isinstance(model, torch.nn.Module):
            if kwargs.get("dispatch"):
                _refuse_folder_without_weights(model, kwargs)
            kwargs.setdefault("task", "text-generation")
            if tokenizer is None:
                tokenizer = _tokenizer_of(model, kwargs)
        with wrapping_quietly():
            try:
                super().__init__(model, *args, tokenizer=tokenizer, **kwargs)
            except Exception as error:
                _note_transformers_error(error, config)
                raise
        self._family = family
        self._inferred = inferred
        config = self._module.config  # the config read above where the user passed the model
        self._text_config = given_text if config is given else config.get_text_config()
        # Native paths first: a standard name bound below may shadow a native module of that name
        # (ModernBERT-decoder's native ``lm_head`` is the prediction head run before ``decoder``).
        self._before_head = [m for m in map(self._optional, family.before_head) if m is not None]
        self.layers = self.get(family.layers)
        self.embed_tokens = self.get(family.embed_tokens)
        self.norm = self._optional(family.norm)
        self.lm_head = self.get(family.lm_head)
        declines = family.model_declines
        self._model_declines: dict[str, str] = dict(declines(self._text_config) if callable(declines) else declines)
        unserved = mount(self, family, self._text_config)
        self._provenance = self._prove(verify, unserved)

    def _prove(self, verify: str, unserved: list | None = None) -> Any:
        """Prove this model's values on a twin of its config (see ``verify``); decline what fails.
        ``unserved``: what `mount` returned."""
        from .proof.load import load_provenance

        with kernel_notices_filtered():
            if self._inferred is None:
                return load_provenance(self, self._module.config, verify, unserved)
            from .inference.loading import inferred_provenance

            return inferred_provenance(self, verify, unserved)

    def _model_value_check(self, name: str, asked: str | None = None) -> None:
        """Raise `ValueNotAvailable` where the model-level value ``name`` is declined (``asked``: the value
        the user asked for, where it is computed from ``name``)."""
        reason = self.__dict__.get("_model_declines", {}).get(name)
        if reason is not None:
            raise ValueNotAvailable(f"model.{asked or name} is not available: {reason}")

    def __getattr__(self, name: str) -> Any:
        # A property of this class that raised an AttributeError (a declined value's ValueNotAvailable) lands
        # here, where nnsight's Envoy would answer a generic "has no attribute": raise the property's own error.
        # Its checks run before it reads the model, so asking it again reads nothing twice.
        if isinstance(getattr(type(self), name, None), property):
            return object.__getattribute__(self, name)
        return super().__getattr__(name)

    def _optional(self, path: str | None) -> Any:
        """The envoy at ``path``, or ``None`` where this configuration has no such module."""
        if path is None:
            return None
        parent, _, name = path.rpartition(".")
        owner = self.get(parent)._module if parent else self._module
        if getattr(owner, name, None) is None:
            return None
        return self.get(path)

    def dispatch(self) -> None:
        """Load the real weights (a model built on meta), then re-install the operation hooks on them."""
        was = self.dispatched
        if not was and self.args:
            _refuse_folder_without_weights(self.args[0], self.kwargs)
        super().dispatch()
        if not was:
            self._prepare_operations()

    def _prepare_operations(self) -> None:
        """Install nnsight's source hooks for every value read inside a forward (router logits, ...)."""
        for layer in self.layers:
            for host in (layer, *(layer.__dict__.get(name) for name in ("self_attn", "linear_attn", "mlp"))):
                state = getattr(host, "__dict__", {}).get("_nncanon")
                for binding in state.bindings.values() if state is not None else ():
                    if binding.prepare is not None:
                        binding.prepare()

    # -- one trace at a time -------------------------------------------------

    def trace(self, *inputs: Any, **kwargs: Any) -> Any:
        """nnsight's trace, run under this model's lock: threads sharing the model take turns (`nncanon.threads`)."""
        from .threads import SerialTracer, trace_lock

        if self.interleaver.interleaving and trace_lock(self)._is_owned():
            raise NestedTrace(
                "a trace of this model was started inside an open trace of it (directly, or by a tool that runs "
                "its own forward: a sweep, patching, the logit lens, a cache): nnsight runs one trace of a model "
                "at a time. Call it after the `with model.trace(...)` block, on what you saved there"
            )
        if not kwargs.get("remote") and kwargs.get("backend") is None:  # a remote request runs on the server
            kwargs.setdefault("tracer_cls", SerialTracer)
        return super().trace(*inputs, **kwargs)

    def generate(self, *inputs: Any, **kwargs: Any) -> Any:
        """nnsight's ``generate`` (a trace of the decoding loop with ``with``, else the token ids), under this
        model's lock. Called inside a trace of this thread it generates there; another thread's trace running
        meanwhile is not "inside" (nnsight's own check would take it for one and run the bare method)."""
        from nnsight.tracing.tracer import WithBlockNotFoundError

        from .threads import trace_lock

        method = TransformersModel.generate.__wrapped__
        if self.interleaver.interleaving and trace_lock(self)._is_owned():
            return method(self, *inputs, **kwargs)
        fn = method.__get__(self, type(self))
        tracer = self.trace(*inputs, fn=fn, **kwargs)
        try:
            tracer.capture()  # finds the caller's ``with`` two frames up, as nnsight's ``traceable`` does
        except WithBlockNotFoundError:
            return self.interleave(fn, *inputs, **kwargs)
        return tracer

    def interleave(self, *args: Any, **kwargs: Any) -> Any:
        """nnsight's run of the model with the trace's workers, under this model's lock (re-entrant), with
        ``.grad`` of a served value named as an error in the forward."""
        from .gradients import forward_guard
        from .threads import trace_lock

        with trace_lock(self), forward_guard():
            return super().interleave(*args, **kwargs)

    # -- inputs --------------------------------------------------------------

    def _batch_size(self, *inputs: Any, **kwargs: Any) -> int:
        """Rows an invoke's input adds; no prompt at all (``None``, ``[]``) is refused by name."""
        if inputs and (inputs[0] is None or (isinstance(inputs[0], (list, tuple)) and len(inputs[0]) == 0)):
            raise InvalidInput(
                f"model.trace / model.generate was given {inputs[0]!r}: there is no prompt to run. Give a "
                "string, a list of strings, or token ids; to batch with invokes, call model.trace() with "
                "no input and tracer.invoke(prompt) inside."
            )
        return super()._batch_size(*inputs, **kwargs)

    def _batch(self, invokes: list, fn: Any) -> tuple:
        """The batched forward input; refuses an empty row, token ids the embedding has no row for, and a
        prompt longer than the model's positions."""
        args, kwargs = super()._batch(invokes, fn)
        self._refuse_idle_inputs(kwargs)
        from torch._guards import detect_fake_mode

        # Under nnsight's scan (fake tensors) there are no values to check; the real trace checks them.
        real = detect_fake_mode() is None
        if args and isinstance(args[0], torch.Tensor):  # nnsight passes a float tensor on as it is: the ids' place
            self._check_token_ids(args[0], real)
        ids, mask = kwargs.get("input_ids"), kwargs.get("attention_mask")
        if isinstance(ids, torch.Tensor):
            self._check_token_ids(ids, real)
        if isinstance(ids, torch.Tensor) and ids.dim() == 2:
            masked = isinstance(mask, torch.Tensor) and real
            lengths = mask.sum(-1).tolist() if masked else [ids.shape[1]] * ids.shape[0]
            empty = [row for row, length in enumerate(lengths) if length == 0]
            if empty:
                raise InvalidInput(
                    f"batch row(s) {empty} have no tokens: an empty prompt, and this tokenizer adds no BOS "
                    "token, so the model would predict from padding only. Give every prompt at least one "
                    "token (or a tokenizer that adds a BOS token)."
                )
            limit = self._position_limit()
            if limit is not None and ids.shape[1] > limit:
                raise InvalidInput(
                    f"the prompt is {ids.shape[1]} tokens long, but this {self._text_config.model_type} model "
                    f"has {limit} positions (a learned position table of {limit} rows): give at most {limit} "
                    "tokens, e.g. tokenizer(..., truncation=True, max_length=...)."
                )
        return args, kwargs

    def _check_token_ids(self, ids: torch.Tensor, real: bool) -> None:
        """Refuse token ids that are not integers, or (``real``: values to read) have no row in the embedding."""
        if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
            raise InvalidInput(
                f"the token ids are a {ids.dtype} tensor: token ids are integers (torch.long), indices into "
                "the model's embedding. Pass ids.long(), or the text itself."
            )
        rows = getattr(self.embed_tokens._module, "num_embeddings", None)
        if not real or ids.numel() == 0 or not isinstance(rows, int):
            return
        low, high = int(ids.min()), int(ids.max())
        if low < 0 or high >= rows:
            bad = sorted({int(i) for i in ids[(ids < 0) | (ids >= rows)].unique()[:5]})
            raise InvalidInput(
                f"token id(s) {bad} are outside this model's vocabulary: its embedding has {rows} rows, so an "
                f"id is in 0..{rows - 1}. Tokenize with model.tokenizer (ids of another tokenizer do not fit "
                "this model)."
            )

    def _refuse_idle_inputs(self, kwargs: dict) -> None:
        """Refuse a forward argument that would run the blocks the family serves as idle (`Family.idle_inputs`)."""
        given = [name for name in self._family.idle_inputs if kwargs.get(name) is not None]
        if given:
            idle = [i for i in range(self.num_layers) if self._family.idle_reason(self._text_config, i) is not None]
            raise InvalidInput(
                f"this {self._text_config.model_type} model was given {', '.join(given)}: with it the model runs "
                f"blocks {idle}, which nncanon serves as idle blocks (the stream passes them; "
                f"{self._family.idle_reason(self._text_config, idle[0])}). nncanon serves the text path: trace "
                "text alone, or use the transformers model directly for image inputs."
            )

    def _position_limit(self) -> int | None:
        """The longest sequence the model can embed, where it has a learned position table (GPT-2's ``n_positions``)."""
        if "_position_limit_cache" not in self.__dict__:
            config = self._text_config
            limit = getattr(config, "n_positions", None)
            most = getattr(config, "max_position_embeddings", None)
            if limit is None and isinstance(most, int):
                token_table = self.embed_tokens._module
                tables = [m for m in self._module.modules() if isinstance(m, torch.nn.Embedding)]
                # a learned position table (OPT offsets its rows by 2)
                if any(m.num_embeddings in (most, most + 2) for m in tables if m is not token_table):
                    limit = most
            self.__dict__["_position_limit_cache"] = limit
        return self.__dict__["_position_limit_cache"]

    # -- remote --------------------------------------------------------------

    def _remoteable_class(self) -> type:
        """Remote requests are keyed as the plain ``TransformersModel`` the server hosts.

        nncanon is shipped with the request by value (``nnsight.register``, see ``nncanon/__init__``):
        the server needs nnsight and transformers only.
        """
        return TransformersModel

    # -- sizes ---------------------------------------------------------------

    @property
    def family(self) -> Family:
        """The family serving this model: the registered one, or the one inferred (see `inferred`)."""
        return self._family

    @property
    def inferred(self) -> Any:
        """The `nncanon.inference.InferredFamily` where no family is registered for this model type
        (its record was inferred from a twin and proved on it); ``None`` for a registered family."""
        return self._inferred

    @property
    def num_layers(self) -> int:
        """Number of blocks."""
        return len(self.layers)

    @property
    def num_heads(self) -> int:
        """Number of heads ``attention_head_outputs`` splits into per block: the query heads (DiffLlama's
        differential heads). ``nncanon.tools.head_count`` gives one block's.

        Raises:
            SizeNotAvailable: for a model without softmax attention (Mamba, RWKV, xLSTM).
        """
        if self._family.head_shape is not None:
            return self._one_head_size(0, "num_heads")
        count = getattr(self._text_config, "num_attention_heads", None)
        if count is None:
            raise SizeNotAvailable(
                f"{self._text_config.model_type} has no softmax attention, so no num_heads; "
                f"support().layers_with('self_attn') is {self.support().layers_with('self_attn')}. "
                "A linear mixer's heads, where it has them: nncanon.tools.head_count(model, layer, "
                "'linear_attention_head_outputs')."
            )
        return count

    def _one_head_size(self, axis: int, name: str) -> int:
        """``head_shape``'s size on ``axis`` (0: heads, 1: width), the same on every attention block, or raise."""
        config = self._text_config
        sizes = {
            index: self._family.head_shape(config, index)[axis]
            for index in self.support().layers_with("attention_head_outputs")
        }
        if not sizes:
            raise SizeNotAvailable(f"no block of this {config.model_type} model serves attention_head_outputs")
        if len(set(sizes.values())) != 1:
            raise SizeNotAvailable(
                f"{config.model_type}'s {name} differs by layer ({sizes}): there is no one {name}. "
                "nncanon.tools.head_count(model, layer) gives a block's heads; a block's width is "
                "attention_head_outputs.shape[-1]."
            )
        return next(iter(sizes.values()))

    @property
    def num_kv_heads(self) -> int:
        """Number of key/value heads per block (fewer than ``num_heads`` under GQA/MQA)."""
        config = self._text_config
        if self._family.kv_heads is not None:
            return self._family.kv_heads(config)
        kv = getattr(config, "num_key_value_heads", None)
        if kv is None:
            kv = 1 if getattr(config, "multi_query", False) else self.num_heads
        return kv

    @property
    def head_dim(self) -> int:
        """Width of one head's output (``attention_head_outputs[..., h, :]``).

        Under multi-head latent attention (DeepSeek, MiniCPM3, Youtu) that is the value head width
        ``v_head_dim``; such configs set ``head_dim`` to the rotary part of the query/key heads.

        Raises:
            SizeNotAvailable: where the width differs by layer (Gemma-4's full-attention layers).
        """
        config = self._text_config
        if self._family.head_shape is not None:
            return self._one_head_size(1, "head_dim")
        try:
            heads = getattr(config, "num_attention_heads", None)
        except RuntimeError:  # a heterogeneous config (Gemma-4): it has heads, differing by layer
            heads = True
        if heads is None:  # (a Mamba-2 config's head_dim is its state-space heads' width)
            raise SizeNotAvailable(
                f"{config.model_type} has no softmax attention, so no head_dim (nor num_heads); "
                f"support().layers_with('self_attn') is {self.support().layers_with('self_attn')}. A linear "
                "mixer's head width, where it has heads: linear_attention_head_outputs.shape[-1]."
            )
        for name in ("v_head_dim", "head_dim"):
            try:
                width = getattr(config, name, None)
            except RuntimeError as error:  # a heterogeneous config (Gemma-4): the width differs by layer
                per_layer = config.per_layer_config
                widths = {index: getattr(per_layer[index], name) for index in range(len(per_layer))}
                raise SizeNotAvailable(
                    f"{config.model_type}'s {name} differs by layer ({widths}): there is no one head_dim. "
                    "A block's is attention_head_outputs.shape[-1]; nncanon.tools.head_count(model, layer) "
                    "gives its heads."
                ) from error
            if width:
                return width
        return config.hidden_size // self.num_heads

    @property
    def hidden_size(self) -> int:
        """Width of the residual stream."""
        return self._text_config.hidden_size

    @property
    def vocab_size(self) -> int:
        """Number of tokens the head scores."""
        return self._text_config.vocab_size

    # -- model-level values --------------------------------------------------

    @model_value(key="output")
    def logits(self, value: Any) -> torch.Tensor:
        """The model's logits, ``[batch, seq, vocab]``, after its own post-processing.

        Writable in place (``model.logits[:, -1] = t``) or by assignment (``model.logits = t``, checked
        like every value: `InvalidWrite` unless ``t`` broadcasts to ``[batch, seq, vocab]`` with the
        logits' dtype and device). An assignment replaces the logits inside the model's output; the
        output keeps its type, so ``generate`` samples from the written logits.
        """
        return value.logits if hasattr(value, "logits") else value[0]

    @logits.writer
    def logits(self, value: Any, raw: Any) -> Any:
        current = StandardizedTransformer.logits._preprocess(self, raw)
        check_write(value, current, "model.logits")
        value = value.expand_as(current)
        if hasattr(raw, "logits") and not isinstance(raw, tuple):
            output = copy.copy(raw)  # a ModelOutput: the same type and fields, the logits replaced
            output.logits = value
            return output
        return (value, *raw[1:])

    @property
    def next_token_probs(self) -> torch.Tensor:
        """The next-token distribution at the last position, ``[batch, vocab]`` (softmax of ``logits[:, -1]``).

        Read-only: it is computed from the logits. Write ``model.logits[:, -1]`` to change it.
        """
        self._model_value_check("logits", asked="next_token_probs")
        return torch.softmax(self.logits[:, -1], dim=-1)

    @next_token_probs.setter
    def next_token_probs(self, value: Any) -> None:
        raise InvalidWrite(
            f"model.next_token_probs is read-only (the softmax of logits[:, -1]); it was assigned a "
            f"{type(value).__name__}. Write the logits instead: model.logits[:, -1] = ... "
            "(torch.log of a distribution gives logits whose softmax is that distribution)."
        )

    def project_on_vocab(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits from a residual-stream state, ``[..., hidden]`` to ``[..., vocab]``.

        Applies the family's final norm, any module before the head, ``lm_head`` and the
        family's logit post-processing (soft-capping, scaling), so that on the last layer's
        output it equals ``logits``. Works inside a trace and on plain tensors. A multi-stream
        model takes its ``[..., k·hidden]`` stream, collapsed as the model collapses it.

        Raises:
            InvalidInput: ``hidden`` is not a tensor, or the projection fails on its width or dtype.
        """
        self._model_value_check("project_on_vocab")
        if not isinstance(hidden, torch.Tensor):
            raise InvalidInput(
                f"model.project_on_vocab was given a {type(hidden).__name__}; it takes a residual-stream tensor "
                f"[..., {self.hidden_size}] (a layer_input or layer_output)."
            )
        try:
            return self._project(hidden)
        except RuntimeError as error:
            problem = self._projection_problem(hidden)
            if problem is None:
                raise
            raise InvalidInput(f"model.project_on_vocab was given a tensor of {problem}") from error

    def _projection_problem(self, hidden: torch.Tensor) -> str | None:
        """What in ``hidden`` a failed projection did not take: its width or its dtype (``None``: neither)."""
        plain = self._family.collapse is None and not self._family.merged_streams and not self._family.stacked_streams
        if plain and hidden.shape[-1] != self.hidden_size:
            return (f"shape {tuple(hidden.shape)}: its last axis is the residual stream's, {self.hidden_size} wide "
                    f"(a layer_input or layer_output), not {hidden.shape[-1]}.")
        weight = getattr(self.lm_head._module, "weight", None)
        if isinstance(weight, torch.Tensor) and hidden.dtype != weight.dtype:
            return f"dtype {hidden.dtype}; the model runs in {weight.dtype}: pass hidden.to({weight.dtype})."
        return None

    def _project(self, hidden: torch.Tensor) -> torch.Tensor:
        """`project_on_vocab` of a tensor."""
        x = hidden
        if self._family.collapse is not None:
            x = self._family.collapse(self._module, x)
        if self._family.merged_streams:  # the final norm takes the model's own [..., k, hidden]
            x = x.unflatten(-1, (-1, self.hidden_size))
        stream_divisor = self._family.step_factor("divide_stream", self._text_config)
        if stream_divisor is not None:
            x = x / stream_divisor
        if self.norm is not None:
            x = self.norm(x)
        for module in self._before_head:
            x = module(x)
        input_divisor = self._family.step_factor("divide_input", self._text_config)
        if input_divisor is not None:
            x = x / input_divisor
        return apply_logit_steps(self.lm_head(x), self._family, self._text_config)

    # -- skipping ------------------------------------------------------------

    def skip_layers(self, start: int, end: int | None = None, skip_with: torch.Tensor | None = None) -> None:
        """Skip blocks ``start..end`` (inclusive): they do not run, the stream passes them unchanged.

        By default the blocks pass ``layers[start].layer_input`` through; ``skip_with`` gives
        another ``[batch, seq, hidden]`` tensor. Blocks that return a tuple get the structure
        they return. A skip must cover every invoke of a batched trace (nnsight raises
        ``ValueError`` otherwise).

        Indices follow Python's rule, as ``model.layers[i]`` does: ``-1`` is the last block.
        Skips of one trace are made in block order and do not overlap. A block the model does not run
        (`Family.idle`: Mllama's cross-attention blocks on text alone) is passed over. Inside ``generate`` a skip
        needs ``use_cache=False`` (a skipped block would leave its cache without that step's tokens).

        Raises:
            InvalidSkip: for an index that is not an int or is out of range, a skip that overlaps or
                precedes one already made in the trace, a skip made after a read of a value of ``start`` or a
                later block (the model has run past it), a skip inside ``generate`` with a cache, or a
                replacement whose type, shape, dtype or device does not match the stream at
                ``layers[start]``; a value of a skipped block read in the same trace.
        """
        self._model_value_check("skip_layers")
        start, end = self._skip_range(start, end)
        self._check_not_generating_with_cache(start, end)
        record = self._new_skip(start, end)
        if self._family.stacked_streams:
            self._one_invoke(start, end)
        refusal = self._family.refuse_skip(self._text_config, start, end) if self._family.refuse_skip else None
        if refusal is not None:
            raise InvalidSkip(f"skip_layers({start}, {end}) cannot run on this model: {refusal}")
        expected = self._skip_input(start, end)
        replacement = expected if skip_with is None else skip_with
        if skip_with is not None:
            self._check_replacement(skip_with, expected, start, end)
        record()
        if self._family.stacked_streams:  # the blocks' own layout, [k, b, s, d]
            replacement = served_as_stacked(replacement, replacement.shape[-1] // self.hidden_size)
        if self._family.merged_streams:  # the blocks' own layout, [b, s, k, d]
            replacement = replacement.unflatten(-1, (-1, self.hidden_size))
        extras = (None,) * self._family.block_extras
        for index in range(start, end + 1):
            if self.layers[index].__dict__["_nncanon"].bindings["layer_input"].block is not None:
                continue  # an idle block (`Family.idle`): the model does not run it, the stream passes it already
            state = self._family.passes_state
            if isinstance(state, str):
                extras = (self.layers[index].inputs[1].get(state), *(None,) * (self._family.block_extras - 1))
            elif state:
                extras = tuple(self.layers[index].inputs[0][1 : 1 + self._family.block_extras])
            tupled = extras or self._family.block_tuple
            self.layers[index].skip((replacement, *extras) if tupled else replacement)

    def _skip_input(self, start: int, end: int) -> torch.Tensor:
        """``layers[start].layer_input``, the stream the skip passes on; a skip made after a read of a value the
        model computes later (the model has run past ``layers[start]``) is an `InvalidSkip` naming that read."""
        from nnsight.intervention.interleaver import Mediator

        try:
            return self.layers[start].layer_input
        except OutOfOrderRead:
            last = Mediator.current("skip_layers").__dict__.get("_nncanon_last_read")
            read = f"{last} was read" if last is not None else "a value of a later block was read"
            raise InvalidSkip(
                f"skip_layers({start}, {end}) comes after {read} in this trace: the model had run past the start "
                f"of layers[{start}] by then, so it can no longer skip it. Make the skip before reading values of "
                f"layers[{start}] or later (reads of earlier blocks may come first)."
            ) from None

    @staticmethod
    def _one_invoke(start: int, end: int) -> None:
        """Refuse a skip in a trace with several invokes on a model whose blocks take stacked streams:
        nnsight joins the invokes' skips on the first axis, which is the streams' there."""
        from nnsight.intervention.interleaver import Mediator

        if _rows(Mediator.current("skip_layers"))[1] is not None:
            raise InvalidSkip(
                f"skip_layers({start}, {end}) in a trace with several invokes: this model's blocks take their "
                "streams stacked first ([k, b, s, d]) and nnsight joins the invokes' skips on the first axis. "
                "Skip in a trace with one invoke (batch the prompts in that invoke)."
            )

    def _check_not_generating_with_cache(self, start: int, end: int) -> None:
        """Refuse a skip inside ``generate`` with a cache, before the forward runs (see `skip_layers`)."""
        from .threads import generation_cache

        if generation_cache(self):
            raise InvalidSkip(
                f"skip_layers({start}, {end}) inside model.generate with a cache: a skipped block writes no "
                "key/value cache (nor a hybrid's recurrent state) for the tokens of that step, so a later "
                "step would run the block on a cache missing them (transformers crashes on a shape, or a "
                "hybrid runs on silently without that state). Generate with use_cache=False (each step "
                "runs the whole sequence, and the skip applies to that step's forward), or skip in "
                "model.trace."
            )

    def _skip_range(self, start: Any, end: Any) -> tuple[int, int]:
        """``(start, end)`` as block indices by `layer_index`'s rule (negative counts from the end), or raise."""
        end = start if end is None else end
        count = self.num_layers
        try:
            first, last = layer_index(start, count, "skip_layers"), layer_index(end, count, "skip_layers")
        except InvalidLayer as error:
            where = "" if isinstance(error.__cause__, TypeError) else f" asks for blocks outside 0..{count - 1}"
            raise InvalidSkip(
                f"skip_layers({start!r}, {end!r}){where}: {error} Give 0 <= start <= end < {count} "
                "(end is inclusive; negative counts from the end)."
            ) from None
        if first > last:
            raise InvalidSkip(
                f"skip_layers({start}, {end}) asks for blocks {first}..{last}, which is empty; "
                f"give start <= end (end is inclusive; both in 0..{count - 1}, or negative from the end)."
            )
        return first, last

    def _new_skip(self, start: int, end: int) -> Callable[[], None]:
        """Refuse a skip that overlaps or precedes one this invoke already made; return what notes it."""
        from nnsight.intervention.interleaver import Mediator

        from .order import SkipRecord, skips

        first = self.layers[0].__dict__["_nncanon"].bindings["layer_input"].location
        mediator = Mediator.current("skip_layers")
        record = SkipRecord(start, end, mediator.wanted(first))
        for made in skips(mediator):
            if made.step != record.step:
                continue
            if made.start <= end and start <= made.end:
                raise InvalidSkip(
                    f"{record.call} overlaps {made.call}, made earlier in this trace: blocks "
                    f"{max(start, made.start)}..{min(end, made.end)} would be skipped twice. Make one call, "
                    f"skip_layers({min(start, made.start)}, {max(end, made.end)})."
                )
            if start < made.start:
                raise InvalidSkip(
                    f"{record.call} comes after {made.call} in this trace, but its blocks run first: "
                    "the model runs blocks in index order, so make skips (and reads) in that order."
                )
        return partial(skips(mediator).append, record)

    @staticmethod
    def _check_replacement(value: Any, expected: torch.Tensor, start: int, end: int) -> None:
        what = f"skip_layers({start}, {end}, skip_with=...)"
        if not isinstance(value, torch.Tensor):
            raise InvalidSkip(
                f"{what} got a {type(value).__name__}; blocks {start}..{end} need a tensor like "
                f"layers[{start}].layer_input: shape {tuple(expected.shape)}, dtype {expected.dtype}, "
                f"on {expected.device}. Pass the hidden state itself; the block's tuple structure is added for you."
            )
        problems = []
        if value.shape != expected.shape:
            problems.append(f"shape {tuple(value.shape)} (expected {tuple(expected.shape)})")
        if value.dtype != expected.dtype:
            problems.append(f"dtype {value.dtype} (expected {expected.dtype})")
        if value.device != expected.device:
            problems.append(f"device {value.device} (expected {expected.device})")
        if problems:
            raise InvalidSkip(
                f"{what}: the replacement for layers {start}..{end} has " + ", ".join(problems)
                + f"; it must look like layers[{start}].layer_input."
            )

    # -- support -------------------------------------------------------------

    def support(self) -> SupportReport:  # noqa: F821 - imported lazily below
        """Which standard values each layer serves, and why not where it does not. No forward runs."""
        from .support import SupportReport

        return SupportReport.of(self)

    def steer(self, layers: Any, vector: torch.Tensor, factor: float = 1.0, positions: Any = None) -> None:
        """Add ``factor · vector`` to ``layers[l].layer_output`` inside a trace: `nncanon.tools.steer`."""
        from .tools.steering import steer

        steer(self, layers, vector, factor, positions)
