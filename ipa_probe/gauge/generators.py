"""Named elements of the gauge group: random basis changes, row shifts, and an adversarial search.

:class:`RandomGauge` ``(seed, spread)``: per layer and head ``A = Q diag(exp z)``, ``Q`` Haar-orthogonal,
``z ~ N(0, spread^2)`` (on Flux / SD3 only ``diag(exp z)`` shared by the heads). :class:`RowShift` ``(seed, scale)``:
a vector ``b ~ N(0, scale^2 I)`` added to every image key. :class:`AdversarialGauge` ``(direction, max_cond, ...)``:
``A = U diag(exp s) V^T`` with ``det A = 1`` and ``cond(A) <= max_cond`` by construction, optimised with torch
autograd (Adam) on a differentiable surrogate of the stored-frame rho from queries and keys captured in one call; the
real statistic is then measured by the probe (:func:`gauge_sweep`). Their conditioning and the surrogate in full:
docs/gauge.md ("Named generators").
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from .._checks import parse_gauges
from ..layers import IPLayer, LayerSelection, find_ip_layers
from .transforms import GaugeConfig, _check_layer, apply_gauge, head_dim

__all__ = ["AdversarialGauge", "RandomGauge", "RowShift", "adversarial_gauge", "qk_gauge", "resolve_gauge"]

_SEED_MAX = 2**63 - 1


def _check_seed(seed: Any) -> int:
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= _SEED_MAX:
        raise ValueError(f"seed: expected an int in [0, 2**63 - 1], got {seed!r}")
    return seed


def _check_positive(value: Any, name: str, high: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= high:
        raise ValueError(f"{name}: expected a number in (0, {high:g}], got {value!r}")
    return float(value)


@dataclass(frozen=True)
class RandomGauge:
    """A random per-head basis change ``A = Q diag(exp z)``, ``z ~ N(0, spread^2)`` (module docstring).

    Attributes:
        seed: the draw's seed (0 to 2**63 - 1).
        spread: the standard deviation of ``log`` of the singular values, in (0, 4].
    """

    seed: int = 0
    spread: float = 1.0

    def __post_init__(self) -> None:
        _check_seed(self.seed)
        object.__setattr__(self, "spread", _check_positive(self.spread, "spread", 4.0))

    def resolve(self, layers: list[IPLayer]) -> GaugeConfig:
        generator = torch.Generator().manual_seed(self.seed)
        matrices = {}
        for layer in layers:
            heads, d = layer.heads, head_dim(layer)
            if layer.family == "unet":
                gaussian = torch.randn(heads, d, d, generator=generator, dtype=torch.float64)
                q, r = torch.linalg.qr(gaussian)
                q = q * torch.sign(torch.diagonal(r, dim1=-2, dim2=-1)).unsqueeze(-2)  # Haar: fix the column signs
                z = torch.randn(heads, d, generator=generator, dtype=torch.float64) * self.spread
                matrices[layer.name] = q * torch.exp(z).unsqueeze(-2)  # Q diag(exp z): (H, d, d)
            elif layer.family == "flux":  # one factor per RoPE channel pair (2i, 2i+1)
                z = torch.randn(d // 2, generator=generator, dtype=torch.float64).repeat_interleave(2) * self.spread
                matrices[layer.name] = torch.diag(torch.exp(z)).expand(heads, d, d).clone()
            else:
                z = torch.randn(d, generator=generator, dtype=torch.float64) * self.spread
                matrices[layer.name] = torch.diag(torch.exp(z)).expand(heads, d, d).clone()
        config = GaugeConfig(matrices=matrices)
        return GaugeConfig(
            matrices=matrices, label=f"random:{self.seed}:{self.spread:g} (cond <= {config.largest_cond:.3g})"
        )


@dataclass(frozen=True)
class RowShift:
    """A per-row shift of the image logits: ``b ~ N(0, scale^2 I)`` per layer and head added to every image key.

    Attributes:
        seed: the draw's seed (0 to 2**63 - 1).
        scale: the standard deviation of each entry of ``b``, in key units, in (0, 1000].
    """

    seed: int = 0
    scale: float = 1.0

    def __post_init__(self) -> None:
        _check_seed(self.seed)
        object.__setattr__(self, "scale", _check_positive(self.scale, "scale", 1000.0))

    def resolve(self, layers: list[IPLayer]) -> GaugeConfig:
        generator = torch.Generator().manual_seed(self.seed)
        shifts = {}
        for layer in layers:
            draw = torch.randn(layer.heads, head_dim(layer), generator=generator, dtype=torch.float64)
            shifts[layer.name] = draw * self.scale
        return GaugeConfig(shifts=shifts, label=f"shift:{self.seed}:{self.scale:g}")


_STATISTICS = ("spearman",)


@dataclass(frozen=True)
class AdversarialGauge:
    """A bounded-condition per-head basis change that pushes a statistic up or down (module docstring).

    Attributes:
        direction: ``"up"`` or ``"down"``.
        max_cond: the bound on every ``cond(A)``, in (1, 10000].
        statistic: ``"spearman"`` (the stored-frame rho; its surrogate is the per-row Pearson correlation of the
            attention and NW logits) or a function ``(q, k) -> scalar tensor`` of the transformed queries ``(N, H, d)``
            and image keys ``(N, H, K, d)`` (float64, differentiable) to maximise (``up``) or minimise.
        iterations: Adam steps, 1 to 10000.
        rows: query rows sampled per layer from the captured call, 1 to 100000.
        seed: the seed of the row sample and of the initial rotations.
    """

    direction: str = "down"
    max_cond: float = 10.0
    statistic: str | Callable = "spearman"
    iterations: int = 150
    rows: int = 512
    seed: int = 0

    def __post_init__(self) -> None:
        if self.direction not in ("up", "down"):
            raise ValueError(f"direction: expected 'up' or 'down', got {self.direction!r}")
        m = self.max_cond
        if isinstance(m, bool) or not isinstance(m, int | float) or not 1 < m <= 1e4:
            raise ValueError(f"max_cond: expected a number in (1, 10000], got {m!r}")
        if not callable(self.statistic) and self.statistic not in _STATISTICS:
            raise ValueError(
                f"statistic: expected one of {_STATISTICS} or a function (q, k) -> tensor, got {self.statistic!r}"
            )
        for name, high in (("iterations", 10_000), ("rows", 100_000)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= high:
                raise ValueError(f"{name}: expected an int in [1, {high}], got {value!r}")
        _check_seed(self.seed)

    def describe(self) -> str:
        name = self.statistic if isinstance(self.statistic, str) else getattr(self.statistic, "__name__", "custom")
        return f"adversarial:{self.direction}:{self.max_cond:g} ({name})"


def _surrogate_spearman(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Mean per-row Pearson correlation of ``q·k_i`` with ``q·k_i - |k_i|^2 / 2``.

    ``q``: (N, H, d) queries; ``k``: (N, H, K, d) the image keys each row meets."""
    logits = torch.einsum("nhd,nhkd->nhk", q, k)  # (N, H, K)
    nw = logits - 0.5 * (k * k).sum(-1)
    x = logits - logits.mean(-1, keepdim=True)
    y = nw - nw.mean(-1, keepdim=True)
    return ((x * y).sum(-1) / ((x * x).sum(-1) * (y * y).sum(-1)).clamp_min(1e-30).sqrt()).mean()


