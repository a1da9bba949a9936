"""Direct logit attribution: each sublayer's and each head's share of a target logit.

The method. The logit of token ``t`` at a position is ``u_t · N(h) + c_t``: ``h`` is the residual
stream after the last block, ``N`` the final norm, ``u_t`` the unembedding row of ``t`` (through
any module between the norm and the head) and ``c_t`` the head's bias. The stream is a sum of
contributions, ``h = layers[0].layer_input + Σ_l (attention_output_l + mlp_output_l)`` (the
contribution contract). ``N`` is not linear, but every norm in use has the form
``N(h) = g ⊙ C(h) / σ(h) + b`` (``C`` centres for LayerNorm, is the identity for RMSNorm; ``σ`` is
one number per position). Freezing ``σ`` at its value on the full stream ``h`` makes
``x ↦ g ⊙ C(x) / σ(h)`` linear, so the logit splits exactly into

    logit = Σ_components u_t · (g ⊙ C(x) / σ(h)) · f  +  (u_t · b + c_t) · f

with ``f`` the model's linear logit scaling (Granite's ``1 / logits_scaling``, Cohere's
``logit_scale``). What the final norm makes non-linear is the dependence of ``σ`` on every
component: an attribution is the component's share at the model's actual ``σ``, not the effect
of removing it (which changes ``σ``). Where the model soft-caps its logits (Gemma-2), the
attribution is of the logit before the cap (``logit``; the model's own is ``model_logit``).

The frozen norm is read from the model, not from its formula: ``b = N(0)``, centring is detected
(``N(h + c) = N(h)``), and ``g / σ(h) = (N(h) - b) / C(h)`` element by element, so any norm of
that form (Gemma's ``1 + weight``, no-bias LayerNorms, none at all) is handled alike.

Heads: head ``k``'s output through its slice of the output projection
(`attention_head_contributions`), mapped to the stream the way the family maps the projection:
times Granite's ``residual_multiplier``; through the post-attention norm, frozen the same way at
the projection's output, on Gemma-2/3, OLMo-2/3, GLM-4 and EXAONE-4. The heads plus ``head_bias``
(the projection's bias and the post-norm's bias, mapped the same way) sum to the attention's
attribution.

Hybrids: a linear-attention or state-space mixer's ``linear_attention_output`` is one more
contribution (``linear_attention``); a block without an MLP (Mamba) contributes 0 there.

Neurons (``neurons=True``): neuron ``n``'s activation times its column of the down projection, mapped to the
stream as the family maps the down projection's output (Granite's scale; the post-feedforward norm frozen at that
output on Gemma-2/3 and the other post-norm families), then through the frozen final norm and the head. The
neurons plus ``neuron_bias`` (the down projection's bias and the post-norm's, mapped the same way) sum to the MLP's
attribution, which the tool checks; an MLP whose output is not its down projection's output so mapped (RWKV's
receptance gate) is refused by name.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import ValueNotAvailable
from ..inputs import prompt_list
from ..quantization import dense_weight, head_dtype
from ..reading import CONTRIBUTIONS, in_execution_order, read
from .heads import projection_input, projection_path, projection_weights


@dataclass
class FrozenNorm:
    """A norm ``N(h) = g ⊙ C(h) / σ(h) + b`` with ``σ`` frozen at a point: ``x ↦ scale ⊙ C(x)``.

    Attributes:
        scale: ``g / σ`` at the point, ``[..., hidden]`` (float32).
        bias: ``b = N(0)``, ``[hidden]``.
        centers: Whether ``C`` subtracts the mean (LayerNorm) or is the identity (RMSNorm).
    """

    scale: torch.Tensor
    bias: torch.Tensor
    centers: bool

    def pulled_back(self, direction: torch.Tensor) -> torch.Tensor:
        """The adjoint of `linear`: ``d`` with ``(linear(x) · direction).sum(-1) == (x · d).sum(-1)``, both
        ``[batch, hidden]`` (float32). ``C`` is symmetric, so ``d = C(scale ⊙ direction)``."""
        pulled = self.scale.float() * direction.float()
        return pulled - pulled.mean(-1, keepdim=True) if self.centers else pulled

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        """The frozen norm's linear part on ``x`` ``[batch, ..., hidden]`` (``scale`` is ``[batch, hidden]``)."""
        x = x.float()
        if self.centers:
            x = x - x.mean(-1, keepdim=True)
        scale = self.scale.reshape(self.scale.shape[0], *([1] * (x.dim() - 2)), self.scale.shape[-1])
        return scale * x


