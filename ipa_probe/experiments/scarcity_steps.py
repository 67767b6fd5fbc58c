"""Scarcity against training length: does the learned model's deficit at large ``m`` close as training grows?

``python -m ipa_probe.experiments.scarcity_steps --out DIR [--steps 8000] [--tier full] [--threads 1]`` trains the
``scarcity`` experiment's model (learned OFF, ``d = 16``, ``m ~ U{1..50}`` per batch, the tier's sizes) once per
data set at the release's constant learning rate after warm-up, and at doubling snapshot steps (250, 500, ...)
scores it on the experiment's held-out tasks at ``m = 10`` and ``m = 50`` against the plug-in. A constant rate
makes every snapshot a model trained for that many steps under one protocol, so one run gives the whole curve.
Writes ``DIR/table.md``, ``table.csv``, ``record.json`` and ``scarcity_steps.png``.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402
import torch  # noqa: E402

from .report import save_figure, versions  # noqa: E402
from .runner import ExperimentContext  # noqa: E402
from .scarcity import DIM, M_TRAIN  # noqa: E402
from .tasks import TaskBatch  # noqa: E402
from .tiers import ALL_TIERS, Tier  # noqa: E402
from .training import train  # noqa: E402

__all__ = ["measure", "plot", "snapshot_steps", "table"]

MS = (10, 50)


def snapshot_steps(steps: int, first: int = 250) -> list[int]:
    """Doubling snapshot steps ``first, 2 first, ...`` up to ``steps``, and ``steps`` itself."""
    out, k = [], first
    while k < steps:
        out.append(k)
        k *= 2
    return out + [steps]


def _rows_path(out: Path, data: str, steps: int) -> Path:
    return out / f"rows-{data}-{steps}.csv"


def measure(
    tier: Tier,
    steps: int,
    out: Path,
    progress: bool = True,
    first: int = 250,
    datas: tuple[str, ...] | None = None,
) -> pd.DataFrame:
    """Train one constant-rate model per data set and score it at every snapshot step.

    Each snapshot's rows are written to ``out/rows-DATA-STEPS.csv`` as soon as they are measured and kept when the
    command is started again; an interrupted run resumes its training from the last checkpoint (snapshots between
    that checkpoint and the interruption are measured again, earlier ones are kept from the file).

    Args:
        datas: the data sets (default: the tier's scarcity data sets); separate processes may measure different
            data sets into the same ``out``.

    Returns:
        one row per (data, step, m): ``plugin``, ``learned`` (mean MMD² over the held-out tasks), their standard
        errors, ``gain_pct = 100 (plugin - learned) / plugin`` and ``ratio = plugin / learned``.
    """
    ctx = ExperimentContext(replace(tier, schedule="constant", eval_every=0), out, progress)
    rows = []
    wanted = set(snapshot_steps(steps, first))
    for data in datas or tier.scarcity_data:
        path = _rows_path(out, data, steps)
        done = pd.read_csv(path).to_dict(orient="records") if path.exists() else []
        rows.extend(done)
        tasks = ctx.held_out(data, DIM, m=max(MS))  # the scarcity experiment's tasks when its largest m is 50
        subs = {m: TaskBatch(tasks.support[:, :m], tasks.target) for m in MS}
        plugin = {m: ctx.mmd_plugin(sub) for m, sub in subs.items()}

        def observe(step: int, model, data=data, subs=subs, plugin=plugin, path=path, done=done) -> None:
            if step not in wanted or any(r["step"] == step for r in done):
                return
            model.eval()
            for m, sub in subs.items():
                learned = ctx.mmd_learned(model, sub)
                rows.append(
                    {
                        "data": data,
                        "step": step,
                        "m": m,
                        "plugin": plugin[m].mean,
                        "plugin_sem": plugin[m].sem,
                        "learned": learned.mean,
                        "learned_sem": learned.sem,
                    }
                )
                done.append(rows[-1])
            pd.DataFrame(done).to_csv(path, index=False)
            model.train()

        cfg = ctx.train_config(steps, tier.seeds[0], m=M_TRAIN[0], m_max=M_TRAIN[1])
        train(
            ctx.model_config(DIM),
            cfg,
            ctx.meta(data, DIM),
            run_dir=out / "runs" / f"{data}-constant-{steps}",
            progress=progress,
            description=f"{data} constant lr",
            observe=observe,
            device=ctx.device,
        )
    return with_gains(pd.DataFrame(rows))


def with_gains(frame: pd.DataFrame) -> pd.DataFrame:
    """``frame`` with ``gain_pct`` and ``ratio`` columns added."""
    frame = frame.sort_values(["data", "step", "m"]).reset_index(drop=True)
    frame["gain_pct"] = 100 * (frame["plugin"] - frame["learned"]) / frame["plugin"]
    frame["ratio"] = frame["plugin"] / frame["learned"]
    return frame


def table(frame: pd.DataFrame) -> str:
    """Markdown: the learned gain over the plug-in at each snapshot step, one column per (data, m)."""
    wide = frame.pivot_table(index="step", columns=["data", "m"], values="gain_pct")
    header = "| steps | " + " | ".join(f"{d}, m={m}" for d, m in wide.columns) + " |"
    lines = [header, "|" + "---|" * (len(wide.columns) + 1)]
    for step, values in wide.iterrows():
        lines.append(f"| {step} | " + " | ".join(f"{v:+.1f}%" for v in values) + " |")
    return "\n".join(lines) + "\n"


def plot(frame: pd.DataFrame, path: Path) -> Path:
    """Learned and plug-in MMD² against training steps, one panel per data set, one colour per ``m``; the x ticks
    are the snapshot steps themselves, the legend (the same lines in every panel) sits once under the panels."""
    from matplotlib.ticker import NullFormatter

    from ..figstyle import DOUBLE_COLUMN, SINGLE_COLUMN, label_log_axis, paper_style

    datas = list(dict.fromkeys(frame["data"]))
    width = DOUBLE_COLUMN if len(datas) > 1 else SINGLE_COLUMN
    with paper_style():
        fig, axes = plt.subplots(1, len(datas), figsize=(width, 3.8), squeeze=False, layout="constrained")
        steps = sorted(set(frame["step"]))
        for ax, data in zip(axes[0], datas, strict=True):
            for i, m in enumerate(MS):
                part = frame[(frame["data"] == data) & (frame["m"] == m)].sort_values("step")
                ax.errorbar(part["step"], part["learned"], yerr=part["learned_sem"], marker="o", color=f"C{i}",
                            capsize=3, label=f"learned, m = {m}")  # fmt: skip
                ax.axhline(part["plugin"].iloc[0], color=f"C{i}", ls="--", lw=1, label=f"plug-in, m = {m}")
            ax.set(xscale="log", yscale="log", xlabel="training steps (constant lr)",
                   ylabel="MMD², generated vs reference", title=f"{data} (d = {DIM})")  # fmt: skip
            ax.set_xticks(steps, [f"{s:g}" for s in steps])
            ax.xaxis.set_minor_formatter(NullFormatter())
            label_log_axis(ax)
        handles, labels = axes[0, 0].get_legend_handles_labels()
        fig.legend(handles, labels, loc="outside lower center", ncols=3, frameon=False)
        fig.suptitle("MMD² against training length (bars: ± 1 s.e.m. over held-out tasks)")
        records = frame.to_dict(orient="records")
        return save_figure(fig, path, (plot, label_log_axis), records)


def redraw(record: dict, folder: Path) -> list[Path]:
    """:func:`plot` again from this study's ``record.json`` (its ``rows``), into ``folder/scarcity_steps.png``."""
    from .report import from_record

    return [plot(pd.DataFrame(from_record(record["rows"])), Path(folder) / "scarcity_steps.png")]


def main(argv: list[str] | None = None) -> None:  # pragma: no cover - a script
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=8000)
    parser.add_argument("--first", type=int, default=250, help="first snapshot step (then doubling)")
    parser.add_argument("--tier", default="full", choices=sorted(ALL_TIERS))
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--data", nargs="+", default=None, help="data sets (default: the tier's scarcity data)")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    measure(ALL_TIERS[args.tier], args.steps, args.out, not args.no_progress, args.first, args.data)
    # every data set measured into this folder so far (by this process or another one)
    frame = with_gains(pd.concat([pd.read_csv(p) for p in sorted(args.out.glob(f"rows-*-{args.steps}.csv"))]))
    frame.to_csv(args.out / "table.csv", index=False)
    (args.out / "table.md").write_text(
        f"Learned gain over the plug-in, (MMD²_plug-in − MMD²_learned) / MMD²_plug-in, tier `{args.tier}`, "
        f"constant lr after warm-up\n\n{table(frame)}"
    )
    plot(frame, args.out / "scarcity_steps.png")
    record = {
        "tier": args.tier,
        "steps": args.steps,
        "snapshots": snapshot_steps(args.steps, args.first),
        "threads": args.threads,
        "wall_time_s": round(time.perf_counter() - start, 1),
        "versions": versions(),
        "rows": frame.to_dict(orient="records"),
    }
    (args.out / "record.json").write_text(json.dumps(record, indent=1))
    print(table(frame))


if __name__ == "__main__":  # pragma: no cover
    main()
