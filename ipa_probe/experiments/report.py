"""Writers for experiment results: a table (markdown and CSV) with our figure beside the paper's, and a JSON record.

Figures are PNG files written by each experiment through :func:`save_figure` (matplotlib's Agg backend, no
display needed).
"""

from __future__ import annotations

import csv
import json
import math
import platform
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["ExperimentResult", "Row", "format_value", "save_figure", "versions", "write_result"]

TABLE_COLUMNS = ("quantity", "setting", "ours", "paper", "note")


@dataclass
class Row:
    """One line of a results table: our measurement beside the paper's figure.

    Attributes:
        quantity: what is measured (e.g. ``benefit``).
        setting: where (e.g. ``d=2``).
        ours: our value, formatted (with its spread).
        paper: the paper's value, or ``"—"`` where the paper gives none.
        note: how to read the row (the test, the direction, a deviation).
    """

    quantity: str
    setting: str
    ours: str
    paper: str = "—"
    note: str = ""


@dataclass
class ExperimentResult:
    """Everything one experiment produces.

    Attributes:
        name: experiment name.
        rows: the results table.
        record: JSON-serialisable record (configuration, seeds, raw measurements, training runs, wall time).
        figures: PNG files written.
    """

    name: str
    rows: list[Row]
    record: dict
    figures: list[Path] = field(default_factory=list)


def format_value(mean: float, spread: float | None = None, digits: int = 3, percent: bool = False) -> str:
    """``mean ± spread`` in a compact form (``n/a`` for NaN); percentages with a sign and ``%``."""
    if mean is None or (isinstance(mean, float) and math.isnan(mean)):
        return "n/a"
    if percent:
        text = f"{mean:+.1f}%"
        return text if spread is None or math.isnan(spread) else f"{text} ± {spread:.1f}"
    text = f"{mean:.{digits}g}"
    return text if spread is None or math.isnan(spread) else f"{text} ± {spread:.2g}"


def markdown_table(rows: list[Row]) -> str:
    """The rows as a GitHub markdown table."""
    lines = ["| " + " | ".join(TABLE_COLUMNS) + " |", "|" + "---|" * len(TABLE_COLUMNS)]
    for row in rows:
        cells = [str(getattr(row, c)).replace("|", "\\|") for c in TABLE_COLUMNS]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def versions() -> dict:
    """Versions of Python, the numerical libraries and this package, and the git commit when available."""
    import numpy
    import sklearn
    import torch

    from .. import __version__

    info = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numpy": numpy.__version__,
        "scikit-learn": sklearn.__version__,
        "ipa_probe": __version__,
        "platform": platform.platform(),
        "threads": torch.get_num_threads(),
    }
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=Path(__file__).parent, timeout=5
        )
        if commit.returncode == 0:
            info["git_commit"] = commit.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return info


def _jsonable(value):
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if hasattr(value, "tolist"):
        return _jsonable(value.tolist())
    return value


def write_result(result: ExperimentResult, folder: Path) -> dict[str, Path]:
    """Write ``table.md``, ``table.csv`` and ``record.json`` of ``result`` into ``folder``. Returns their paths."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = {"table_md": folder / "table.md", "table_csv": folder / "table.csv", "record": folder / "record.json"}
    paths["table_md"].write_text(f"### {result.name}\n\n" + markdown_table(result.rows))
    with paths["table_csv"].open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(TABLE_COLUMNS)
        for row in result.rows:
            writer.writerow([getattr(row, c) for c in TABLE_COLUMNS])
    record = dict(result.record, figures=[p.name for p in result.figures])
    paths["record"].write_text(json.dumps(_jsonable(record), indent=2) + "\n")
    return paths


def save_figure(fig, path: Path) -> Path:
    """Save a matplotlib figure as PNG and close it."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