def _capture(pipe, call: Callable[[], Any], layers: list[IPLayer], rows: int, seed: int) -> dict[str, tuple]:
    """Queries and image keys of each layer from one call: per layer ``(q (N, H, d), k (N, H, K, d))``, float64,
    ``N <= rows`` query rows sampled without replacement over steps, items and positions (seeded). Read at the hook
    points ``<layer>.ip.q`` / ``.ip.k`` (:mod:`ipa_probe.intervention.points`): what the layer's softmax used."""
    from ..intervention.cache import cache_hook_points
    from ..intervention.points import point_name

    names = [point_name(layer.name, point) for layer in layers for point in ("q", "k")]
    with torch.no_grad(), cache_hook_points(pipe, names) as cache:
        call()
    store: dict[str, list[dict]] = {}
    for layer in layers:
        q_name, k_name = point_name(layer.name, "q"), point_name(layer.name, "k")
        store[layer.name] = [{"q": q, "k": k} for q, k in zip(cache[q_name], cache[k_name], strict=True)]
    generator = torch.Generator().manual_seed(seed)
    captured = {}
    for layer in layers:
        heads, d = layer.heads, head_dim(layer)
        qs, ks = [], []
        for record in store[layer.name]:
            q = record["q"].to("cpu", torch.float64).transpose(1, 2)  # (B, H, Q, d) -> (B, Q, H, d)
            k = record["k"].to("cpu", torch.float64)  # (B, H, K, d)
            qs.append(q.reshape(-1, heads, d))  # (B*Q, H, d)
            ks.append(k.repeat_interleave(q.shape[1], dim=0))  # (B*Q, H, K, d)
        if not qs:
            raise ValueError(f"call: the image branch of layer {layer.name!r} never ran; pass ip_adapter_image")
        keys_k = {tensor.shape[2] for tensor in ks}
        if len(keys_k) != 1:
            raise ValueError(f"layer {layer.name!r}: passes with different numbers of image keys {sorted(keys_k)}")
        q, k = torch.cat(qs), torch.cat(ks)
        pick = torch.randperm(q.shape[0], generator=generator)[:rows]
        captured[layer.name] = (q[pick], k[pick])
    return captured


