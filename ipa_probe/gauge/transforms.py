"""The q/k gauge group of IP-Adapter attention, applied to a pipeline's weights in place and restored bit for bit.

Three reparametrisations leave every logit that enters a softmax unchanged: a **scalar** ``c`` (``q -> c q``,
``k -> k / c``: the subgroup ``A = c I``); a **per-head basis change** ``A``, the head's rows of ``to_q`` (weight and
bias) mapping ``q -> A q`` and those of every key projection the query meets (``to_k``, each ``to_k_ip``)
``k -> A^-T k``; a **per-row shift** ``b`` added to every image key through the ``to_k_ip`` bias (created for the
duration when there is none; applied after ``A``), which the image branch's own softmax removes. **Flux and SD3**
normalise q and k with RMSNorm, so only ``A = diag(D)`` on the norms' weights survives (in Flux, ``D`` equal on each
RoPE channel pair); other basis changes, and SD3's row shift, are refused. Which norms each scales, why, and what each
gauge does to the probe's statistics: docs/gauge.md, "The whole group, and what each statistic is invariant under".
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from .._checks import ROW_SHIFT_SCALE_MAX
from ..layers import IPLayer, LayerSelection, claim, find_ip_layers, release

__all__ = ["GaugeConfig", "apply_gauge", "max_condition_number", "max_shift_scale", "plan_gauge"]

_FEATURE = "gauge"

#: A basis change must keep ``cond(A) * eps(dtype)`` below this: beyond it the rounding of ``A W`` and ``A^-T W``
#: is no longer small against the logits (float32: cond <= 5.2e5; float16: 64; bfloat16: 8).
_COND_EPS_LIMIT = 1 / 16


def max_condition_number(dtype: torch.dtype) -> float:
    """The largest ``cond(A)`` :func:`qk_gauge` accepts for weights of ``dtype``: ``1 / (16 eps)``."""
    return _COND_EPS_LIMIT / torch.finfo(dtype).eps


def _check_tensor_map(value: Any, name: str, ndim: int, what: str) -> dict[str, torch.Tensor] | None:
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise TypeError(f"{name}: expected a mapping from layer id to a tensor of shape {what}, got {value!r}")
    checked = {}
    for layer, tensor in value.items():
        if not isinstance(layer, str):
            raise TypeError(f"{name}: expected layer ids (str) as keys, got {layer!r}")
        if not isinstance(tensor, torch.Tensor) or tensor.ndim != ndim or not tensor.is_floating_point():
            raise TypeError(f"{name}[{layer!r}]: expected a float tensor of shape {what}, got {tensor!r}")
        if ndim == 3 and tensor.shape[-1] != tensor.shape[-2]:
            raise ValueError(f"{name}[{layer!r}]: expected square d x d matrices {what}, got {tuple(tensor.shape)}")
        if not torch.isfinite(tensor).all():
            raise ValueError(f"{name}[{layer!r}]: expected finite values, got non-finite entries")
        checked[layer] = tensor.detach().to("cpu", torch.float64)
    return checked


@dataclass(frozen=True)
class GaugeConfig:
    """One element of the q/k gauge group: a scalar, per-head matrices and per-head row shifts, composed.

    Attributes:
        factor: the scalar ``c > 0`` (``q -> c q``, ``k -> k / c``); composes with ``matrices`` as ``c A``.
        matrices: layer id -> ``(heads, d, d)`` invertible matrices ``A``: ``q -> A q``, ``k -> A^-T k`` per head.
            Layers not named keep ``A = I``. On Flux / SD3 layers each ``A`` must be diagonal and the same in every
            head (see the module docstring).
        shifts: layer id -> ``(heads, d)`` vectors ``b`` added to every image key of the head (``to_k_ip`` bias).
        label: how tables name this gauge (default: made from the fields).

    Example:
        ```py
        >>> A = {"down_blocks.0.attentions.0.transformer_blocks.0.attn2": torch.eye(8).repeat(2, 1, 1) * 2}
        >>> with ipa_probe.qk_gauge(pipe, ipa_probe.gauge.GaugeConfig(matrices=A)):
        ...     ...
        ```
    """

    factor: float = 1.0
    matrices: Mapping[str, torch.Tensor] | None = field(default=None, compare=False)
    shifts: Mapping[str, torch.Tensor] | None = field(default=None, compare=False)
    label: str = ""

    def __post_init__(self) -> None:
        factor = self.factor
        if isinstance(factor, bool) or not isinstance(factor, int | float) or not math.isfinite(factor) or factor <= 0:
            raise ValueError(f"factor: expected a finite number > 0 (e.g. 2.0), got {factor!r}")
        object.__setattr__(self, "factor", float(factor))
        object.__setattr__(self, "matrices", _check_tensor_map(self.matrices, "matrices", 3, "(heads, d, d)"))
        object.__setattr__(self, "shifts", _check_tensor_map(self.shifts, "shifts", 2, "(heads, d)"))
        if not isinstance(self.label, str):
            raise TypeError(f"label: expected a str, got {self.label!r}")
        for layer, matrices in (self.matrices or {}).items():
            cond = torch.linalg.cond(matrices)
            if not torch.isfinite(cond).all():
                raise ValueError(f"matrices[{layer!r}]: expected invertible matrices, got a singular one")

    @property
    def largest_cond(self) -> float:
        """The largest ``cond(A)`` (2-norm) over layers and heads; 1 for a scalar gauge."""
        conds = [float(torch.linalg.cond(m).max()) for m in (self.matrices or {}).values()]
        return max([1.0, *conds])

    def describe(self) -> str:
        """A one-line description: the label, else the parts that are not the identity."""
        if self.label:
            return self.label
        parts = [f"c = {self.factor:g}"] if self.factor != 1.0 or not (self.matrices or self.shifts) else []
        if self.matrices:
            parts.append(f"per-head A in {len(self.matrices)} layer(s), cond <= {self.largest_cond:.3g}")
        if self.shifts:
            parts.append(f"row shift in {len(self.shifts)} layer(s)")
        return ", ".join(parts)


# --------------------------------------------------------------------------- which parameters, and how


@dataclass
class _Change:
    """One parameter's new value (or a bias to create), computed in float64 before anything is written."""

    module: torch.nn.Module
    name: str  # "weight" or "bias"
    new: torch.Tensor  # float64, the parameter's shape
    created: bool = False  # a bias the module did not have