def freeze_norm(module: torch.nn.Module | None, at: torch.Tensor) -> FrozenNorm:
    """Freeze ``module``'s normalisation at ``at`` ``[batch, hidden]`` (``None``: no norm, the identity)."""
    if module is None:
        return FrozenNorm(torch.ones_like(at, dtype=torch.float32), torch.zeros(at.shape[-1]).to(at.device), False)
    with torch.no_grad():
        bias = torch.nan_to_num(module(torch.zeros_like(at[:1]))[0].float())
        normed = module(at).float()
        shift = at.float().pow(2).mean(-1, keepdim=True).sqrt()
        moved = module((at.float() + shift).to(at.dtype)).float()
    span = (normed - bias).abs().amax().clamp_min(1e-30)
    centers = bool((moved - normed).abs().amax() <= 1e-3 * span)
    point = at.float()
    if centers:
        point = point - point.mean(-1, keepdim=True)
    scale = torch.where(point != 0, (normed - bias) / torch.where(point != 0, point, 1.0), 0.0)
    return FrozenNorm(scale, bias, centers)


@dataclass
class LogitAttribution:
    """Each component's share of the target logit, per prompt (float32).

    Attributes:
        embedding: ``[batch]``: what enters block 0 (``layers[0].layer_input``).
        attention: ``[batch, layers]``: each block's ``attention_output`` (0 where it has none).
        linear_attention: ``[batch, layers]``: a hybrid's ``linear_attention_output`` (0 where none).
        mlp: ``[batch, layers]``: each block's ``mlp_output`` (0 for a block without an MLP).
        heads: ``[batch, layers, heads]``: each head (``None`` when not asked for or the model has no
            softmax heads; 0 on layers without them, see ``head_layers``).
        head_bias: ``[batch, layers]``: the attention's part not due to one head (projection and
            post-norm biases; all of it on layers without heads); ``heads.sum(-1) + head_bias == attention``.
        bias: ``[batch]``: the final norm's bias and the head's bias.
        logit: ``[batch]``: the logit attributed (before any soft-cap).
        model_logit: ``[batch]``: the model's logit (after its post-processing).
        targets: ``[batch]``: the target token ids.
        head_layers: The layers whose heads are attributed.
        neurons: ``{layer: [batch, d_mlp]}``: each neuron's share (``None`` when not asked for); layers whose MLP
            serves no neurons (a mixture of experts) are left out.
        neuron_bias: ``{layer: [batch]}``: the MLP's part not due to one neuron (the down projection's bias and
            the post-norm's); ``neurons[l].sum(-1) + neuron_bias[l] == mlp[:, l]``.
    """

    embedding: torch.Tensor
    attention: torch.Tensor
    linear_attention: torch.Tensor
    mlp: torch.Tensor
    heads: torch.Tensor | None
    head_bias: torch.Tensor | None
    bias: torch.Tensor
    logit: torch.Tensor
    model_logit: torch.Tensor
    targets: torch.Tensor
    head_layers: list = field(default_factory=list)
    neurons: dict | None = None
    neuron_bias: dict | None = None

    def total(self) -> torch.Tensor:
        """The sum of every share, ``[batch]``: equals ``logit`` (up to float rounding)."""
        return self.embedding + self.attention.sum(-1) + self.linear_attention.sum(-1) + self.mlp.sum(-1) + self.bias

    def error(self) -> torch.Tensor:
        """``logit - total()``: float rounding, unless the contribution identity does not hold."""
        return self.logit - self.total()


def _head(model: Any, z: torch.Tensor) -> torch.Tensor:
    """The modules after the final norm (any pre-head module, a division of the head's input, then
    ``lm_head``), without logit post-processing."""
    for envoy in getattr(model, "_before_head", []):
        z = envoy._module(z)
    divisor = model.family.step_factor("divide_input", model._module.config.get_text_config())
    if divisor is not None:
        z = z / divisor
    if model.family.casts_head_input:  # as the model does: lm_head(h.to(lm_head.weight.dtype))
        z = z.to(head_dtype(model.lm_head._module, z.dtype))
    return model.lm_head._module(z)