def adversarial_gauge(
    pipe, call: Callable[[], Any], spec: AdversarialGauge | None = None, layers: LayerSelection = None
) -> GaugeConfig:
    """Search a bounded-condition per-head basis change that pushes ``spec.statistic`` up or down.

    ``pipe``: SD 1.5 / SDXL (Flux / SD3 have no basis change to search); ``call``: a function of no arguments that
    runs ``pipe`` once (seeded), its queries and keys captured; ``spec`` defaults to ``AdversarialGauge()`` (push
    the stored-frame rho down, cond <= 10). Returns a :class:`GaugeConfig` whose label says the direction and bound.
    """
    spec = AdversarialGauge() if spec is None else spec
    if not isinstance(spec, AdversarialGauge):
        raise TypeError(f"spec: expected an AdversarialGauge, got {spec!r}")
    if not callable(call):
        raise TypeError(f"call: expected a function of no arguments that runs the pipeline once, got {call!r}")
    found = find_ip_layers(pipe, layers)
    for layer in found:
        _check_layer(layer)
        if layer.family != "unet":
            raise ValueError(
                f"layer {layer.name!r} is a {layer.family} layer: the adversarial search changes bases, and only a "
                "per-channel scaling survives RMSNorm there; use RandomGauge or GaugeConfig with diagonal matrices"
            )
    captured = _capture(pipe, call, found, spec.rows, spec.seed)
    objective = _surrogate_spearman if spec.statistic == "spearman" else spec.statistic
    sign = 1.0 if spec.direction == "down" else -1.0  # minimise sign * statistic
    half_log = math.log(spec.max_cond) / 2
    generator = torch.Generator().manual_seed(spec.seed)
    params = {}
    for layer in found:
        heads, d = layer.heads, head_dim(layer)
        x = (0.1 * torch.randn(heads, d, d, generator=generator, dtype=torch.float64)).requires_grad_()
        y = (0.1 * torch.randn(heads, d, d, generator=generator, dtype=torch.float64)).requires_grad_()
        u = torch.zeros(heads, d, dtype=torch.float64, requires_grad=True)
        params[layer.name] = (x, y, u)

    def matrices(x, y, u):
        rot_u = torch.linalg.matrix_exp(x - x.transpose(-1, -2))  # (H, d, d) orthogonal
        rot_v = torch.linalg.matrix_exp(y - y.transpose(-1, -2))
        s = half_log * torch.tanh(u)
        s = s - s.mean(-1, keepdim=True)  # det A = 1; max s - min s <= log(max_cond) still
        a = rot_u * torch.exp(s).unsqueeze(-2) @ rot_v.transpose(-1, -2)  # U diag(e^s) V^T
        a_inv_t = rot_u * torch.exp(-s).unsqueeze(-2) @ rot_v.transpose(-1, -2)  # A^-T = U diag(e^-s) V^T
        return a, a_inv_t

    optimiser = torch.optim.Adam([p for group in params.values() for p in group], lr=0.05)
    with torch.enable_grad():
        for _ in range(spec.iterations):
            optimiser.zero_grad()
            loss = 0.0
            for name, (q, k) in captured.items():
                a, a_inv_t = matrices(*params[name])
                q_new = torch.einsum("hij,nhj->nhi", a, q)  # (N, H, d)
                k_new = torch.einsum("hij,nhkj->nhki", a_inv_t, k)  # (N, H, K, d)
                loss = loss + sign * objective(q_new, k_new)
            (loss / len(captured)).backward()
            optimiser.step()
    with torch.no_grad():
        found_matrices = {name: matrices(*group)[0].detach().clone() for name, group in params.items()}
    return GaugeConfig(matrices=found_matrices, label=spec.describe())


