"""The q/k gauge: reparametrise every IP-Adapter layer without changing an output, and see which numbers move.

Dot-product attention sees its queries and keys only through ``q·k``. Scaling the query projection by ``c`` and every
key projection the query meets by ``1 / c``,

    W_q, b_q -> c W_q, c b_q;    W_k, b_k -> W_k / c, b_k / c;    W_k_ip[i] (, b_k_ip[i]) -> W_k_ip[i] / c,

leaves every logit, every attention weight and every output of the pipeline unchanged (the text branch's ``to_k``
too, so that the text attention is also untouched). Gaussian NW weights from the same ``q, k`` are not invariant:
their logits are ``q·k - |k|^2 / 2`` up to the bandwidth, and ``|k|^2`` scales by ``1 / c^2``. So the per-row Spearman
rho between attention and NW moves with ``c`` through the ratio ``r = sd(q·k) / sd(|k|^2 / 2)``, which becomes
``c^2 r``, while every quantity made from the attention weights alone (attention ``n_eff``, the attention mass per
reference image) stays where it is. :func:`gauge_sweep` measures exactly that; :func:`qk_gauge` is the
reparametrisation itself, for any other check.

For ``c`` a power of two both scalings are exact in floating point (they only change the exponent, barring overflow
and subnormals), so every logit and every output is bit-identical; other factors agree to rounding.

Only the UNet family (SD 1.5 / SDXL) is supported: Flux and SD3 normalise queries and keys (RMSNorm) before the dot
product, which undoes a scaling of ``to_q`` and makes the scalar gauge above no symmetry of their computation.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import numpy as np
import pandas as pd
import torch

from ._checks import DEFAULT_GAUGE_FACTORS, parse_factors
from .layers import IPLayer, LayerSelection, claim, find_ip_layers, list_hooks, release

__all__ = ["DEFAULT_FACTORS", "GAUGE_TABLE_COLUMNS", "gauge_sweep", "plot_gauge_sweep", "qk_gauge"]

logger = logging.getLogger(__name__)

_FEATURE = "gauge"

#: The factors :func:`gauge_sweep` and ``ipa-probe probe --gauge-sweep`` use by default (powers of two: exact).
DEFAULT_FACTORS: tuple[float, ...] = DEFAULT_GAUGE_FACTORS

#: The leading columns of :func:`gauge_sweep`'s table; the rest are the probe summary's columns
#: (:func:`ipa_probe.capture.report.summarize`) and ``ref_mass_<adapter>_<reference>``.
GAUGE_TABLE_COLUMNS: tuple[str, ...] = ("factor", "output_max_abs_diff")


def _check_factor(factor: Any) -> float:
    if isinstance(factor, bool) or not isinstance(factor, int | float) or not math.isfinite(factor) or factor <= 0:
        raise ValueError(f"factor: expected a finite number > 0 (e.g. 2.0), got {factor!r}")
    return float(factor)


def _gauge_modules(layer: IPLayer) -> tuple[list[torch.nn.Module], list[torch.nn.Module]]:
    """``(query projections, key projections)`` of one layer, after checking that the scalar gauge is a symmetry."""
    if layer.family != "unet":
        raise ValueError(
            f"layer {layer.name!r} is a {layer.family} layer: Flux and SD3 normalise queries and keys (RMSNorm) "
            "before the dot product, which undoes a scaling of to_q, so q -> c q, k -> k / c is no symmetry of their "
            "attention; the gauge sweep runs on SD 1.5 / SDXL (UNet) pipelines"
        )
    if getattr(layer.processor, "image_branch_logits", None) is not None:
        raise ValueError(
            f"layer {layer.name!r} runs {type(layer.processor).__name__}, whose image branch is not dot-product "
            "attention (an NW head uses |k|^2, which the gauge changes); remove it (ipa_probe.remove_nw_head) first"
        )
    attn = layer.attention
    if getattr(attn, "fused_projections", False):
        raise ValueError(
            f"layer {layer.name!r} has fused q/k/v projections; call pipe.unfuse_qkv_projections() before the gauge"
        )
    keys = [attn.to_k, *layer.processor.to_k_ip]
    for module in [attn.to_q, *keys]:
        if type(module) is not torch.nn.Linear:
            raise ValueError(
                f"layer {layer.name!r}: expected plain torch.nn.Linear q/k projections, got {type(module).__name__} "
                "(a LoRA or quantised wrapper scales differently); fuse or unload the adapter weights first"
            )
        if any(p.is_meta for p in module.parameters()):
            raise ValueError(
                f"layer {layer.name!r}: its q/k weights are not materialised (meta tensors from sequential CPU "
                "offload); use enable_model_cpu_offload() or keep the pipeline on one device"
            )
    return [attn.to_q], keys


@contextlib.contextmanager
def qk_gauge(pipe, factor: float, layers: LayerSelection = None) -> Iterator[list[IPLayer]]:
    """Reparametrise the IP-Adapter layers in place by the scalar gauge ``c = factor``, and restore them on exit.

    In every selected layer the query projection's weight and bias are multiplied by ``c``, and the text keys'
    ``to_k`` and every adapter's ``to_k_ip`` are divided by ``c``: each ``q·k``, hence every attention weight and
    every output, is unchanged (bit for bit when ``c`` is a power of two). On exit, also on an exception or Ctrl-C,
    every parameter gets back its original tensor values bit for bit (copied from clones kept on entry).

    Args:
        pipe: an SD 1.5 / SDXL pipeline (or its UNet) with an IP-Adapter loaded.
        factor: ``c > 0``.
        layers: regex or list of them selecting layer ids; ``None`` for every IP-Adapter layer.

    Yields:
        the reparametrised layers.

    Raises:
        ValueError: a bad factor, or a layer where the scalar gauge is no symmetry (Flux, SD3, an NW head, LoRA-
            wrapped or fused projections), before anything changes.
        RuntimeError: a gauge is already applied to this pipeline.

    Example:
        ```py
        >>> with ipa_probe.qk_gauge(pipe, 2.0):
        ...     image = pipe("a photo", ip_adapter_image=[refs], num_inference_steps=4).images[0]  # the same image
        ```
    """
    c = _check_factor(factor)
    found = find_ip_layers(pipe, layers)
    scaled: dict[int, tuple[torch.nn.Parameter, float]] = {}  # id -> (parameter, multiplier); shared ones once
    for layer in found:
        queries, keys = _gauge_modules(layer)
        for modules, multiplier in ((queries, c), (keys, 1.0 / c)):
            for module in modules:
                for parameter in module.parameters():
                    if id(parameter) in scaled and scaled[id(parameter)][1] != multiplier:
                        raise ValueError(
                            f"layer {layer.name!r}: one parameter is both a query and a key projection; the scalar "
                            "gauge cannot scale it both ways"
                        )
                    scaled[id(parameter)] = (parameter, multiplier)
    if any(a.feature == "nw_head" for a in list_hooks(pipe)):
        raise ValueError("an NW head is applied (its logits use |k|^2, which the gauge changes); remove it first")
    claim(pipe, _FEATURE, [layer.name for layer in found], f"q/k gauge: to_q x {c:g}, to_k and to_k_ip / {c:g}")
    originals = [(parameter, parameter.detach().clone()) for parameter, _ in scaled.values()]
    try:
        with torch.no_grad():
            for parameter, multiplier in scaled.values():
                parameter.mul_(c) if multiplier == c else parameter.div_(c)
        yield found
    finally:
        with torch.no_grad():
            for parameter, original in originals:
                parameter.copy_(original)
        release(pipe, _FEATURE)


def _as_array(output: Any) -> np.ndarray:
    """A pipeline call's result as one float64 array: ``.images`` (PIL, numpy or tensors), a tuple's first entry, a
    tensor, an array, or a list of them."""
    if hasattr(output, "images"):
        output = output.images
    elif isinstance(output, tuple) and output:
        output = output[0]
    if isinstance(output, torch.Tensor):
        return output.detach().to("cpu", torch.float64).numpy()
    if isinstance(output, list | tuple):
        return np.stack([_as_array(item) for item in output])
    try:
        return np.asarray(output, dtype=np.float64)
    except (TypeError, ValueError):
        raise TypeError(
            f"call: expected it to return the pipeline's output (an object with .images, a tensor, an array or PIL "
            f"images) so that the outputs can be compared, got {type(output).__name__}"
        ) from None


def _mass_columns(mass: pd.DataFrame) -> pd.DataFrame:
    """Attention mass per reference, averaged over layers: one ``ref_mass_<adapter>_<reference>`` column per
    reference, indexed by (call, step, branch)."""
    if mass.empty:
        return pd.DataFrame()
    mean = mass.groupby(["call", "step", "branch", "adapter", "reference"], observed=True)["attention"].mean()
    wide = mean.unstack(["adapter", "reference"])
    wide.columns = [f"ref_mass_{adapter}_{reference}" for adapter, reference in wide.columns]
    return wide.reset_index()


def gauge_sweep(
    pipe,
    call: Callable[[], Any],
    factors: Sequence[float] = DEFAULT_FACTORS,
    *,
    tolerance: float = 1e-4,
    layers: LayerSelection = None,
    **probe_options,
) -> pd.DataFrame:
    """Probe one generation under several q/k gauges and tabulate what moves and what does not.

    For each factor ``c`` (and ``c = 1`` first, as the reference) the pipeline's IP-Adapter layers are reparametrised
    by :func:`qk_gauge`, ``call()`` runs the pipeline once under :func:`ipa_probe.probe` (with ``maps=True`` for the
    attention mass per reference), and the weights are restored bit for bit afterwards, whatever happens. Each
    output is compared with the reference output: every gauge must reproduce it, exactly for powers of two.

    Args:
        pipe: an SD 1.5 / SDXL pipeline with an IP-Adapter.
        call: a function of no arguments that runs ``pipe`` once and returns its output; it must seed its own
            generator, so that two calls give the same output (e.g.
            ``lambda: pipe(prompt, ip_adapter_image=[refs], generator=torch.Generator().manual_seed(0))``).
        factors: the gauge factors ``c > 0`` (default: 0.25, 0.5, 1, 2, 4).
        tolerance: the largest allowed ``max |output_c - output_1|``, relative to ``max(1, max |output_1|)``.
        layers: the layers to reparametrise and probe (regex or list of them; default: all IP-Adapter layers).
        **probe_options: further :func:`ipa_probe.probe` options (``bandwidth``, ``steps``, ``heads``, ``branch``,
            ``branches``, ``seed``).

    Returns:
        one row per factor x (call, step, timestep, kind, branch): ``factor``, ``output_max_abs_diff`` (the largest
        absolute difference of that factor's output from the reference output), the probe summary's columns (among
        them ``spearman``, ``logit_ratio``, ``rho_baseline``, ``rho_excess``, and the gauge-invariant ``neff_attn``)
        and, for the image branch, ``ref_mass_<adapter>_<reference>``: each reference image's mean share of the
        attention weight (over layers, heads, query positions and items; :meth:`ipa_probe.ProbeRun.reference_mass`).

    Raises:
        ValueError: bad factors or options, or a pipeline where the scalar gauge is no symmetry (see
            :func:`qk_gauge`), before anything runs.
        RuntimeError: an output differs from the reference output beyond ``tolerance`` (then ``call`` is not
            deterministic: seed its generator).

    Example:
        ```py
        >>> table = ipa_probe.gauge_sweep(pipe, lambda: pipe("a photo", ip_adapter_image=[refs],
        ...     num_inference_steps=4, generator=torch.Generator().manual_seed(0)))
        >>> table.pivot_table(index="timestep", columns="factor", values="spearman")
        ```
    """
    from .capture.run import probe

    if not callable(call):
        raise TypeError(f"call: expected a function of no arguments that runs the pipeline once, got {call!r}")
    if isinstance(factors, str | bytes) or not isinstance(factors, Iterable):
        raise TypeError(f"factors: expected a sequence of numbers > 0, e.g. (0.5, 1, 2), got {factors!r}")
    factors = parse_factors(list(factors))
    if not (isinstance(tolerance, int | float) and math.isfinite(tolerance) and tolerance >= 0):
        raise ValueError(f"tolerance: expected a finite number >= 0, got {tolerance!r}")
    if "maps" in probe_options or "keep_maps" in probe_options:
        raise ValueError("gauge_sweep keeps the reference maps itself; drop maps= / keep_maps= from its options")
    for layer in find_ip_layers(pipe, layers):
        _gauge_modules(layer)  # refuse before anything runs
    order = [1.0, *(f for f in factors if f != 1.0)]
    tables, reference = {}, None
    for factor in order:
        with qk_gauge(pipe, factor, layers), probe(pipe, layers=layers, maps=True, **probe_options) as run:
            output = _as_array(call())
        if reference is None:
            reference = output
        if output.shape != reference.shape:
            raise RuntimeError(f"gauge {factor:g}: the output's shape {output.shape} differs from {reference.shape}")
        diff = float(np.max(np.abs(output - reference))) if output.size else 0.0
        scale = max(1.0, float(np.max(np.abs(reference)))) if reference.size else 1.0
        if not diff <= tolerance * scale:
            raise RuntimeError(
                f"gauge {factor:g}: the output differs from the ungauged one by up to {diff:.3g} (tolerance "
                f"{tolerance:g} x {scale:.3g}); the gauge leaves every logit unchanged, so `call` is not "
                "deterministic: seed its generator (generator=torch.Generator().manual_seed(0)) inside it"
            )
        logger.info("gauge %g: outputs equal to the reference within %.3g", factor, diff)
        summary = run.summary()
        mass = _mass_columns(run.reference_mass())
        if not mass.empty:
            summary = summary.merge(mass.assign(kind="image"), on=["call", "step", "branch", "kind"], how="left")
        summary.insert(0, "factor", factor)
        summary.insert(1, "output_max_abs_diff", diff)
        tables[factor] = summary
    table = pd.concat([tables[f] for f in factors], ignore_index=True)
    return table


def plot_gauge_sweep(table: pd.DataFrame, branch: str = "cond", kind: str = "image"):
    """Figure of a :func:`gauge_sweep` table: per factor against timestep, rho with its baseline (dotted),
    ``rho_excess``, and the gauge-invariant attention ``n_eff``; the x axes run in the denoising direction."""
    import matplotlib.pyplot as plt

    from .capture.report import style_timestep_axes

    part = table[(table["kind"] == kind) & (table["branch"] == branch)]
    if part.empty and not table.empty:
        branch = str(table["branch"].iloc[0])
        part = table[(table["kind"] == kind) & (table["branch"] == branch)]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    colours = plt.get_cmap("viridis")
    factors = sorted(part["factor"].unique())
    for i, factor in enumerate(factors):
        rows = part[part["factor"] == factor].sort_values("timestep", ascending=False)
        colour = colours(i / max(1, len(factors) - 1))
        x = rows["timestep"].to_numpy(np.float64)
        axes[0].plot(x, rows["spearman"], marker="o", color=colour, label=f"c = {factor:g}")
        axes[0].plot(x, rows["rho_baseline"], linestyle=":", color=colour)
        axes[1].plot(x, rows["rho_excess"], marker="o", color=colour, label=f"c = {factor:g}")
        axes[2].plot(x, rows["neff_attn"], marker="o", color=colour, label=f"c = {factor:g}")
    style_timestep_axes(axes[0])
    axes[0].set(ylabel="Spearman ρ (dotted: baseline from r, K)", title=f"ρ moves with the gauge ({branch})")
    style_timestep_axes(axes[1])
    axes[1].set(ylabel="ρ − baseline", title="rho_excess")
    axes[1].set_ylim(-0.55, 0.55)
    axes[2].set_xlabel("timestep (denoising →)")
    axes[2].invert_xaxis()
    axes[2].set(ylabel="attention n_eff", title="invariant: attention n_eff (lines overlap)")
    for ax in axes:
        ax.legend(fontsize=7, loc="best")
        ax.title.set_fontsize(10)
    fig.tight_layout()
    return fig
