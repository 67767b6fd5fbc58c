"""Gauge sweeps: probe one generation under several elements of the q/k gauge group and tabulate what moves.

Each gauge (a scalar ``c``, per-head matrices, a row shift, or a named generator: :mod:`ipa_probe.gauge.generators`)
is applied by :func:`ipa_probe.gauge.transforms.apply_gauge`, ``call()`` runs the pipeline once under
:func:`ipa_probe.probe`, and the weights are restored bit for bit afterwards. Every output must equal the ungauged
one; the table shows which of the probe's columns move (the stored-frame rho, ``rho_excess``) and which cannot
(everything made from the attention weights alone, and the query-frame columns).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np
import pandas as pd
import torch

from .._checks import DEFAULT_GAUGE_FACTORS, parse_gauges
from ..layers import LayerSelection, find_ip_layers
from .generators import resolve_gauge
from .transforms import GaugeConfig, _check_layer, apply_gauge, max_condition_number, max_shift_scale, plan_gauge

__all__ = ["DEFAULT_FACTORS", "GAUGE_TABLE_COLUMNS", "gauge_sweep", "plot_gauge_sweep"]

logger = logging.getLogger(__name__)

#: The factors :func:`gauge_sweep` and ``ipa-probe probe --gauge-sweep`` use by default (powers of two: exact).
DEFAULT_FACTORS: tuple[float, ...] = DEFAULT_GAUGE_FACTORS

#: The leading columns of :func:`gauge_sweep`'s table; the rest are the probe summary's columns (whatever
#: :meth:`ipa_probe.ProbeRun.summary` produces) and ``ref_mass_<adapter>_<reference>``.
GAUGE_TABLE_COLUMNS: tuple[str, ...] = ("gauge", "factor", "max_cond", "output_max_abs_diff")


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
        if output is None or isinstance(output, str | bytes | dict):
            raise TypeError
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
    gauges: Sequence[Any] = DEFAULT_FACTORS,
    *,
    factors: Sequence[float] | None = None,
    tolerance: float = 1e-4,
    layers: LayerSelection = None,
    **probe_options,
) -> pd.DataFrame:
    """Probe one generation under several q/k gauges and tabulate what moves and what does not: ``call()`` runs once
    ungauged (the reference), then once per gauge under :func:`ipa_probe.qk_gauge` and :func:`ipa_probe.probe`
    (``maps=True``), each output checked against the reference and the weights restored bit for bit, whatever happens.
    The full account (gauges, columns, refusals, an example): docs/gauge.md ("Measuring it: ``gauge_sweep``").

    Args:
        pipe: a pipeline with an IP-Adapter: SD 1.5 / SDXL (the whole group), Flux / SD3 (the per-channel subgroup).
        call: a function of no arguments that runs ``pipe`` once, seeding its own generator, and returns its output.
        gauges: anything :func:`ipa_probe.qk_gauge` accepts, an :class:`AdversarialGauge` (searched on ``call``), or
            strings such as ``"0.5,random:0:1,adversarial:down:10,shift:0:1"`` (default: 0.25, 0.5, 1, 2, 4).
        factors: the older name of ``gauges`` (numbers only); give one of the two.
        tolerance: the largest allowed ``max |output_g - output_ref|``, relative to ``max(1, max |output_ref|)``.
        layers: the layers to reparametrise and probe (regex or list of them; default: all IP-Adapter layers).
        **probe_options: further :func:`ipa_probe.probe` options.

    Returns:
        one row per gauge x (call, step, timestep, kind, branch): ``gauge``, ``factor``, ``max_cond``,
        ``output_max_abs_diff``, every column of the probe's summary and ``ref_mass_<adapter>_<reference>``.

    Raises:
        TypeError: ``call`` is not callable or returns no pipeline output.
        ValueError: bad gauges or options, or a gauge that is no symmetry of ``pipe``, before anything runs.
        RuntimeError: an output differs from the reference beyond ``tolerance`` (``call`` is not deterministic).
    """
    from ..capture.run import probe

    if not callable(call):
        raise TypeError(f"call: expected a function of no arguments that runs the pipeline once, got {call!r}")
    if factors is not None:
        if gauges is not DEFAULT_FACTORS:
            raise ValueError("factors: give the gauges once, as gauges= (factors= is its older name)")
        gauges, key = factors, "factors"
    else:
        key = "gauges"
    if isinstance(gauges, bytes) or not isinstance(gauges, Iterable | str):
        raise TypeError(f"{key}: expected a sequence of gauges, e.g. (0.5, 1, 2) or 'random:0:1,2', got {gauges!r}")
    if key == "factors" and (isinstance(gauges, str) or not all(isinstance(g, int | float) for g in gauges)):
        raise TypeError(f"factors: expected a sequence of numbers > 0, e.g. (0.5, 1, 2), got {gauges!r}")
    specs = parse_gauges(gauges if isinstance(gauges, str) else list(gauges), key, bounded=False)
    if not (isinstance(tolerance, int | float) and math.isfinite(tolerance) and tolerance >= 0):
        raise ValueError(f"tolerance: expected a finite number >= 0, got {tolerance!r}")
    if "maps" in probe_options or "keep_maps" in probe_options:
        raise ValueError("gauge_sweep keeps the reference maps itself; drop maps= / keep_maps= from its options")
    found = find_ip_layers(pipe, layers)
    for layer in found:
        _check_layer(layer)  # refuse before anything runs
    # every gauge is checked before the first call, and a refusal names it as it was given: the adversarial ones by
    # their bound against the weights' dtype (their search needs the calls), the others resolved and planned
    configs: list[GaugeConfig | None] = []
    for spec in specs:
        try:
            configs.append(_checked(pipe, spec, layers, key, found))
        except ValueError as err:
            raise ValueError(f"{key}: {_spec_text(spec)}: {str(err).split(': ', 1)[-1]}") from None
    with probe(pipe, layers=layers, maps=True, **probe_options) as run:
        reference = _as_array(call())
    if not np.isfinite(reference).all():
        raise ValueError("call: the ungauged pipeline's output has non-finite values; fix the pipeline first")
    scale = max(1.0, float(np.max(np.abs(reference)))) if reference.size else 1.0
    identity = _rows(run, GaugeConfig(label="identity"), 0.0)
    tables = []
    for spec, config in zip(specs, configs, strict=True):
        if config is None:
            config = resolve_gauge(pipe, spec, layers, key=key, call=call)
        if _is_identity(config):
            tables.append(identity)
            continue
        with apply_gauge(pipe, config, layers), probe(pipe, layers=layers, maps=True, **probe_options) as run:
            output = _as_array(call())
        name = config.describe()
        if output.shape != reference.shape:
            raise RuntimeError(f"gauge {name}: the output's shape {output.shape} differs from {reference.shape}")
        diff = float(np.max(np.abs(output - reference))) if output.size else 0.0
        if not diff <= tolerance * scale:
            raise RuntimeError(
                f"gauge {name}: the output differs from the ungauged one by up to {diff:.3g} (tolerance "
                f"{tolerance:g} x {scale:.3g}); the gauge leaves every logit unchanged, so `call` is not "
                "deterministic: seed its generator (generator=torch.Generator().manual_seed(0)) inside it"
            )
        logger.info("gauge %s: outputs equal to the reference within %.3g", name, diff)
        tables.append(_rows(run, config, diff))
    return pd.concat(tables, ignore_index=True)


def _checked(pipe, spec: Any, layers: LayerSelection, key: str, found: list) -> GaugeConfig | None:
    """``spec`` resolved and planned against the weights (nothing written), or ``None`` for an adversarial gauge
    whose bound the weights' dtype holds (it is searched for when its turn comes)."""
    if (isinstance(spec, str) and spec.startswith("adversarial")) or _is_adversarial(spec):
        bound = float(spec.split(":")[2]) if isinstance(spec, str) else spec.max_cond
        dtype = found[0].attention.to_q.weight.dtype if found else torch.float32
        limit = max_condition_number(dtype)
        if bound > limit:
            raise ValueError(f"max_cond: {dtype} weights hold basis changes up to cond(A) {limit:.3g}, got {bound:g}")
        return None
    if isinstance(spec, str) and spec.startswith("shift:") and found:
        scale, dtype = float(spec.split(":")[2]), found[0].attention.to_q.weight.dtype
        if scale > max_shift_scale(dtype):
            raise ValueError(
                f"scale: beyond {max_shift_scale(dtype):.3g} {dtype} no longer keeps the outputs and the query-frame "
                "statistics of a row shift within tolerance (docs/gauge.md, 'How far a row shift holds')"
            )
    config = resolve_gauge(pipe, spec, layers, key=key)
    plan_gauge(pipe, config, layers)  # its range against the weights' dtype, before the first call
    return config


