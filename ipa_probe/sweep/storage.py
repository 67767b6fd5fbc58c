"""Where a sweep keeps its files: the Parquet dataset of row parts, written atomically, and JSON records."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd

from .._io import atomic_path

_PART_METADATA_KEY = b"ipa_probe.sweep"
_PART_PREFIX = "row-"


def _under(name: str) -> property:
    """A read-only attribute: the path ``root / name``."""
    return property(lambda self: self.root / name, doc=f"``root / {name!r}``")


@dataclass(frozen=True)
class SweepLayout:
    """Where a sweep keeps its files under ``root``.

    ``rows/row-000000.parquet, ...``: the Parquet dataset, one part per row of the current manifest (hidden temp
    files while writing); ``skipped/``: rows that failed at run time (one JSON each, with the line and the reason);
    ``set_aside/``: parts moved out of ``rows/`` because they no longer belong to the manifest (the row left it, its
    images changed, ``--restart``) or are damaged, kept rather than deleted; ``row_summary.parquet``: per row and
    timestep means; ``aggregate.parquet``: per timestep over rows, with the bootstrap interval; ``summary.json``; the
    plot ``rho_by_timestep.png``; ``.ipa_probe.lock``: held while a sweep writes (see :func:`~.._io.output_lock`).
    """

    root: Path

    rows = _under("rows")
    skipped = _under("skipped")
    set_aside = _under("set_aside")
    row_summary = _under("row_summary.parquet")
    aggregate = _under("aggregate.parquet")
    summary = _under("summary.json")
    plot = _under("rho_by_timestep.png")

    def part(self, row: int) -> Path:
        return self.rows / f"{_PART_PREFIX}{row:06d}.parquet"

    def skip_record(self, row: int) -> Path:
        return self.skipped / f"{_PART_PREFIX}{row:06d}.json"

    def parts(self) -> list[Path]:
        """Every part file present, in row order."""
        if not self.rows.is_dir():
            return []
        return sorted(p for p in self.rows.glob(f"{_PART_PREFIX}*.parquet"))

    def temp_files(self) -> list[Path]:
        """Hidden temp files of unfinished writes (in ``rows/``, ``skipped/`` and the root)."""
        folders = (self.rows, self.skipped, self.root)
        return sorted(p for folder in folders if folder.is_dir() for p in folder.glob(".*.tmp"))

    def set_part_aside(self, path: Path, why: str) -> Path:
        """Move a part out of ``rows/`` into ``set_aside/`` (named after its row and ``why``), keeping its bytes."""
        self.set_aside.mkdir(parents=True, exist_ok=True)
        target = self.set_aside / f"{path.stem}.{why}.parquet"
        counter = 1
        while target.exists():
            target = self.set_aside / f"{path.stem}.{why}-{counter}.parquet"
            counter += 1
        os.replace(path, target)
        return target


def write_part(table: pd.DataFrame, path: str | os.PathLike, metadata: dict[str, Any]) -> Path:
    """Write one row's table as a Parquet file, atomically: readers see the whole file or none.

    The table goes to a hidden temp file in the same folder (``pyarrow.dataset`` skips names starting with a dot),
    which is renamed onto ``path`` only once written and flushed; an error or interrupt removes the temp file.

    Args:
        table: the row's table.
        path: the part file.
        metadata: JSON-able; stored in the Parquet schema metadata (read back by :func:`_part_metadata`).

    Returns:
        ``path``.
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = Path(path)
    arrow = pa.Table.from_pandas(table, preserve_index=False)
    meta = dict(arrow.schema.metadata or {})
    metadata = {**metadata, "table_rows": arrow.num_rows}
    meta[_PART_METADATA_KEY] = json.dumps(metadata, sort_keys=True, default=str).encode()
    arrow = arrow.replace_schema_metadata(meta)
    with atomic_path(path) as temp:
        pq.write_table(arrow, temp, write_page_checksum=True)  # a damaged page is caught when read back
    return path


def read_part(path: str | os.PathLike) -> pd.DataFrame:
    """Read one part whole, verifying every page's checksum.

    Raises:
        DamagedPart: the file cannot be read back as written (truncated, overwritten, a page checksum fails, or its
            row count differs from the one recorded when it was written).
    """
    import pyarrow.parquet as pq

    path = Path(path)
    try:
        table = pq.read_table(path, page_checksum_verification=True)
    except (OSError, ValueError) as err:  # pyarrow raises ArrowInvalid (a ValueError) or OSError for damaged data
        reason = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise DamagedPart(f"{path.name} cannot be read back ({reason})") from None
    meta = json.loads((table.schema.metadata or {}).get(_PART_METADATA_KEY, b"{}"))
    expected = meta.get("table_rows")
    if expected is not None and expected != table.num_rows:
        raise DamagedPart(f"{path.name} holds {table.num_rows} table rows, {expected} were written")
    return table.to_pandas()


class DamagedPart(ValueError):
    """A part file that cannot be read back as written."""


def _part_metadata(path: Path) -> dict[str, Any] | None:
    """The sweep metadata of a part file; ``None`` when the file is unreadable or was not written by a sweep."""
    import pyarrow.parquet as pq

    try:
        meta = pq.read_schema(path).metadata or {}
        raw = meta.get(_PART_METADATA_KEY)
        return json.loads(raw) if raw else None
    except (OSError, ValueError):  # pyarrow raises ArrowInvalid (a ValueError) for damaged files; bad JSON too
        return None


def load_table(out: str | os.PathLike, rows: Sequence[int] | None = None) -> pd.DataFrame:
    """The sweep's results as one table, in row order (all parts, or those of ``rows``).

    Equivalent to ``pd.read_parquet(out / "rows")`` up to row order (``rows/`` holds only rows of the manifest the
    last sweep ran); reads each part once.

    Raises:
        FileNotFoundError: ``out`` holds no results (run the sweep first).
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    layout = SweepLayout(Path(out))
    parts = layout.parts() if rows is None else [layout.part(r) for r in sorted(rows) if layout.part(r).is_file()]
    if not parts:
        raise FileNotFoundError(f"no sweep results under {str(layout.rows)!r}; run `ipa-probe sweep` first")
    table = pa.concat_tables([pq.read_table(p) for p in parts], promote_options="default").to_pandas()
    return table.reset_index(drop=True)
