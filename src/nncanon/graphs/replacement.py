"""The local replacement model: the model with every norm's scale and every attention pattern frozen at the clean
run's values and each MLP's output a fixed leaf, read and written through the standard surface only.

Frozen means written back: each norm's scale (``attention_norm_scale``, ``attention_post_norm_scale``,
``mlp_norm_scale``, ``model.final_norm_scale``) and each block's ``attention_probabilities`` are written with the
clean run's values, detached, so the forward's values are the clean run's while no gradient flows through a norm's
denominator or a softmax. Each block's ``mlp_output`` is written with a leaf tensor (its clean value; less the
transcoder's skip connection, which is added back live), so nothing flows through an MLP's nonlinearity either.
What is left between the stream entering block 0 (``layers[0].layer_input``: the token nodes) and the targets (each
transcoder's input, the head's output) is linear: the graph's edges are gradients times source vectors, and the
frozen model is affine in the sources (`nncanon.graphs.verify` proves it on every graph it checks).

`plan_of` says what a model freezes (or why it cannot be linearised); `clean_run` reads the clean values;
`frozen_run` runs the frozen model on given leaves (``[B, n, d]``: one batch row per target of a backward).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import InvalidDictionary, ValueNotAvailable
from ..reading import host, in_execution_order, read
from ..sae import Dictionary, resolve, value_at

#: The values written back with the clean run's, in a block (those the block serves).
FROZEN = ("attention_norm_scale", "attention_probabilities", "attention_post_norm_scale", "mlp_norm_scale")

#: Marks where a block's transcoder input is read among its frozen values.
INPUT = "<transcoder input>"

#: The name a transcoder's input point must resolve to, and its output's.
READS, WRITES = "mlp_input", "mlp_output"


@dataclass
class Plan:
    """What the frozen model writes and reads, per block, in the order the block computes them.

    Attributes:
        steps: Per block, the names to write (`FROZEN` values, ``mlp_output``) and `INPUT`, in execution order.
        final_norm: Whether ``model.final_norm_scale`` is frozen (the model has a final norm).
        head: The unembedding's module path (its output: the logits before the family's soft-cap).
        scale: The linear logit steps after the head, as ``(op, factor)`` (soft-caps left out: circuit-tracer's
            logit targets are before the final soft-cap).
    """

    steps: list[list[str]]
    final_norm: bool
    head: str
    scale: list[tuple[str, Any]] = field(default_factory=list)


def support(model: Any) -> str | None:
    """Why an attribution graph of ``model`` cannot be built on the frozen replacement model, or ``None`` (it can).

    A graph needs every block's token mixer linear in the stream once its pattern is frozen (softmax attention
    with writable probabilities: ``attn_implementation="eager"``; a linear mixer's data-dependent gates are not
    frozen values), and each block's ``mlp_output`` served.
    """
    report = model.support()
    for layer in range(len(model.layers)):
        try:
            resolve(model, f"blocks.{layer}.mlp.hook_in")
        except ValueNotAvailable as error:
            return f"a transcoder has no MLP input to read: {error}"
        if report.available("linear_attention_output", layer):
            return (f"layers[{layer}] has a linear mixer (linear_attn): its data-dependent gates and decays are not "
                    "frozen values of the surface yet, so the block is not linear in the stream")
        if not report.available("mlp_output", layer):
            return (f"layers[{layer}] serves no mlp_output for a transcoder to write: "
                    f"{report.reason('mlp_output', layer)}")
        if report.available("attention_output", layer) and not report.available("attention_probabilities", layer):
            return (f"layers[{layer}]'s attention probabilities are not served, so its pattern cannot be frozen: "
                    f"{report.reason('attention_probabilities', layer)}")
    if getattr(model.config, "_attn_implementation", "eager") != "eager" and report.layers_with("attention_output"):
        return ("attention runs " + repr(model.config._attn_implementation) + ", which never computes the "
                "probabilities, so a frozen pattern cannot be written: load the model with attn_implementation="
                "\"eager\"")
    return None


def plan_of(model: Any) -> Plan:
    """The `Plan` of ``model``; `ValueNotAvailable` with `support`'s reason where it cannot be linearised."""
    reason = support(model)
    if reason is not None:
        raise ValueNotAvailable(f"no attribution graph on this {model.config.model_type} model: {reason}")
    report = model.support()
    steps = []
    for layer in range(len(model.layers)):
        names = [name for name in FROZEN if report.available(name, layer)] + [WRITES]
        ordered = in_execution_order(model, layer, names)
        ordered.insert(ordered.index(WRITES), INPUT)
        steps.append(ordered)
    family = model._family
    scale = [(step.op, step.factor(model.config)) for step in family.logit_steps
             if step.op in ("divide", "multiply", "truncate") and step.factor(model.config) is not None]
    return Plan(steps=steps, final_norm=_has_final_norm(model), head=family.lm_head, scale=scale)