def _rows(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """``(out, ...)`` -> ``(heads, d, ...)``: the head's rows of a projection."""
    return weight.reshape(heads, weight.shape[0] // heads, *weight.shape[1:])


def _check_linear(layer: IPLayer, module: torch.nn.Module) -> None:
    if type(module) is not torch.nn.Linear:
        raise ValueError(
            f"layer {layer.name!r}: expected plain torch.nn.Linear q/k projections, got {type(module).__name__} "
            "(a LoRA or quantised wrapper transforms differently); fuse or unload the adapter weights first"
        )
    if any(p.is_meta for p in module.parameters()):
        raise ValueError(
            f"layer {layer.name!r}: its q/k weights are not materialised (meta tensors from sequential CPU offload); "
            "use enable_model_cpu_offload() or keep the pipeline on one device"
        )


def _check_layer(layer: IPLayer) -> None:
    """Refuse a layer where no gauge is a symmetry, before anything changes."""
    # a query-frame NW head depends on q·k alone (its key term is taken from those logits): every gauge is one of its
    # symmetries too; a stored-frame head reads |k|^2, which a gauge changes
    stored_head = getattr(layer.processor, "frame", "query") != "query"
    if getattr(layer.processor, "image_branch_logits", None) is not None and stored_head:
        raise ValueError(
            f"layer {layer.name!r} runs {type(layer.processor).__name__} with frame='stored', whose NW key term |k|^2 "
            "the gauge changes; leave the head first, or swap in nw_head(pipe, frame='query')"
        )
    attn = layer.attention
    if getattr(attn, "fused_projections", False):
        raise ValueError(
            f"layer {layer.name!r} has fused q/k/v projections; call pipe.unfuse_qkv_projections() before the gauge"
        )
    if layer.family == "unet":
        for module in [attn.to_q, attn.to_k, *layer.processor.to_k_ip]:
            _check_linear(layer, module)
    else:
        for name, norm in _dit_norms(layer):
            if getattr(norm, "weight", None) is None:
                raise ValueError(
                    f"layer {layer.name!r}: its {name} has no per-channel weight, so the only symmetry that survives "
                    "RMSNorm there (a scaling of that weight against the keys') cannot be written into it"
                )
        if layer.family == "flux":
            for module in layer.processor.to_k_ip:
                _check_linear(layer, module)


def _dit_norms(layer: IPLayer) -> list[tuple[str, torch.nn.Module]]:
    """The RMSNorms whose weights carry the per-channel gauge of a Flux / SD3 layer, queries first."""
    if layer.family == "sd3":
        p = layer.processor
        return [("norm_q", p.norm_q), ("norm_k", p.norm_k), ("norm_ip_k", p.norm_ip_k)]
    attn = layer.attention
    names = ("norm_q", "norm_added_q", "norm_k", "norm_added_k")
    return [(name, getattr(attn, name)) for name in names if getattr(attn, name, None) is not None]


def _unet_changes(layer: IPLayer, a: torch.Tensor, shift: torch.Tensor | None) -> list[_Change]:
    """``a``: ``(heads, d, d)`` float64 (the scalar folded in)."""
    attn, heads = layer.attention, layer.heads
    inverse_t = torch.linalg.inv(a).transpose(-1, -2)  # A^-T per head
    changes = []
    for module, m in [(attn.to_q, a), (attn.to_k, inverse_t), *((k, inverse_t) for k in layer.processor.to_k_ip)]:
        for name in ("weight", "bias"):
            value = getattr(module, name)
            if value is None:
                continue
            rows = _rows(value.detach().to(torch.float64).cpu(), heads)  # (H, d, in) or (H, d)
            new = m @ rows if rows.ndim == 3 else (m @ rows.unsqueeze(-1)).squeeze(-1)
            changes.append(_Change(module, name, new.reshape(value.shape)))
    if shift is not None:
        changes += _shift_changes(layer, shift, changes)
    return changes


def _shift_changes(layer: IPLayer, shift: torch.Tensor, changes: list[_Change]) -> list[_Change]:
    """Add ``shift`` (heads, d) to every ``to_k_ip`` bias (after the basis change in ``changes``)."""
    flat = shift.reshape(-1)  # (H*d,)
    out = []
    for module in layer.processor.to_k_ip:
        done = next((c for c in changes if c.module is module and c.name == "bias"), None)
        if done is not None:
            done.new = done.new + flat
        elif module.bias is not None:
            out.append(_Change(module, "bias", module.bias.detach().to(torch.float64).cpu() + flat))
        else:
            out.append(_Change(module, "bias", flat.clone(), created=True))
    return out


def _dit_changes(layer: IPLayer, a: torch.Tensor, shift: torch.Tensor | None) -> list[_Change]:
    """Flux / SD3: ``a`` must be one diagonal ``D`` shared by all heads."""
    diagonal = torch.diagonal(a, dim1=-2, dim2=-1)  # (H, d)
    if not torch.equal(torch.diag_embed(diagonal), a) or not torch.equal(diagonal, diagonal[:1].expand_as(diagonal)):
        raise ValueError(
            f"layer {layer.name!r} is a {layer.family} layer: RMSNorm normalises q and k before the dot product, so "
            "only a per-channel scaling shared by all heads survives (A = diag(D), the same in every head); "
            "orthogonal or general basis changes are missing there (the norm's per-channel weight does not commute "
            "with them), so pass diagonal matrices equal across heads or a scalar"
        )
    scale = diagonal[0]  # (d,)
    if layer.family == "flux" and not torch.equal(scale[0::2], scale[1::2]):
        raise ValueError(
            f"layer {layer.name!r} is a flux layer: RoPE rotates channel pairs (2i, 2i+1) by a position-dependent "
            "angle, which commutes with a per-channel scaling only if both channels of a pair get the same factor; "
            "pass D with D[2i] == D[2i+1]"
        )
    if torch.any(scale <= 0):
        raise ValueError(
            f"layer {layer.name!r}: a {layer.family} gauge D scales RMSNorm weights; expected D > 0 (a sign flip "
            "would also flip the norm's output), got negative entries"
        )
    if shift is not None and layer.family == "sd3":
        raise ValueError(
            f"layer {layer.name!r} is an SD3 layer: its image keys pass through norm_ip_k and share one softmax with "
            "the latent keys, so a per-row shift of the image logits is no symmetry there; drop shifts for SD3"
        )
    changes = []
    for name, norm in _dit_norms(layer):
        factor = scale if name in ("norm_q", "norm_added_q") else 1 / scale
        changes.append(_Change(norm, "weight", norm.weight.detach().to(torch.float64).cpu() * factor))
    if layer.family == "flux":
        heads = layer.heads
        for module in layer.processor.to_k_ip:
            for name in ("weight", "bias"):
                value = getattr(module, name)
                if value is None:
                    continue
                rows = _rows(value.detach().to(torch.float64).cpu(), heads)  # (H, d, in) or (H, d)
                inv = (1 / scale).reshape(1, -1, *([1] * (rows.ndim - 2)))
                changes.append(_Change(module, name, (rows * inv).reshape(value.shape)))
        if shift is not None:
            changes += _shift_changes(layer, shift, changes)
    return changes


def _check_range(layer: IPLayer, change: _Change, dtype: torch.dtype) -> None:
    """Refuse a new value that the weights' dtype cannot hold without losing the output: non-finite, above
    ``sqrt(max)`` (then ``q`` or ``k`` overflow for inputs of modest size), or a nonzero entry rounding to zero."""
    info = torch.finfo(dtype)
    new = change.new
    where = f"layer {layer.name!r}, {type(change.module).__name__}.{change.name}"
    if not torch.isfinite(new).all() or float(new.abs().max()) > math.sqrt(info.max):
        raise ValueError(
            f"gauge: it would scale {where} beyond the range of {dtype} (|w| up to {float(new.abs().max()):.3g}, "
            f"limit sqrt(max) = {math.sqrt(info.max):.3g}); use a factor or matrices closer to 1 / the identity"
        )
    if not change.created:
        old = getattr(change.module, change.name).detach().cpu()
        lost = (old != 0) & (new.to(dtype) == 0)
        if bool(lost.any()):
            raise ValueError(
                f"gauge: it would round nonzero weights of {where} to zero in {dtype} (the outputs would change or "
                "turn NaN); use a factor or matrices closer to 1 / the identity"
            )


def _plan(layer: IPLayer, config: GaugeConfig) -> list[_Change]:
    """The changes ``config`` makes to one layer, checked against the weights' dtype."""
    d = head_dim(layer)
    a = (config.matrices or {}).get(layer.name)
    if a is None:
        a = torch.eye(d, dtype=torch.float64).expand(layer.heads, d, d)
    elif a.shape != (layer.heads, d, d):
        raise ValueError(f"matrices[{layer.name!r}]: expected shape {(layer.heads, d, d)}, got {tuple(a.shape)}")
    shift = (config.shifts or {}).get(layer.name)
    if shift is not None and shift.shape != (layer.heads, d):
        raise ValueError(f"shifts[{layer.name!r}]: expected shape {(layer.heads, d)}, got {tuple(shift.shape)}")
    a = a * config.factor
    changes = (_unet_changes if layer.family == "unet" else _dit_changes)(layer, a, shift)
    dtype = next(c for c in changes if not c.created).module.weight.dtype
    limit = max_condition_number(dtype)
    cond = float(torch.linalg.cond(a).max())
    if not cond <= limit:
        raise ValueError(
            f"matrices[{layer.name!r}]: cond(A) = {cond:.3g} exceeds {limit:.3g}, the largest that {dtype} weights "
            "keep to rounding (1 / (16 eps)); use better-conditioned matrices"
        )
    if shift is not None:
        scale_limit = max_shift_scale(dtype)
        scale = float(shift.to(torch.float64).pow(2).mean().sqrt())  # the RMS entry: the scale of N(0, scale^2) draws
        # a draw's RMS over a layer's H * d entries (64 and more) is within 25% of its scale but for ~0.3% of draws
        if not scale <= 1.25 * scale_limit:
            raise ValueError(
                f"shifts[{layer.name!r}]: a row shift of RMS entry {scale:.3g} is beyond {scale_limit:.3g} (x 1.25), "
                f"where {dtype} still keeps the outputs and the query-frame statistics within tolerance "
                "(docs/gauge.md, 'How far a row shift holds'); use a smaller shift"
            )
    for change in changes:
        target = change.module.weight if change.created else getattr(change.module, change.name)
        _check_range(layer, change, target.dtype)
    return changes


def max_shift_scale(dtype: torch.dtype) -> float:
    """The largest row-shift scale (RMS entry of ``b``) for weights of ``dtype``: the measured float32 bound
    (:data:`ipa_probe._checks.ROW_SHIFT_SCALE_MAX`) scaled by the dtype's precision (the rounding error of a logit
    moved by ``q.b`` is about ``eps |q.b|``)."""
    return ROW_SHIFT_SCALE_MAX * torch.finfo(torch.float32).eps / torch.finfo(dtype).eps


def head_dim(layer: IPLayer) -> int:
    """The per-head size ``d`` of a layer's image-branch queries and keys."""
    if layer.family == "unet":
        return layer.attention.to_q.out_features // layer.heads
    norm = _dit_norms(layer)[0][1]
    return int(norm.weight.shape[0])


# --------------------------------------------------------------------------- apply, restore


def plan_gauge(pipe, config: GaugeConfig, layers: LayerSelection = None) -> tuple[list[IPLayer], list[_Change]]:
    """The selected layers and every change ``config`` would make, computed and checked, nothing written.

    Raises:
        TypeError, ValueError: as :func:`apply_gauge`, before anything changes.
    """
    if not isinstance(config, GaugeConfig):
        raise TypeError(f"config: expected a GaugeConfig, got {config!r}")
    found = find_ip_layers(pipe, layers)
    names = {layer.name for layer in found}
    for key in ("matrices", "shifts"):
        unknown = sorted(set(getattr(config, key) or {}) - names)
        if unknown:
            raise ValueError(
                f"{key}: layer ids {unknown} are not among the selected IP-Adapter layers {sorted(names)}"
            )
    changes: list[_Change] = []
    seen: dict[int, _Change] = {}
    for layer in found:
        _check_layer(layer)
        for change in _plan(layer, config):
            key = id(getattr(change.module, change.name)) if not change.created else id(change.module)
            if key in seen and not torch.equal(seen[key].new, change.new):
                raise ValueError(
                    f"layer {layer.name!r}: one parameter is both a query and a key projection (or shared by layers "
                    "with different gauges); the gauge cannot transform it both ways"
                )
            if key not in seen:
                seen[key] = change
                changes.append(change)
    return found, changes


@contextlib.contextmanager
def apply_gauge(pipe, config: GaugeConfig, layers: LayerSelection = None) -> Iterator[list[IPLayer]]:
    """Apply one :class:`GaugeConfig` to the selected IP-Adapter layers; restore them bit for bit on exit.

    Every new value is computed (in float64) and checked before the first write: a layer where the gauge is no
    symmetry, a matrix for a layer that is not selected, a condition number or scale the weights' dtype cannot hold
    raise ``ValueError`` with the pipeline untouched. On exit, also after an exception or Ctrl-C, each parameter
    gets back its original values (copied from clones taken on entry) and a bias created for a row shift is removed
    again, so dtypes, devices, the set of parameters and every bit are as they were.
    """
    found, changes = plan_gauge(pipe, config, layers)  # refuses a layer that runs a stored-frame NW head
    claim(pipe, _FEATURE, [layer.name for layer in found], f"q/k gauge: {config.describe()}")
    originals = [
        (c.module, c.name, None if c.created else getattr(c.module, c.name).detach().clone()) for c in changes
    ]
    try:
        with torch.no_grad():
            for change in changes:
                if change.created:
                    weight = change.module.weight
                    bias = torch.nn.Parameter(change.new.to(weight.dtype).to(weight.device), weight.requires_grad)
                    change.module.bias = bias
                else:
                    parameter = getattr(change.module, change.name)
                    parameter.copy_(change.new.to(parameter.dtype))
        yield found
    finally:
        with torch.no_grad():
            for module, name, original in originals:
                if original is None:
                    module.bias = None  # the Linear had registered bias = None: the same state again
                else:
                    getattr(module, name).copy_(original)
        release(pipe, _FEATURE)