def _spec_text(spec: Any) -> str:
    """A gauge as the caller gave it: the string, the number, or the generator's fields."""
    return spec if isinstance(spec, str) else repr(spec)


def _is_adversarial(spec: Any) -> bool:
    from .generators import AdversarialGauge

    return isinstance(spec, AdversarialGauge)


def _is_identity(config: GaugeConfig) -> bool:
    return config.factor == 1.0 and not config.matrices and not config.shifts


def _rows(run, config: GaugeConfig, diff: float) -> pd.DataFrame:
    """One gauge's rows: the probe summary, the reference masses, and the gauge's own columns first."""
    summary = run.summary()
    mass = _mass_columns(run.reference_mass())
    if not mass.empty:
        summary = summary.merge(mass.assign(kind="image"), on=["call", "step", "branch", "kind"], how="left")
    plain = not config.matrices and not config.shifts
    summary.insert(0, "gauge", config.describe() if config.label or not plain else f"c = {config.factor:g}")
    summary.insert(1, "factor", config.factor if plain else math.nan)
    summary.insert(2, "max_cond", config.largest_cond)
    summary.insert(3, "output_max_abs_diff", diff)
    return summary


#: The lines of :func:`plot_gauge_sweep`, per panel: (column, line style, short name, legend entry). Colours are
#: the gauges.
_STORED = (
    ("spearman", "-", "ρ", "stored-frame ρ (top left)"),
    ("rho_baseline", "--", "baseline", "its baseline from r and K (top left)"),
)
_QUERY = (
    ("qf_spearman", "-", "exact", "query-frame ρ, exact b (top right)"),
    ("qf_gauss_spearman", "--", "Gaussian", "query-frame ρ, Gaussian b (top right)"),
)
_EXCESS = (
    ("rho_excess", "-", "stored", "stored-frame ρ − baseline (bottom left)"),
    ("qf_rho_excess", "--", "query frame", "query-frame ρ − baseline, exact b (bottom left)"),
)
_NEFF = (("neff_attn", "-", "n_eff", "attention n_eff (bottom right)"),)


