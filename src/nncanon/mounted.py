"""The mounted model: an nnsight model with its family's surface, sizes, skips and logits, and no proof.

`MountedModel` is what the proof mounts on a twin and what `nncanon.StandardizedTransformer` adds the load and the
proof to: every standard value of every block (`nncanon.mounting.mount`), the model-level values (``logits``,
``next_token_probs``, ``project_on_vocab``, ``skip_layers``), the sizes, and the refusals of inputs it cannot
run. The overrides of nnsight's own methods are listed, with why, in `nncanon.nnsight_internals`.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import nnsight
import torch
from nnsight.modeling.transformers import TransformersModel
from nnsight.tracing.tracer import WithBlockNotFoundError

from .components.norms import DESCRIPTIONS, FINAL_VALUES, NormBinding, NormSite, is_norm, norm_anatomy, norm_value
from .errors import InvalidInput, InvalidSkip, InvalidWrite, NestedTrace, SizeNotAvailable, ValueNotAvailable
from .families import Family
from .families.base import apply_logit_steps
from .gradients import forward_guard
from .inputs import check_batch, refuse_no_prompt
from .model_sites import final_norm_path, model_sites
from .mounting import mount
from .quantization import QuantizedWeight, float_dtype, guarded, head_dtype, is_quantized
from .quiet import wrapping_quietly
from .served import Binding, check_write, model_value, served, served_as_stacked
from .skipping import (
    check_not_generating_with_cache,
    check_replacement,
    new_skip,
    one_invoke,
    skip_input,
    skip_range,
)
from .support import SupportReport
from .threads import SerialTracer, trace_lock
from .traced import outside_trace, refuse_outside_trace, renamed

# Remote (NDIF) requests ship nncanon's code by value, so a server without nncanon runs them: registered here, where
# every model nncanon serves is built (``nncanon/__init__`` imports nothing heavy, for a fast command line).
nnsight.register("nncanon")


#: Where `MountedModel.support_held` keeps its report.
_HELD_SUPPORT = "_nncanon_held_support"


class MountedModel(TransformersModel):
    """A transformers causal LM in nnsight with a family's standard surface mounted on it, unproved.

    Args:
        model: A built ``PreTrainedModel``, or what ``TransformersModel`` loads (a hub id, a local folder).
        family: The `Family` whose surface is mounted.
        tokenizer: The model's tokenizer (it pads on the left, so ``[:, -1]`` is every prompt's last token).
        **kwargs: Go to nnsight's ``TransformersModel``.

    Researchers use `nncanon.StandardizedTransformer`, which loads, mounts and proves; the proof mounts this
    class on its twins.
    """

    def __init__(self, model: Any, *args: Any, family: Family, tokenizer: Any = None, **kwargs: Any) -> None:
        with wrapping_quietly():
            super().__init__(model, *args, tokenizer=tokenizer, **kwargs)
        self._family = family
        self._text_config = self._module.config.get_text_config()
        # Native paths first: a standard name bound below may shadow a native module of that name
        # (ModernBERT-decoder's native ``lm_head`` is the prediction head run before ``decoder``).
        self._before_head = [m for m in map(self._optional, family.before_head) if m is not None]
        self.layers = self.get(family.layers)
        self.embed_tokens = self.get(family.embed_tokens)
        self.norm = self._optional(family.norm)
        self.lm_head = self.get(family.lm_head)
        declines = family.model_declines
        self._model_declines: dict[str, str] = dict(declines(self._text_config) if callable(declines) else declines)
        #: What `mount` found each block's layout has not at all (`nncanon.mounting.mount`).
        self._unserved = mount(self, family, self._text_config)
        #: The model-level values read at a module (`nncanon.model_sites`), and the gradients of those declined.
        #: Those the family has not at all (no position embeddings on a rotary model): not served, not declined.
        self._model_bindings, self._model_absent = model_sites(self, family, self._text_config)
        self._model_gradient_declines: dict[str, str] = {}
        #: The final norm's values (`nncanon.components.norms`), or why the model has none (then absent).
        self._final_norm = self._mount_final_norm()
        if isinstance(self._final_norm, str):
            self._model_absent = {**self._model_absent, **dict.fromkeys(FINAL_VALUES, self._final_norm)}

    def _mount_final_norm(self) -> dict[str, NormBinding] | str:
        """The final norm's values (`nncanon.components.norms`), or why the model has none to serve."""
        if self.norm is None:
            return "the model has no final norm"
        if self._family.merged_streams or self._family.stacked_streams:
            return ("its final norm takes the model's k streams together ([b, s, k, d]) and returns one: it is no norm "
                    "of one stream")
        if not is_norm(self.norm._module):
            return (f"the module applied before its head ({self._family.norm}, {type(self.norm._module).__name__}) is "
                    "not a norm")
        anatomy = norm_anatomy(self.norm._module)
        if isinstance(anatomy, str):
            return anatomy.replace("its norm", "its final norm", 1)
        site = NormSite(self._family.norm, self.norm, anatomy, "model", "", "final_norm_scale")
        return {name: NormBinding(name, site, "scale" if name.endswith("_scale") else "normalized")
                for name in FINAL_VALUES}

    def _nncanon_norm(self, name: str) -> NormBinding:
        """The final norm's `NormBinding` ``name``, or `ValueNotAvailable` with the reason."""
        self._model_value_check(name)
        found = self.__dict__.get("_final_norm", "the model is not mounted")
        if isinstance(found, str):
            raise ValueNotAvailable(f"model.{name} is not available: {found}")
        return found[name]

    def _nncanon_binding(self, name: str) -> Binding:
        """The binding of the model-level value ``name`` (`served` reads it), or `ValueNotAvailable` with the reason."""
        self._model_value_check(name)
        return self._model_bindings[name]

    def _nncanon_gradient_reason(self, name: str) -> str | None:
        """Why the gradient of the model-level value ``name`` is not served (its gradient check failed), or ``None``."""
        return self.__dict__.get("_model_gradient_declines", {}).get(name)

    def _model_value_check(self, name: str, asked: str | None = None) -> None:
        """Raise `ValueNotAvailable` where the model-level value ``name`` is declined (``asked``: the value
        the user asked for, where it is computed from ``name``)."""
        reason = self.__dict__.get("_model_declines", {}).get(name) or self.__dict__.get("_model_absent", {}).get(name)
        if reason is not None:
            raise ValueNotAvailable(f"model.{asked or name} is not available: {reason}")

    def __getattr__(self, name: str) -> Any:
        # A property of this class that raised an AttributeError (a declined value's ValueNotAvailable) lands
        # here, where nnsight's Envoy would answer a generic "has no attribute": raise the property's own error.
        # Its checks run before it reads the model, so asking it again reads nothing twice.
        if name in FINAL_VALUES:
            self._nncanon_norm(name)
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
        if trace_lock(self)._is_owned():  # (this thread runs a trace of this module: of this model, or another's)
            other = "" if self.interleaver.interleaving else (
                " through another nncanon model over the same torch module (two wrappers of one module share its "
                "hooks and its run)")
            raise NestedTrace(
                f"a trace of this model was started inside an open trace of it{other} (directly, or by a tool that "
                "runs its own forward: a sweep, patching, the logit lens, a cache): nnsight runs one trace of a model "
                "at a time. Call it after the `with model.trace(...)` block, on what you saved there"
            )
        if not kwargs.get("remote") and kwargs.get("backend") is None:  # a remote request runs on the server
            kwargs.setdefault("tracer_cls", SerialTracer)
        return super().trace(*inputs, **kwargs)

    def generate(self, *inputs: Any, **kwargs: Any) -> Any:
        """nnsight's ``generate`` (a trace of the decoding loop with ``with``, else the token ids), under this
        model's lock. Called inside a trace of this thread it generates there; another thread's trace running
        meanwhile is not "inside" (nnsight's own check would take it for one and run the bare method)."""
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
        ``.grad`` of a served value named as an error in the forward, and torch's errors from the trace's code named
        where nncanon can say what was done (`nncanon.traced.renamed`)."""
        with trace_lock(self), forward_guard():
            try:
                return super().interleave(*args, **kwargs)
            except RuntimeError as error:  # torch's, from the trace's code: named where nncanon can say more
                named = renamed(error)
                if named is None:
                    raise
                raise named from error

    # -- inputs --------------------------------------------------------------

    def _batch_size(self, *inputs: Any, **kwargs: Any) -> int:
        """Rows an invoke's input adds; no prompt at all (``None``, ``[]``) is refused by name."""
        refuse_no_prompt(inputs)
        return super()._batch_size(*inputs, **kwargs)

    def _batch(self, invokes: list, fn: Any) -> tuple:
        """The batched forward input, checked (`nncanon.inputs.check_batch`)."""
        args, kwargs = super()._batch(invokes, fn)
        check_batch(self, args, kwargs)
        return args, kwargs

    # -- remote --------------------------------------------------------------

    def _remoteable_class(self) -> type:
        """Remote requests are keyed as the plain ``TransformersModel`` the server hosts.

        nncanon is shipped with the request by value (``nnsight.register``, at the top of this module):
        the server needs nnsight and transformers only.
        """
        return TransformersModel

    # -- sizes ---------------------------------------------------------------

    @property
    def family(self) -> Family:
        """The family serving this model."""
        return self._family

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

    token_embeddings = served("token_embeddings", "the token embedding module's output", """The token embeddings,
        ``[batch, seq, hidden]``: the output of the token embedding module (``embed_tokens``, GPT-2's ``wte``), the
        TransformerLens ``hook_embed``.

        A scale the module applies itself is in it (Gemma's ``sqrt(hidden_size)``, inside its scaled embedding); one the
        model's forward applies after it is not (Granite's ``embedding_multiplier``): the load-time proof checks that
        ``layers[0].layer_input`` is ``norm(project(token_embeddings) · scale + position_embeddings)`` with the family's
        own terms (`nncanon.families.Embeddings`). Writable (a write replaces the embedding rows of its invoke) and with
        ``.grad``, the gradient at the embeddings.""")

    position_embeddings = served("position_embeddings", "the absolute position embeddings", """The absolute position
        embeddings, ``[batch, seq, hidden]``: the output of the position embedding module (GPT-2's ``wpe``, OPT's
        learned positions with their offset, XGLM's sinusoidal ones), the TransformerLens ``hook_pos_embed``; a model
        that broadcasts one row over the batch is served its rows for each prompt. Writable, with ``.grad``.

        Raises:
            ValueNotAvailable: on a model whose positions do not enter the stream (rotary, ALiBi, a recurrent mixer),
                saying which.""")

    final_norm_output = served("final_norm_output", "what the head reads: the final norm's output", """The final
        norm's output, ``[batch, seq, hidden]``, weight (and bias) applied: what the head reads (through the modules
        `Family.before_head` names where a family has them, OPT's ``project_out``). ``lm_head`` of it, with the family's
        logit post-processing, is ``logits``; ``project_on_vocab(layers[-1].layer_output)`` normalises the stream to it.
        TransformerLens's ``ln_final.hook_normalized`` is the norm's input normalised before its weight (TransformerLens
        folds the weight into the unembedding): ``final_normalized``, not this. Writable (a write reaches the head),
        with ``.grad``.

        Raises:
            ValueNotAvailable: on a configuration without a final norm (OPT's post-LN).""")

    final_norm_scale = norm_value("final_norm_scale", *DESCRIPTIONS["final_norm_scale"])
    final_normalized = norm_value("final_normalized", *DESCRIPTIONS["final_normalized"])

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
        current = MountedModel.logits._preprocess(self, raw)
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
        outside = outside_trace(self, "model.next_token_probs")
        if outside is not None:
            return outside
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
        plain = self._family.rescale is None and not self._family.merged_streams and not self._family.stacked_streams
        if plain and hidden.shape[-1] != self.hidden_size:
            return (f"shape {tuple(hidden.shape)}: its last axis is the residual stream's, {self.hidden_size} wide "
                    f"(a layer_input or layer_output), not {hidden.shape[-1]}.")
        dtype = float_dtype(self._module)  # (not the head's weight: a quantized head holds integers)
        if hidden.dtype != dtype:
            return f"dtype {hidden.dtype}; the model runs in {dtype}: pass hidden.to({dtype})."
        return None

    def _project(self, hidden: torch.Tensor) -> torch.Tensor:
        """`project_on_vocab` of a tensor."""
        return self._from_final_norm(self._to_final_norm(hidden))

    def _head_stages(self) -> list[tuple[str, Any]]:
        """What the model runs from the stream leaving its last block to the head's input, by name: the final norm
        (``norm``, its path), the modules before the head (their paths), then ``lm_head`` (the divisor and cast of the
        head's input). `final_norm_output` is the output of the stage `Family.final_norm` names."""
        stages: list[tuple[str, Any]] = []
        if self.norm is not None:
            stages.append((self._family.norm, self.norm))
        paths = [path for path in self._family.before_head if self._optional(path) is not None]
        stages += list(zip(paths, self._before_head, strict=True))

        def head_input(x: torch.Tensor) -> torch.Tensor:
            input_divisor = self._family.step_factor("divide_input", self._text_config)
            if input_divisor is not None:
                x = x / input_divisor
            if self._family.casts_head_input:  # as the model does: lm_head(h.to(lm_head.weight.dtype))
                x = x.to(head_dtype(self.lm_head._module, x.dtype))
            return x

        return [*stages, ("lm_head", head_input)]

    def _final_stage(self) -> int:
        """The index in `_head_stages` whose output is `final_norm_output`."""
        path = final_norm_path(self._family)
        names = [name for name, _ in self._head_stages()]
        return names.index(path) if path in names else 0

    def _to_final_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        """The final norm's output (`final_norm_output`) from a residual-stream state: `project_on_vocab` up to it."""
        x = hidden
        if self._family.rescale is not None:
            x = self._family.rescale(self._module, "collapse", x)[0]
        if self._family.merged_streams:  # the final norm takes the model's own [..., k, hidden]
            x = x.unflatten(-1, (-1, self.hidden_size))
        stream_divisor = self._family.step_factor("divide_stream", self._text_config)
        if stream_divisor is not None:
            x = x / stream_divisor
        stages = self._head_stages()
        if self.norm is None and final_norm_path(self._family) != "lm_head":
            return x  # (no final norm: `final_norm_output` is declined, the stages all follow)
        for _, stage in stages[: self._final_stage() + 1]:
            x = stage(x)
        return x

    def _from_final_norm(self, x: torch.Tensor) -> torch.Tensor:
        """The logits from the final norm's output: the modules before the head, the head, the logit post-processing."""
        stages = self._head_stages()
        first = 0 if self.norm is None and final_norm_path(self._family) != "lm_head" else self._final_stage() + 1
        for _, stage in stages[first:]:
            x = stage(x)
        return apply_logit_steps(self.lm_head(x), self._family, self._text_config)

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
        refuse_outside_trace(self, f"model.skip_layers({start}, {end}) was called")
        start, end = skip_range(self, start, end)
        check_not_generating_with_cache(self, start, end)
        record = new_skip(self, start, end)
        if self._family.stacked_streams:
            one_invoke(start, end)
        refusal = self._family.refuse_skip(self._text_config, start, end) if self._family.refuse_skip else None
        if refusal is not None:
            raise InvalidSkip(f"skip_layers({start}, {end}) cannot run on this model: {refusal}")
        expected = skip_input(self, start, end)
        replacement = expected if skip_with is None else skip_with
        if skip_with is not None:
            check_replacement(skip_with, expected, start, end)
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


    def guard_quantized_weights(self) -> None:
        """Make ``.weight`` of every layer that holds its weight quantized refuse, through the surface, a read (its
        storage is packed: its shape and values mislead) and a write (it would corrupt the packed storage), naming
        `nncanon.quantization.dense_weight` for a read. Called once the model's weights are loaded."""
        for envoy in self.modules():
            module = envoy.__dict__.get("_module")
            if module is not None and is_quantized(module) and not isinstance(envoy, QuantizedWeight):
                envoy.__class__ = guarded(type(envoy))

    # -- support -------------------------------------------------------------

    def support(self) -> SupportReport:
        """Which standard values each layer serves, and why not where it does not. No forward runs."""
        held = self.__dict__.get(_HELD_SUPPORT)
        return held if held is not None else SupportReport.of(self)

    @contextmanager
    def support_held(self) -> Iterator[SupportReport]:
        """Within the block, `support` returns one report, made on entry: for work that asks it many times and
        changes nothing it says (an attribution graph asks it per block and per name it resolves)."""
        if self.__dict__.get(_HELD_SUPPORT) is not None:
            yield self.__dict__[_HELD_SUPPORT]
            return
        self.__dict__[_HELD_SUPPORT] = report = SupportReport.of(self)
        try:
            yield report
        finally:
            del self.__dict__[_HELD_SUPPORT]