def _has_final_norm(model: Any) -> bool:
    """Whether the model serves ``final_norm_scale`` (its final norm's anatomy is known)."""
    return isinstance(model.__dict__.get("_final_norm"), dict)


def check_transcoders(model: Any, transcoders: Any) -> list[Dictionary | None]:
    """One transcoder (or ``None``: that block's whole MLP output is its error node) per block.

    ``transcoders``: a sequence with one entry per block, or a mapping ``{layer: transcoder}``. Each must be a
    `nncanon.sae.Dictionary` reading the block's MLP input (``mlp.hook_in``: the MLP module's input, the norm's
    weight applied; a transcoder at ``ln2.hook_normalized``, before the weight, is refused) and writing its
    ``mlp_output`` (``hook_mlp_out``) where its config names them; its widths must be the model's.
    """
    n_layers = len(model.layers)
    if isinstance(transcoders, Dictionary):
        transcoders = [transcoders]
    if isinstance(transcoders, dict):
        wrong = sorted(str(k) for k in transcoders if not (isinstance(k, int) and 0 <= k < n_layers))
        if wrong:
            raise InvalidDictionary(f"transcoders are keyed by layer 0..{n_layers - 1}; got keys {wrong}")
        transcoders = [transcoders.get(layer) for layer in range(n_layers)]
    transcoders = list(transcoders)
    if len(transcoders) != n_layers:
        raise InvalidDictionary(f"the model has {n_layers} blocks and {len(transcoders)} transcoders were given: pass "
                                "one per block (None where a block has none) or a mapping {layer: transcoder}")
    hidden = model.config.get_text_config().hidden_size
    for layer, transcoder in enumerate(transcoders):
        if transcoder is None:
            continue
        if not isinstance(transcoder, Dictionary):
            raise InvalidDictionary(f"transcoder {layer} is a {type(transcoder).__name__}, not a "
                                    "nncanon.sae.Dictionary")
        cfg = transcoder.cfg
        where = f"transcoder {layer} ({transcoder.name})"
        if cfg.activation not in ("relu", "jumprelu", "topk") or cfg.rescale_acts_by_decoder_norm:
            raise InvalidDictionary(f"{where} is {cfg.architecture}: a graph's feature targets are the encoder's "
                                    "pre-activation, which relu, jumprelu and top-k transcoders have")
        if cfg.normalize_activations != "none" or cfg.apply_b_dec_to_input:
            raise InvalidDictionary(f"{where} normalises its input ({cfg.normalize_activations}, apply_b_dec_to_input="
                                    f"{cfg.apply_b_dec_to_input}): its features are not linear in the MLP's input")
        if cfg.d_in != hidden or cfg.d_out != hidden:
            raise InvalidDictionary(f"{where} maps {cfg.d_in} -> {cfg.d_out}, but this model's blocks are {hidden} "
                                    "wide: it was trained on another model")
        for name, expected in ((cfg.hook_name, READS), (cfg.hook_name_out, WRITES)):
            if name is None:
                continue
            point = resolve(model, _mlp_hook(name))
            if point.layer != layer or point.value != expected:
                raise InvalidDictionary(f"{where} names {name!r} ({point.label}); a graph's transcoder for block "
                                        f"{layer} reads layers.{layer}.{READS} and writes layers.{layer}.{WRITES}")
        for key, tensor in transcoder.state_dict().items():
            if not torch.isfinite(tensor).all():
                raise InvalidDictionary(f"{where}'s {key} holds NaN or infinite values")
    return transcoders


def _mlp_hook(name: str) -> str:
    """circuit-tracer's ``mlp.hook_out`` (its MLP wrapper's output hook) as the name table's ``hook_mlp_out``
    (``mlp.hook_in``, the MLP module's input, is a name of the table as it is)."""
    return name.replace("mlp.hook_out", "hook_mlp_out")


@dataclass
class Clean:
    """The clean run's values (batch row 0), detached.

    Attributes:
        frozen: Per block, the `FROZEN` values it serves, ``[1, ...]``.
        final_scale: ``model.final_norm_scale`` ``[1, n, 1]`` (``None``: no final norm).
        inputs: Per block, the MLP's input ``[n, d]``.
        outputs: Per block, ``mlp_output`` ``[n, d]``.
        embeddings: ``layers[0].layer_input`` ``[n, d]``: the token nodes' vectors.
        logits: ``model.logits`` ``[n, vocab]`` (after the family's post-processing).
        head: The head's output with the linear logit steps ``[n, vocab]`` (what `frozen_run` returns).
    """

    frozen: list[dict[str, torch.Tensor]]
    final_scale: torch.Tensor | None
    inputs: list[torch.Tensor]
    outputs: list[torch.Tensor]
    embeddings: torch.Tensor
    logits: torch.Tensor
    head: torch.Tensor