def resolve_gauge(
    pipe, gauge: Any, layers: LayerSelection = None, *, key: str = "gauge", call: Callable | None = None
) -> GaugeConfig:
    """Turn any accepted gauge spec into a :class:`GaugeConfig` for this pipeline.

    Accepted: a number (scalar), a :class:`GaugeConfig`, :class:`RandomGauge`, :class:`RowShift`,
    :class:`AdversarialGauge` (needs ``call``) or a string ``"C"``, ``"random:SEED:SPREAD"``,
    ``"shift:SEED:SCALE"``, ``"adversarial:up|down:MAXCOND"`` (:func:`ipa_probe._checks.parse_gauges`).
    """
    if isinstance(gauge, str):
        (gauge,) = parse_gauges(gauge, key, bounded=False)
        if isinstance(gauge, str):
            kind, first, second = gauge.split(":")
            if kind == "random":
                gauge = RandomGauge(int(first), float(second))
            elif kind == "shift":
                gauge = RowShift(int(first), float(second))
            else:
                gauge = AdversarialGauge(direction=first, max_cond=float(second))
    if isinstance(gauge, GaugeConfig):
        return gauge
    if isinstance(gauge, RandomGauge | RowShift):
        return gauge.resolve(find_ip_layers(pipe, layers))
    if isinstance(gauge, AdversarialGauge):
        if call is None:
            raise ValueError(
                f"{key}: an adversarial gauge needs a pipeline call to search on; make it with "
                "ipa_probe.gauge.adversarial_gauge(pipe, call, spec) or pass it to gauge_sweep"
            )
        return adversarial_gauge(pipe, call, gauge, layers)
    if isinstance(gauge, bool) or not isinstance(gauge, int | float):
        raise TypeError(
            f"{key}: expected a number c > 0, a GaugeConfig, RandomGauge, RowShift, AdversarialGauge or a string "
            f"like 'random:0:1', got {gauge!r}"
        )
    try:
        return GaugeConfig(factor=gauge)
    except ValueError as err:
        raise ValueError(f"{key}: {str(err).split(': ', 1)[-1]}") from None


@contextlib.contextmanager
def qk_gauge(pipe, gauge: Any, layers: LayerSelection = None) -> Iterator[list[IPLayer]]:
    """Reparametrise the IP-Adapter layers in place by one element of the q/k gauge group, and restore them on exit.

    Args:
        pipe: a pipeline (or its denoiser) with an IP-Adapter loaded: SD 1.5 / SDXL (the whole group), Flux or SD3
            (the per-channel subgroup that survives RMSNorm; see the module docstring).
        gauge: a number ``c > 0`` (the scalar gauge: ``to_q`` x c, ``to_k`` and every ``to_k_ip`` / c; bit-exact
            for powers of two), a :class:`GaugeConfig` (per-head matrices and row shifts), a
            :class:`~ipa_probe.gauge.RandomGauge` or :class:`~ipa_probe.gauge.RowShift` (drawn from their seed for
            this pipeline), or a string ``"random:SEED:SPREAD"`` / ``"shift:SEED:SCALE"``. An adversarial gauge
            needs a pipeline call: make it with :func:`~ipa_probe.gauge.adversarial_gauge` first.
        layers: regex or list of them selecting layer ids; ``None`` for every IP-Adapter layer.

    Yields:
        the reparametrised layers.

    Raises:
        ValueError: a bad gauge; one outside the range the weights' dtype keeps finite and exact to rounding (a
            factor like 1e-300, ``cond(A) > 1 / (16 eps)``); a layer where it is no symmetry (an NW head, LoRA-wrapped
            or fused projections, a basis change on Flux / SD3), all before anything changes.
        RuntimeError: a gauge is already applied to this pipeline.

    Example:
        ```py
        >>> with ipa_probe.qk_gauge(pipe, 2.0):
        ...     image = pipe("a photo", ip_adapter_image=[refs], num_inference_steps=4).images[0]  # the same image
        >>> with ipa_probe.qk_gauge(pipe, "random:0:1"):  # per-head orthogonal x diag(exp N(0, 1))
        ...     image = pipe("a photo", ip_adapter_image=[refs], num_inference_steps=4).images[0]  # equal to rounding
        ```
    """
    config = resolve_gauge(pipe, gauge, layers, key="gauge")
    with apply_gauge(pipe, config, layers) as found:
        yield found