def _unembedding(model: Any, targets: torch.Tensor, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(u [batch, hidden], c [batch])``: the head's linear map to each target logit and its constant."""
    point = torch.zeros(1, like.shape[-1], dtype=like.dtype, device=like.device, requires_grad=True)
    with torch.enable_grad():
        out = _head(model, point)[0]
        rows = {}
        for target in sorted(set(targets.tolist())):
            (gradient,) = torch.autograd.grad(out[target], point, retain_graph=True)
            rows[target] = gradient[0].float()
    directions = torch.stack([rows[t] for t in targets.tolist()])
    constant = out.detach().float()[targets.to(out.device)]
    return directions, constant


def _logit_factor(model: Any) -> float:
    """The product of the model's linear logit steps before any soft-cap."""
    config = model._module.config.get_text_config()
    factor = 1.0
    for step in model.family.logit_steps:
        value = step.factor(config)
        if value is None or step.op in ("truncate", "divide_input"):  # the input's: in `_head`
            continue
        if step.op == "multiply":
            factor *= value
        elif step.op == "divide":
            factor /= value
        elif step.op == "softcap":  # not linear: attribute the logit before it
            break
        else:
            raise ValueNotAvailable(
                f"direct logit attribution does not split a logit through a {step.op!r} step yet "
                f"({model.family.name}): its stream is rescaled before the final norm"
            )
    return factor


def _relative(model: Any, layer: int, envoy: Any) -> str:
    return envoy.path[len(model.layers[layer].path) + 1 :]


def _head_map(model: Any, layer: int) -> tuple[torch.nn.Module | None, float]:
    """How the projection's output reaches the stream: ``(post-norm module or None, scale)``."""
    attention = model.layers[layer].self_attn
    site = attention._nncanon.bindings["attention_output"].site
    projection = projection_path(model, layer)
    scale = float(site.factor(model._module.config.get_text_config()))
    if site.module in (_relative(model, layer, attention), projection):
        return None, scale
    post = model.layers[layer].get(site.module)._module
    if not _per_position(post, model.hidden_size):
        raise ValueNotAvailable(
            f"layers[{layer}]'s attention output passes through {type(post).__name__} ({site.module}), which "
            "is not a per-position norm (it mixes positions or takes more than the stream): one position's "
            "logit does not split into that position's heads. Ask direct_logit_attribution(..., heads=False)."
        )
    return post, scale


def _per_position(module: torch.nn.Module, width: int) -> bool:
    """Whether ``module`` maps each position of a ``[batch, seq, width]`` tensor on its own (a norm does)."""
    parameter = next(module.parameters(), None)
    like = dict(dtype=parameter.dtype, device=parameter.device) if parameter is not None else {}
    probe = torch.randn(1, 3, width, generator=torch.Generator().manual_seed(0)).to(**like)
    try:
        with torch.no_grad():
            whole, alone = module.forward(probe), module.forward(probe[:, 2:])
    except Exception:  # a module that needs more than the stream (a cache, positions)
        return False
    return isinstance(whole, torch.Tensor) and torch.allclose(whole[:, 2:], alone, rtol=1e-5, atol=1e-6)


def direct_logit_attribution(
    model: Any,
    prompts: str | Sequence[str],
    targets: int | Sequence[int] | torch.Tensor,
    position: int = -1,
    heads: bool = True,
    neurons: bool = False,
) -> LogitAttribution:
    """Each head's and each sublayer's share of the target logit at ``position``, from one forward.

    The method (frozen final-norm scale, exact decomposition of the logit before any soft-cap) is
    in this module's docstring.

    Args:
        model: A `StandardizedTransformer` (every layer must serve its contributions: attention's or
            a hybrid mixer's, and the MLP's where the block has one).
        prompts: One prompt or a batch (left-padded: ``-1`` is every prompt's last token).
        targets: The token id whose logit is attributed: one for all prompts, or one per prompt.
        position: The position of the logit (default: the last).
        heads: Also split each attention into its heads.
        neurons: Also split each dense MLP into its neurons (``mlp.neurons``).

    Returns:
        A `LogitAttribution`; ``total()`` equals ``logit``.

    Example:
        >>> dla = direct_logit_attribution(model, "The Eiffel Tower is in the city of", paris)
        >>> dla.heads[0].flatten().topk(3)     # the three heads that push " Paris" most
    """
    prompts = prompt_list(prompts)
    batch = len(prompts)
    target_ids = torch.as_tensor(targets).long().flatten()
    if target_ids.numel() == 1:
        target_ids = target_ids.expand(batch).clone()
    if target_ids.numel() != batch:
        raise ValueError(f"{batch} prompts but {target_ids.numel()} targets: give one, or one per prompt")
    plan = _plan(model, heads, neurons)

    saved: dict[str, Any] = {"embedding": None, "final": None, "logits": None}
    reads: dict[tuple[int, str], torch.Tensor] = {}
    with torch.no_grad(), model.trace(prompts):
        saved["embedding"] = model.layers[0].layer_input[:, position].save()
        for index, names in enumerate(plan):
            for name in names:
                reads[(index, name)] = read(model, index, name)[:, position].save()
        saved["final"] = model.layers[-1].layer_output[:, position].save()
        saved["logits"] = model.logits[:, position].save()

    with torch.no_grad():
        final = saved["final"]
        frozen = freeze_norm(None if model.norm is None else model.norm._module, final)
        directions, constant = _unembedding(model, target_ids, final)
        directions = directions.to(final.device)
        factor = _logit_factor(model)

        def share(x: torch.Tensor) -> torch.Tensor:
            linear = frozen.linear(x.to(final.device))
            u = directions.reshape(batch, *([1] * (linear.dim() - 2)), -1)
            return (linear * u).sum(-1) * factor

        nothing = torch.zeros(batch, device=final.device)

        def shares(name: str) -> torch.Tensor:
            rows = [share(reads[(i, name)]) if (i, name) in reads else nothing for i in range(model.num_layers)]
            return torch.stack(rows, dim=1)

        attention, linear_attention, mlp = (shares(name) for name in CONTRIBUTIONS)
        head_layers = sorted(i for i, name in reads if name == "attention_head_outputs")
        head_shares = head_bias = None
        if heads and head_layers:
            per_head: dict[int, torch.Tensor] = {}
            rest: dict[int, torch.Tensor] = {}
            for index in head_layers:
                stream, stream_bias = _head_streams(model, index, reads[(index, "attention_head_outputs")])
                per_head[index], rest[index] = share(stream), share(stream_bias)
            width = per_head[head_layers[0]].shape[-1]
            for index in range(model.num_layers):  # a block without softmax heads: nothing per head
                per_head.setdefault(index, torch.zeros(batch, width, device=final.device))
                rest.setdefault(index, attention[:, index])
            head_shares = torch.stack([per_head[i] for i in range(model.num_layers)], dim=1)
            head_bias = torch.stack([rest[i] for i in range(model.num_layers)], dim=1)
        neuron_shares = neuron_bias = None
        if neurons:
            neuron_shares, neuron_bias = {}, {}
            for index in sorted(i for i, name in reads if name == "neurons"):
                direction = frozen.pulled_back(directions) * factor  # d logit / d stream, [batch, hidden]
                neuron_shares[index], neuron_bias[index] = _neuron_shares(model, index, reads[(index, "neurons")],
                                                                          direction, mlp[:, index])
        bias = ((directions * frozen.bias.to(directions.device)).sum(-1) + constant.to(directions.device)) * factor
        embedding = share(saved["embedding"])
        picked = target_ids.to(final.device)[:, None]
        normed = final if model.norm is None else model.norm._module(final)
        logit = _head(model, normed).float().gather(-1, picked)[:, 0] * factor
        linear = ((directions * normed.float()).sum(-1) + constant.to(directions.device)) * factor
        if not torch.allclose(linear, logit, rtol=1e-3, atol=1e-4 * float(logit.abs().max()) + 1e-6):
            raise ValueNotAvailable(
                "the modules between the final norm and the logits are not linear (a prediction head with an "
                "activation, like ModernBERT's): a logit does not split into the stream's components"
            )
        model_logit = saved["logits"].float().gather(-1, picked.to(saved["logits"].device))[:, 0]
    return LogitAttribution(
        embedding=embedding,
        attention=attention,
        linear_attention=linear_attention,
        mlp=mlp,
        heads=head_shares,
        head_bias=head_bias,
        bias=bias,
        logit=logit,
        model_logit=model_logit,
        targets=target_ids,
        head_layers=head_layers,
        neurons=neuron_shares,
        neuron_bias=neuron_bias,
    )


def _plan(model: Any, heads: bool, neurons: bool = False) -> list[list[str]]:
    """Per layer, the values to read, in execution order: its contributions (and its heads, its neurons)."""
    report = model.support()
    plan = []
    for index in range(model.num_layers):
        names = []
        for name, component in zip(CONTRIBUTIONS, ("self_attn", "linear_attn", "mlp"), strict=True):
            if report.available(name, layer=index):
                names.append(name)
            elif report.available(component, layer=index):
                raise ValueNotAvailable(
                    f"layers[{index}] does not serve {name}, so its share of the logit is unknown: "
                    f"{report.reason(name, layer=index)}"
                )
        if not names:
            raise ValueNotAvailable(f"layers[{index}] serves no contribution to the residual stream")
        if heads and "attention_output" in names and report.available("attention_head_outputs", layer=index):
            names.append("attention_head_outputs")
        if neurons and "mlp_output" in names and report.available("neurons", layer=index):
            names.append("neurons")
        plan.append(in_execution_order(model, index, names))
    return plan


def _neuron_shares(model: Any, layer: int, neurons: torch.Tensor, direction: torch.Tensor, mlp_share: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Each neuron's share of the logit ``[batch, d_mlp]`` and the rest ``[batch]``, with ``direction`` the logit's
    gradient with respect to the stream ``[batch, hidden]``; checked against the MLP's share ``mlp_share``."""
    block = model.layers[layer]
    mlp = block.mlp
    anatomy = mlp._nncanon.anatomy
    down = block._module.get_submodule(anatomy.down)
    weight, bias = dense_weight(down).float(), getattr(down, "bias", None)
    site = mlp._nncanon.bindings["mlp_output"].site
    scale = float(site.factor(model._module.config.get_text_config()))
    rest = torch.zeros(direction.shape[0], device=direction.device)
    mlp_path = mlp.path[len(block.path) + 1:] if hasattr(mlp, "path") else None
    output = torch.einsum("bn,dn->bd", neurons.float(), weight.to(neurons.device))
    if bias is not None:
        output = output + bias.float().to(output.device)
    if site.module not in (anatomy.down, mlp_path):  # a post-norm between the down projection and the stream
        post = block._module.get_submodule(site.module)
        if not _per_position(post, output.shape[-1]):
            raise ValueNotAvailable(
                f"layers[{layer}]'s MLP output passes through {type(post).__name__} ({site.module}), which is not a "
                "per-position norm: its neurons' shares are unknown. Ask direct_logit_attribution(..., neurons=False).")
        frozen = freeze_norm(post, output.to(next(post.parameters(), output).dtype))
        rest = rest + (frozen.bias.float().to(direction.device) * direction).sum(-1) * scale
        direction = frozen.pulled_back(direction)
    direction = direction * scale
    columns = direction @ weight.to(direction.device)  # [batch, d_mlp]: each column's share per unit activation
    shares = neurons.float().to(direction.device) * columns
    if bias is not None:
        rest = rest + (direction * bias.float().to(direction.device)).sum(-1)
    total = shares.sum(-1) + rest
    if not torch.allclose(total, mlp_share, rtol=1e-3, atol=1e-4 * float(mlp_share.abs().max()) + 1e-5):
        raise ValueNotAvailable(
            f"layers[{layer}]'s neurons through {anatomy.down} do not add up to its MLP's share of the logit "
            f"({float((total - mlp_share).abs().max()):.2e} off): its MLP's output is not its down projection's "
            f"output mapped by {site.module or 'the block'} ({model.family.residual}). Ask "
            "direct_logit_attribution(..., neurons=False).")
    return shares, rest


def _head_streams(model: Any, layer: int, raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each head's contribution to the stream ``[batch, heads, hidden]`` and the rest ``[batch, hidden]``."""
    weight, proj_bias = projection_weights(model, layer)
    raw = projection_input(model, layer, raw)
    per_head = torch.einsum("bhk,hkd->bhd", raw.float(), weight.float().to(raw.device))
    proj_bias = torch.zeros(per_head.shape[-1], device=raw.device) if proj_bias is None else proj_bias.float()
    proj_bias = proj_bias.to(raw.device).expand(per_head.shape[0], -1)
    post, scale = _head_map(model, layer)
    if post is None:
        return per_head * scale, proj_bias * scale
    projected = per_head.sum(1) + proj_bias
    frozen = freeze_norm(post, projected.to(next(post.parameters(), raw).dtype))
    return frozen.linear(per_head) * scale, (frozen.linear(proj_bias) + frozen.bias) * scale