def _fit_ylim(ax, values: np.ndarray, zero: bool = False) -> float:
    """Set ``ax``'s y range to the finite ``values`` (and 0 with ``zero``) with a margin of 8 % of their range, at
    least 0.002 (so that lines equal to the last digit are drawn as one, not stretched apart); returns the range."""
    finite = values[np.isfinite(values)]
    if not finite.size:
        return math.nan
    low, high = float(finite.min()), float(finite.max())
    if zero:
        low, high = min(low, 0.0), max(high, 0.0)
    pad = max(0.08 * (high - low), 0.002)
    ax.set_ylim(low - pad, high + pad)
    return high - low


def _spread(part: pd.DataFrame, column: str) -> float:
    """The largest difference of ``column`` between gauges at one timestep (NaN when it is absent)."""
    if column not in part.columns or not np.isfinite(part[column].to_numpy(np.float64)).any():
        return math.nan
    by_step = part.groupby("timestep")[column]
    return float((by_step.max() - by_step.min()).max())


def plot_gauge_sweep(table: pd.DataFrame, branch: str = "cond", kind: str = "image"):
    """Figure of a :func:`gauge_sweep` table, four panels against timestep (denoising direction), one colour per
    gauge: the stored-frame rho with its baseline from r and K (moves with the gauge), the query-frame rho in both
    forms (cannot move), the excess of each over its baseline, and the attention n_eff (cannot move). Each panel's y
    range fits its data, and its title gives the largest difference between gauges at one timestep.

    A table without the query-frame columns draws that panel empty; the table's first CFG branch is drawn when it
    has none of ``branch``. The figure is 7 in wide (a paper's page width) with text at 8 pt or more at that size, the
        selection (image or text branch of the attention, CFG branch) in its title, one key of the gauges' colours
        and one of the statistics' line styles.
    """
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    from ..figstyle import DOUBLE_COLUMN, paper_style

    part = table[(table["kind"] == kind) & (table["branch"] == branch)]
    if part.empty and not table.empty:
        branch = str(table["branch"].iloc[0])
        part = table[(table["kind"] == kind) & (table["branch"] == branch)]
    gauges = list(dict.fromkeys(part["gauge"]))  # in the sweep's order
    colours = plt.get_cmap("tab10")
    panels = (
        (_STORED, "Stored frame: ρ, baseline (gauge-dependent)", "Spearman ρ", False),
        (_QUERY, "Query frame: ρ (invariant)", "Spearman ρ", False),
        (_EXCESS, "ρ minus its baseline (from r and K)", "ρ − baseline", True),
        (_NEFF, "Attention n_eff (invariant)", "effective number of keys", False),
    )
    with paper_style():
        fig = plt.figure(figsize=(DOUBLE_COLUMN, 8.6), layout="constrained")
        grid = fig.add_gridspec(3, 2, height_ratios=(1.0, 1.0, 0.36))
        axes = np.array([[fig.add_subplot(grid[row, col]) for col in range(2)] for row in range(2)])
        keys = [fig.add_subplot(grid[2, col]) for col in range(2)]  # a row of its own for the two keys
        for ax, (lines, title, ylabel, zero) in zip(axes.ravel(), panels, strict=True):
            drawn, spreads = [], []
            for i, gauge in enumerate(gauges):
                rows = part[part["gauge"] == gauge].sort_values("timestep", ascending=False)
                x = rows["timestep"].to_numpy(np.float64)
                # later gauges drawn thinner, so that lines that coincide stay visible under one another
                width = 1.0 + 2.2 * (len(gauges) - 1 - i) / max(1, len(gauges) - 1)
                for column, style, _, _ in lines:
                    if column not in rows.columns:
                        continue
                    y = rows[column].to_numpy(np.float64)
                    ax.plot(x, y, linestyle=style, linewidth=width, color=colours(i % 10), alpha=0.9)
                    drawn.append(y)
            for column, _, short, _ in lines:
                gap = _spread(part, column)
                spreads.append(f"{short} {gap:.2g}" if math.isfinite(gap) else f"{short} n/a")
            if drawn:
                _fit_ylim(ax, np.concatenate(drawn), zero=zero)
            else:
                ax.text(0.5, 0.5, "not in this table", transform=ax.transAxes, ha="center", va="center")
            if zero:
                ax.axhline(0, color="black", linewidth=0.6)
            ax.set_title(f"{title}\nlargest gap between gauges:\n{' · '.join(spreads)}")
            ax.set(xlabel="timestep (denoising →)", ylabel=ylabel)
            ax.invert_xaxis()
            ax.grid(alpha=0.3)
        # two keys (at most 7 entries each) side by side under the panels: the gauges' colours, the line styles
        handles = [Line2D([], [], color=colours(i % 10), linewidth=2.5) for i in range(len(gauges))]
        keys[0].legend(handles, list(gauges), loc="upper center", title="colour: gauge", frameon=False)
        handles, labels = [], []
        for _, style, _, label in (*_STORED, *_QUERY, *_EXCESS):
            handles.append(Line2D([], [], color="0.3", linestyle=style, linewidth=1.5))
            labels.append(label)
        keys[1].legend(handles, labels, loc="upper center", title="line: statistic", frameon=False)
        for key in keys:
            key.set_axis_off()
        fig.suptitle(
            "One model under reparametrisations of q and k that leave every output unchanged\n"
            f"({kind} branch of the attention, {branch} CFG branch; mean over layers and heads)"
        )
    return fig
