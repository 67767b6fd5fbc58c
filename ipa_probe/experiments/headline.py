"""The headline table of a results folder: one line per published number, ours beside the paper's.

``python -m ipa_probe.experiments.headline OUT`` prints it as markdown (the README's "Reproducing the paper" table
is this output for the committed full-tier run). It reads only ``OUT/NAME/record.json``, so the table always
matches the measurements.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from .report import Row, markdown_table

__all__ = ["headline_rows"]


def _load(folder: Path, name: str) -> dict | None:
    path = folder / name / "record.json"
    return json.loads(path.read_text()) if path.exists() else None


def _num(x: float | None, spec: str) -> str:
    """``x`` formatted by ``spec``; ``n/a`` where it is missing (e.g. no interval below the sets one needs)."""
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def _fmt(x: float | None, digits: int = 3) -> str:
    return _num(x, f".{digits}g")


def _signed(x: float | None) -> str:
    """A correlation: sign and two decimals (``n/a`` for a missing value)."""
    return _num(x, "+.2f")


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def headline_rows(folder: str | Path) -> list[Row]:
    """Rows ``quantity | setting | ours | paper | note`` for every experiment found under ``folder``."""
    folder = Path(folder)
    rows: list[Row] = []
    rec = _load(folder, "collapse")
    if rec:
        for d, v in rec["measurements"]["benefit"].items():
            paper = {"2": "+28%", "4": "> 0, p = 0.026", "16": "≈ 0%, n.s."}.get(d, "—")
            p = v.get("p_value")
            spread = v.get("benefit_std")
            ours = f"{v['benefit_mean']:+.1f}%" + (f" ± {spread:.1f}" if spread is not None else "")
            rows.append(
                Row(
                    "collapse: exact-head benefit",
                    f"d={d}",
                    ours,
                    paper,
                    f"p = {_fmt(p, 2)} over {len(v['per_seed'])} seeds",
                )
            )
        for d, v in rec["measurements"]["neff"].items():
            paper = {"2": "≈ 9", "16": "≈ 1"}.get(d, "—")
            rows.append(Row("collapse: NW n_eff at t = 0.56", f"d={d}", _fmt(v["mean"]), paper, ""))
    rec = _load(folder, "shells")
    if rec:
        for d, v in rec["measurements"]["ratio"].items():
            ratios = v["ratio_per_seed"]
            paper = {"8": ("11.2", "6.5"), "32": ("6.4", "8.0")}.get(d, ("—", "—"))
            rows.append(
                Row(
                    "shells: MMD² plug-in / learned",
                    f"d={d}",
                    f"{sum(ratios) / len(ratios):.3g} (seeds {', '.join(f'{r:.3g}' for r in ratios)})",
                    paper[0],
                    "",
                )
            )
            rows.append(Row("shells: NW n_eff at t = 0.56", f"d={d}", _fmt(v["nw_neff"]), paper[1], ""))
    rec = _load(folder, "scarcity")
    if rec:
        for data, values in rec["measurements"].items():
            for m in ("1", "10", "25", "50"):
                if m in values:
                    paper = {"10": "+24%", "50": "≈ +1% (ratio 0.99)", "25": "≈ parity"}.get(m, "much better")
                    rows.append(
                        Row(
                            "scarcity: learned gain over plug-in",
                            f"{data}, m={m}",
                            f"{values[m]['gain_pct']:+.0f}%",
                            paper,
                            "",
                        )
                    )
        for data, check in rec.get("per_m_check", {}).items():
            mixed = rec["measurements"][data][str(check["m"])]["gain_pct"]
            rows.append(
                Row(
                    "scarcity: §D.3 check, a model trained at one m",
                    f"{data}, m={check['m']}",
                    f"{check['gain_pct']:+.0f}%",
                    "+24% (one model per m)" if check["m"] == 10 else "—",
                    f"the model trained on m ~ U{{1..50}}: {mixed:+.0f}%",
                )
            )
    rec = _load(folder, "heads")
    if rec:
        for h, v in rec["measurements"].items():
            fit = v["fit"]
            rows.append(
                Row(
                    "heads: exponent alpha (MMD² ~ m^-alpha)",
                    f"H={h}",
                    f"{_fmt(fit['alpha'], 2)} [{_fmt(fit['low'], 2)}, {_fmt(fit['high'], 2)}]",
                    "0.45–0.72 (plot range)",
                    "",
                )
            )
    rec = _load(folder, "attention")
    if rec:
        measurements = rec["measurements"]
        if all(_is_number(k) for k in measurements):  # one unlabelled model (records before the GMM model was added)
            measurements = {"shells": measurements}
        for label, values in measurements.items():
            ts = sorted(values, key=float)
            first, last = values[ts[0]], values[ts[-1]]
            rows.append(
                Row(
                    "attention: per-row Spearman, first → last t",
                    label,
                    f"{first['spearman']:.2f} → {last['spearman']:.2f} "
                    f"(null {last['null']:+.2f}, {100 * last['frac_rho_gt_0.9']:.0f}% ρ>0.9)",
                    "rises to 0.89 (IP-Adapter)",
                    "",
                )
            )
    rec = _load(folder, "ip-adapter")
    if rec:
        for label in ("trained", "untrained"):
            values = rec["measurements"].get(label, [])
            if values:
                first, last = values[0], values[-1]  # ordered from timestep 981 to 1
                if "qf_spearman" in last:  # the headline: the query frame, invariant under the q/k group
                    rows.append(
                        Row(
                            "ip-adapter: query-frame per-row Spearman (exact b), t = 981 → 1",
                            f"digits organism, {label}",
                            f"{first['qf_spearman']:.3f} → {last['qf_spearman']:.3f} "
                            f"[{_num(last['qf_spearman_low'], '.3f')}, {_num(last['qf_spearman_high'], '.3f')}] "
                            f"(null {last['qf_spearman_null']:+.2f}, {100 * last['qf_frac_rho_gt_0.9']:.0f}% ρ>0.9)",
                            "— (the paper reports the stored frame)" if label == "trained" else "— (control)",
                            f"{last['sets']} reference sets and seeds; Gaussian b {first['qf_gauss_spearman']:.3f} → "
                            f"{last['qf_gauss_spearman']:.3f}; excess over its own baseline "
                            f"{first['qf_rho_excess']:+.3f} → {last['qf_rho_excess']:+.3f} "
                            f"[{_num(last['qf_rho_excess_low'], '+.3f')}, {_num(last['qf_rho_excess_high'], '+.3f')}]",
                        )
                    )
                rows.append(
                    Row(
                        "ip-adapter: stored-frame per-row Spearman (gauge-dependent), t = 981 → 1",
                        f"digits organism, {label}",
                        f"{first['spearman']:.2f} → {last['spearman']:.2f} "
                        f"[{_num(last['ci_low'], '.2f')}, {_num(last['ci_high'], '.2f')}] "
                        f"(null {last['null']:+.2f}, {100 * last['frac_rho_gt_0.9']:.0f}% ρ>0.9)",
                        "rises to 0.89 (SD 1.5)" if label == "trained" else "— (control)",
                        f"{last['sets']} reference sets"
                        + (
                            f"; gauge baseline {first['rho_baseline']:.2f} → {last['rho_baseline']:.2f}, "
                            f"excess {first['rho_excess']:+.3f} → {last['rho_excess']:+.3f}"
                            if "rho_baseline" in last
                            else ""
                        ),
                    )
                )
        for key, values in rec["measurements"].get("attribution", {}).items():
            if not key.startswith("trained") or not values:
                continue
            last = values[-1]
            rows.append(
                Row(
                    "ip-adapter: attention vs exact posterior, t = 981 → 1",
                    f"digits organism, {key}",
                    ", ".join(v["verdict"] for v in values),
                    "— (not in the paper)",
                    f"at t = 1: rank ρ {_signed(last['share_spearman'])} (p {_fmt(last['share_spearman_p'], 2)}), "
                    f"attention TV from uniform {_fmt(last['attention_tv'], 2)}; {last['sets']} sets",
                )
            )
    rec = _load(folder, "attribution")
    if rec:
        for label, values in rec["measurements"].items():
            overall = [c for c in values["comparisons"] if c["timestep"] == "all" and c["effect"] == "latent_effect"]
            by = {c["predictor"]: c for c in overall}
            if {"attention_share", "posterior_weight"} <= set(by):
                a, w = by["attention_share"], by["posterior_weight"]
                rows.append(
                    Row(
                        "attribution: attention share predicts the ablation effect?",
                        f"digits organism, {label}",
                        f"{'yes' if a['predicts'] else 'no'}: Spearman {_signed(a['spearman'])} "
                        f"[{_signed(a['low'])}, {_signed(a['high'])}] (p {_fmt(a['p'], 2)})",
                        "— (not in the paper)",
                        f"exact posterior: {_signed(w['spearman'])} [{_signed(w['low'])}, {_signed(w['high'])}] "
                        f"(p {_fmt(w['p'], 2)}); {a['sets']} sets",
                    )
                )
    return rows


def main() -> None:  # pragma: no cover - a script
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("folder")
    args = parser.parse_args()
    print(markdown_table(headline_rows(args.folder)), end="")


if __name__ == "__main__":  # pragma: no cover
    main()
