"""Writers for experiment results: a table (markdown and CSV) with our figure beside the paper's, and a JSON record.

Figures are PNG files written by each experiment through :func:`save_figure` (matplotlib's Agg backend, no
display needed).
"""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass, field
from pathlib import Path

from .._io import atomic_path, code_digest, data_digest, versions, write_atomic, write_figure, write_json

__all__ = [
    "ExperimentResult",
    "Row",
    "as_records",
    "format_value",
    "from_record",
    "save_figure",
    "versions",
    "write_result",
]

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


def write_result(result: ExperimentResult, folder: Path) -> dict[str, Path]:
    """Write ``table.md``, ``table.csv`` and ``record.json`` of ``result`` into ``folder``. Returns their paths."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = {"table_md": folder / "table.md", "table_csv": folder / "table.csv", "record": folder / "record.json"}
    write_atomic(paths["table_md"], f"### {result.name}\n\n" + markdown_table(result.rows))
    with atomic_path(paths["table_csv"]) as temp, temp.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(TABLE_COLUMNS)
        for row in result.rows:
            writer.writerow([getattr(row, c) for c in TABLE_COLUMNS])
    record = dict(result.record, figures=[p.name for p in result.figures])
    write_json(paths["record"], record)
    return paths


def save_figure(fig, path: Path, code=None, inputs=None) -> Path:
    """Save a matplotlib figure as PNG (atomically) and close it.

    With ``code`` (the drawing function, or a tuple of it and the helpers it calls), the PNG carries its provenance:
    the digest of that code's source and of ``inputs`` (the data it drew, as the experiment's ``record.json`` holds
    it), so that ``make figures`` can tell whether the figure is current and redraw it from the record (see
    ``ipa_probe.devtools.figures``). A figure drawn with a layout engine of its own (``layout="constrained"``, for a
    legend outside the panels) keeps it; any other is laid out tight.
    """
    if fig.get_layout_engine() is None:
        fig.tight_layout()
    functions = code if isinstance(code, tuple) else (code,)
    provenance = None if code is None else {"code": code_digest(*functions), "inputs": data_digest(inputs)}
    return write_figure(fig, path, provenance=provenance)


def as_records(value):
    """A figure's inputs as a ``record.json`` holds them: data frames as lists of row dicts, dicts walked through,
    anything else as it is (the digest of :func:`save_figure`'s ``inputs`` is taken of this form)."""
    if hasattr(value, "to_dict") and hasattr(value, "columns"):
        return value.to_dict(orient="records")
    if isinstance(value, dict):
        return {key: as_records(item) for key, item in value.items()}
    return value


def from_record(value):
    """Measurements as a ``record.json`` holds them, back in the form the experiment drew them: dict keys that
    are numbers become numbers again (JSON keys are strings) and ``None`` becomes NaN (JSON has no NaN)."""

    def key(text):
        for kind in (int, float):
            try:
                return kind(text)
            except (TypeError, ValueError):
                pass
        return text

    if isinstance(value, dict):
        return {key(k): from_record(v) for k, v in value.items()}
    if isinstance(value, list):
        return [from_record(v) for v in value]
    return math.nan if value is None else value