def clean_run(model: Any, ids: torch.Tensor, plan: Plan, remote: Any = None) -> Clean:
    """Read the clean run's frozen values, MLP inputs and outputs, stream into block 0 and logits (one trace;
    ``remote`` as `nncanon.StandardizedTransformer.trace` takes it)."""
    frozen: list[dict[str, torch.Tensor]] = [{} for _ in plan.steps]
    inputs: list[torch.Tensor] = []
    outputs: list[torch.Tensor] = []
    saved: dict[str, Any] = {}
    head = _envoy(model, plan.head)
    with torch.no_grad(), model.trace(ids, remote=remote or False):
        saved["embeddings"] = model.layers[0].layer_input.save()
        for layer, steps in enumerate(plan.steps):
            for name in steps:
                if name == INPUT:
                    inputs.append(value_at(model, f"layers.{layer}.{READS}").save())
                elif name == WRITES:
                    outputs.append(read(model, layer, WRITES).save())
                else:
                    frozen[layer][name] = read(model, layer, name).save()
        if plan.final_norm:
            saved["final"] = model.final_norm_scale.save()
        saved["head"] = head.output.save()
        saved["logits"] = model.logits.save()
    return Clean(frozen=[{k: v.detach() for k, v in d.items()} for d in frozen], final_scale=saved.get("final"),
                 inputs=[x[0].detach() for x in inputs], outputs=[x[0].detach() for x in outputs],
                 embeddings=saved["embeddings"][0].detach(), logits=saved["logits"][0].detach(),
                 head=_linear_steps(saved["head"], plan)[0].detach())


def frozen_run(model: Any, ids: torch.Tensor, plan: Plan, clean: Clean, embeddings: torch.Tensor,
               outputs: list[torch.Tensor], skips: list[Dictionary | None] | None = None
               ) -> tuple[list[torch.Tensor], torch.Tensor]:
    """The frozen model on ``embeddings`` ``[B, n, d]`` (written to ``layers[0].layer_input``) and ``outputs``
    (per block ``[B, n, d]``, written to ``mlp_output``, plus the live skip connection of a skip transcoder in
    ``skips``).

    Returns each block's MLP input ``[B, n, d]`` and the head's output ``[B, n, vocab]`` with the family's linear
    logit steps (before any soft-cap), both in the autograd graph of the leaves given.
    """
    saved: dict[str, Any] = {}
    with model.trace(ids.expand(embeddings.shape[0], -1)):
        inputs, head = frozen_body(model, plan, clean, embeddings, outputs, skips)
        saved["inputs"], saved["head"] = [x.save() for x in inputs], head.save()
    return saved["inputs"], saved["head"]


def frozen_body(model: Any, plan: Plan, clean: Clean, embeddings: torch.Tensor, outputs: list[torch.Tensor],
                skips: list[Dictionary | None] | None = None) -> tuple[list[torch.Tensor], torch.Tensor]:
    """`frozen_run`'s writes and reads, inside an open trace of ``B`` copies of the prompt (a remote one too: the
    backward then runs in the same request, `nncanon.graphs.remote`)."""
    batch = embeddings.shape[0]
    inputs: list[torch.Tensor] = []
    model.layers[0].layer_input = embeddings
    for layer, steps in enumerate(plan.steps):
        for name in steps:
            if name == INPUT:
                inputs.append(value_at(model, f"layers.{layer}.{READS}"))
            elif name == WRITES:
                written = outputs[layer]
                skip = skips[layer] if skips is not None else None
                if skip is not None and skip.W_skip is not None:
                    written = written + (inputs[layer].to(skip.dtype) @ skip.W_skip.T).to(written.dtype)
                model.layers[layer].mlp.mlp_output = written
            else:
                _freeze(host(model, layer, name), name, clean.frozen[layer][name], batch)
    if plan.final_norm:
        _freeze(model, "final_norm_scale", clean.final_scale, batch)
    return inputs, _linear_steps(_envoy(model, plan.head).output, plan)


def _freeze(owner: Any, name: str, value: torch.Tensor, batch: int) -> None:
    """Write the clean ``value`` (``[1, ...]``, for ``batch`` rows) to ``owner.name`` and stop the gradient at it.

    A write of a value equal to the model's own leaves the model's tensor in place (nothing changed), and a norm's
    served scale stays in the autograd graph of its input; so the gradient arriving at the served tensor is
    dropped there (a hook returning zeros): the backward sees the value as the constant it is written as.
    """
    current = getattr(owner, name)
    if current.requires_grad:
        current.register_hook(torch.zeros_like)
    setattr(owner, name, value.expand(batch, *value.shape[1:]).contiguous())  # (a family may .view() it)


def _linear_steps(logits: torch.Tensor, plan: Plan) -> torch.Tensor:
    for op, factor in plan.scale:
        if op == "truncate":
            logits = logits[..., :factor]
        elif op == "divide":
            logits = logits / factor
        else:
            logits = logits * factor
    return logits


def _envoy(model: Any, path: str) -> Any:
    envoy = model
    for part in path.split("."):
        envoy = getattr(envoy, part)
    return envoy
