"""Sweeps: run the probe once per manifest row, keep every row's table, and aggregate over rows per timestep.

A *manifest* lists runs, one per row: a prompt, reference images, a seed and, optionally, the IP-Adapter scale, the
number of denoising steps and the NW bandwidth. :func:`read_manifest` parses JSON Lines or CSV and sets aside rows
it cannot run (unknown key, missing or unreadable image, bad value), each with its line number.

:func:`run_sweep` runs the rows with a :class:`SweepRunner` and writes one Parquet part file per row into
``OUT/rows/`` (atomically: a hidden temp file, then a rename), so the folder is one Parquet dataset that pandas,
pyarrow, polars or DuckDB read whole, with a ``row`` column. Rows already written are skipped when a sweep is run
again, so an interrupted sweep resumes where it stopped. Each row's seed is fixed by the manifest (or by the base seed
plus the row index), so the table does not depend on which process ran which row: under ``accelerate launch`` the
rows are split between processes with accelerate's ``PartialState.split_between_processes`` and the main process
merges the parts after ``wait_for_everyone``.

The merge reads one part at a time (memory stays bounded by one row's table) and reduces each to its per-timestep
means (:func:`~.capture.report.summarize`). :func:`aggregate` then averages those over rows, per CFG branch and
timestep, with a bootstrap confidence interval over rows for the mean per-row Spearman (paper §A.5, §D.4: the
statistic of a sweep is a mean over images, layers and heads at each timestep).
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import logging
import math
import os
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from ..capture.report import style_timestep_axes, summarize, versions
from ..images import IMAGE_SUFFIXES, load_images

__all__ = [
    "MANIFEST_KEYS",
    "Manifest",
    "ManifestError",
    "ManifestRow",
    "RowDefaults",
    "RowInputError",
    "RowSettings",
    "SkippedRow",
    "SweepLayout",
    "SweepResult",
    "SweepRunner",
    "aggregate",
    "bootstrap_ci",
    "load_table",
    "parse_bandwidth",
    "plot_aggregate",
    "read_manifest",
    "row_summary",
    "run_sweep",
    "write_part",
]

logger = logging.getLogger(__name__)

#: Keys a manifest row may have. All are optional: a row leaves out what the sweep's defaults should fill in.
MANIFEST_KEYS: tuple[str, ...] = ("prompt", "images", "seed", "scale", "steps", "bandwidth")

#: In a CSV manifest, several images in one cell are separated by one of these (a comma separates cells).
CSV_IMAGE_SEPARATORS: tuple[str, ...] = (";", "|")

_JSONL_SUFFIXES = (".jsonl", ".ndjson", ".json")
_CSV_SUFFIXES = (".csv",)
_PART_METADATA_KEY = b"ipa_probe.sweep"
_PART_PREFIX = "row-"
_BOOL_NAMES = ("true", "false")


class ManifestError(ValueError):
    """The manifest as a whole cannot be used (empty, not JSON Lines or CSV, a CSV header with unknown columns)."""


class RowInputError(ValueError):
    """One row cannot run because of its input (e.g. an image that fails to load); the sweep skips it and goes on."""


# ---------------------------------------------------------------------------------------------------- the manifest


@dataclass(frozen=True)
class ManifestRow:
    """One valid manifest row, as written (``None``: the row leaves that key to the sweep's defaults).

    Args:
        row: position of the row among the manifest's rows, from 0 (skipped rows count, so a row keeps its index
            when an earlier row is fixed). This is the ``row`` column of the results.
        line: 1-based line of the manifest file where the row starts.
        prompt: the text prompt.
        images: reference image files, folders already expanded and paths resolved against the manifest's folder.
        seed: generator seed (also seeds the probe's permutation null).
        scale: IP-Adapter scale (``pipe.set_ip_adapter_scale``).
        steps: denoising steps.
        bandwidth: ``"matched"``, ``"fit"`` or a positive NW bandwidth ``h``.
    """

    row: int
    line: int
    prompt: str | None = None
    images: tuple[str, ...] | None = None
    seed: int | None = None
    scale: float | None = None
    steps: int | None = None
    bandwidth: str | float | None = None


@dataclass(frozen=True)
class SkippedRow:
    """A manifest row that was not run, and why."""

    row: int
    line: int
    reason: str

    def describe(self) -> str:
        return f"line {self.line} (row {self.row}): {self.reason}"


@dataclass
class Manifest:
    """A parsed manifest: the rows to run and the rows set aside."""

    path: Path
    format: str  # "jsonl" or "csv"
    rows: list[ManifestRow]
    skipped: list[SkippedRow]

    @property
    def total(self) -> int:
        """How many rows the file holds, valid or not."""
        return len(self.rows) + len(self.skipped)


def parse_bandwidth(value: Any) -> str | float:
    """``"matched"``, ``"fit"`` or a positive finite float (a numeric string is converted).

    Raises:
        ValueError: anything else, with the accepted forms in the message.
    """
    if isinstance(value, str):
        text = value.strip()
        if text in ("matched", "fit"):
            return text
        try:
            value = float(text)
        except ValueError:
            raise ValueError(f"bandwidth: expected 'matched', 'fit' or a positive number, got {value!r}") from None
    if isinstance(value, bool) or not isinstance(value, int | float) or not (math.isfinite(value) and value > 0):
        raise ValueError(f"bandwidth: expected 'matched', 'fit' or a positive number, got {value!r}")
    return float(value)


def _parse_int(value: Any, key: str, minimum: int) -> int:
    if isinstance(value, str):
        try:
            value = int(value.strip())
        except ValueError:
            raise ValueError(f"{key}: expected an integer, got {value!r}") from None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{key}: expected an integer, got {value!r}")
    if value < minimum:
        raise ValueError(f"{key}: expected an integer >= {minimum}, got {value}")
    return value


def _parse_float(value: Any, key: str) -> float:
    if isinstance(value, str):
        try:
            value = float(value.strip())
        except ValueError:
            raise ValueError(f"{key}: expected a number, got {value!r}") from None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"{key}: expected a finite number, got {value!r}")
    return float(value)


def _image_files(value: Any, base: Path, separated: bool) -> tuple[str, ...]:
    """Resolve an ``images`` entry to image files that exist and that PIL recognises."""
    from PIL import Image, UnidentifiedImageError

    if isinstance(value, str):
        items = [value]
        if separated:
            for sep in CSV_IMAGE_SEPARATORS:
                items = [part for item in items for part in item.split(sep)]
    elif isinstance(value, list) and all(isinstance(v, str) for v in value):
        items = list(value)
    else:
        raise ValueError(f"images: expected a path, a folder or a list of paths, got {value!r}")
    items = [item.strip() for item in items if item.strip()]
    if not items:
        raise ValueError("images: empty; give at least one image file or folder")
    files: list[Path] = []
    for item in items:
        path = Path(item).expanduser()
        path = path if path.is_absolute() else base / path
        if path.is_dir():
            found = sorted(p for p in path.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES and p.is_file())
            if not found:
                raise ValueError(f"image folder {item!r} holds no image files ({', '.join(IMAGE_SUFFIXES)})")
            files.extend(found)
        elif not path.exists():
            hint = "; give several images as a JSON list" if not separated and any(s in item for s in "|;") else ""
            raise ValueError(f"image {item!r} does not exist (looked for {str(path)!r}){hint}")
        else:
            files.append(path)
    for path in files:
        try:
            with Image.open(path):  # reads the header only: cheap, and catches files that are not images
                pass
        except (UnidentifiedImageError, OSError) as err:
            reason = err.__class__.__name__
            raise ValueError(f"image {str(path)!r} cannot be read ({reason}); pass a PNG or JPEG file") from None
    return tuple(str(p) for p in files)


def _parse_row(raw: dict[str, Any], row: int, line: int, base: Path, csv_cells: bool) -> ManifestRow:
    """Validate one row's values; raises ValueError naming the first bad key."""
    unknown = sorted(set(raw) - set(MANIFEST_KEYS))
    if unknown:
        raise ValueError(
            f"unknown key(s) {', '.join(map(repr, unknown))}; expected some of {', '.join(MANIFEST_KEYS)}"
        )
    values = {k: v for k, v in raw.items() if v is not None and not (isinstance(v, str) and not v.strip())}
    prompt = values.get("prompt")
    if prompt is not None and not isinstance(prompt, str):
        raise ValueError(f"prompt: expected a string, got {prompt!r}")
    return ManifestRow(
        row=row,
        line=line,
        prompt=prompt,
        images=_image_files(values["images"], base, csv_cells) if "images" in values else None,
        seed=_parse_int(values["seed"], "seed", 0) if "seed" in values else None,
        scale=_parse_float(values["scale"], "scale") if "scale" in values else None,
        steps=_parse_int(values["steps"], "steps", 1) if "steps" in values else None,
        bandwidth=parse_bandwidth(values["bandwidth"]) if "bandwidth" in values else None,
    )


def _jsonl_records(text: str) -> Iterator[tuple[int, dict[str, Any] | None, str | None]]:
    """(line, object or None, error or None) for each non-blank line."""
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except json.JSONDecodeError as err:
            yield number, None, f"not valid JSON ({err.msg} at column {err.colno})"
            continue
        if not isinstance(value, dict):
            yield number, None, f"expected a JSON object {{...}}, got {type(value).__name__}"
            continue
        yield number, value, None


def _csv_records(text: str, name: str) -> Iterator[tuple[int, dict[str, Any] | None, str | None]]:
    reader = csv.reader(io.StringIO(text))
    header: list[str] | None = None
    end = 0
    for cells in reader:
        start, end = end + 1, reader.line_num
        if not any(cell.strip() for cell in cells):
            continue
        if header is None:
            header = [cell.strip() for cell in cells]
            unknown = [h for h in header if h not in MANIFEST_KEYS]
            if unknown or len(set(header)) != len(header):
                problem = f"unknown column(s) {', '.join(map(repr, unknown))}" if unknown else "repeated column names"
                raise ManifestError(
                    f"manifest {name!r} line {start}: {problem} in the CSV header; "
                    f"use some of {', '.join(MANIFEST_KEYS)}"
                )
            continue
        if len(cells) != len(header):
            yield start, None, f"{len(cells)} cells but the header names {len(header)} columns"
            continue
        yield start, dict(zip(header, cells, strict=True)), None


def _looks_like_csv_header(first_line: str) -> bool:
    cells = [cell.strip() for cell in next(csv.reader([first_line]), [])]
    return bool(cells) and all(cell in MANIFEST_KEYS for cell in cells)


def read_manifest(path: str | os.PathLike, *, require_images: bool = False) -> Manifest:
    """Parse a sweep manifest (JSON Lines or CSV) and validate every row.

    JSON Lines: one object per line, e.g. ``{"prompt": "a cat", "images": ["refs/a.png", "refs/b.png"], "seed": 3}``;
    ``images`` is a path, a folder or a list of them. CSV: a header row naming some of :data:`MANIFEST_KEYS`, then one
    row per run; several images in one cell are separated by ``;`` or ``|``. Blank lines are ignored; an empty cell
    or a JSON ``null`` means "use the default". Relative image paths are resolved against the manifest's folder.
    The format follows the suffix (``.jsonl``/``.ndjson``/``.json``, ``.csv``) or, for other names, the content.

    A row with an unknown key, a missing or unreadable image, or a bad value is not run: it is listed in
    :attr:`Manifest.skipped` with its line number (and logged as a warning by :func:`run_sweep`).

    Args:
        path: the manifest file.
        require_images: also skip rows without ``images`` (when the sweep has no default reference images).

    Returns:
        a :class:`Manifest`.

    Raises:
        ManifestError: the file is missing, empty, not text, neither JSON Lines nor CSV, or its CSV header names
            unknown columns: nothing can be run.
    """
    path = Path(path)
    name = str(path)
    if not path.is_file():
        raise ManifestError(f"manifest {name!r} does not exist; pass a JSON Lines or CSV file")
    try:
        text = path.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError:
        raise ManifestError(f"manifest {name!r} is not UTF-8 text; expected JSON Lines or CSV") from None
    except OSError as err:
        raise ManifestError(f"manifest {name!r} cannot be read ({err.strerror or err})") from None
    lines = [line for line in text.splitlines() if line.strip()]
    if not lines:
        raise ManifestError(f"manifest {name!r} is empty; expected one row per run (JSON Lines or CSV)")
    suffix = path.suffix.lower()
    first = lines[0].lstrip()
    if suffix in _JSONL_SUFFIXES or (suffix not in _CSV_SUFFIXES and first.startswith("{")):
        fmt, records = "jsonl", list(_jsonl_records(text))
        if all(value is None for _, value, _ in records):
            hint = " (a JSON array: write one object per line instead)" if first.startswith("[") else ""
            raise ManifestError(
                f"manifest {name!r} is not JSON Lines{hint}: line {records[0][0]}: {records[0][2]}; "
                'expected one JSON object per line, e.g. {"prompt": "a cat", "images": "refs/", "seed": 0}'
            )
    elif suffix in _CSV_SUFFIXES or _looks_like_csv_header(lines[0]):
        fmt, records = "csv", list(_csv_records(text, name))
        if not records:
            raise ManifestError(f"manifest {name!r} has a CSV header but no rows; add one row per run")
    else:
        raise ManifestError(
            f"manifest {name!r} is neither JSON Lines (one {{...}} object per line) nor CSV (a header row naming "
            f"some of {', '.join(MANIFEST_KEYS)}); see `ipa-probe sweep --help`"
        )
    rows: list[ManifestRow] = []
    skipped: list[SkippedRow] = []
    for index, (line, raw, error) in enumerate(records):
        if raw is not None:
            try:
                parsed = _parse_row(raw, index, line, path.parent, csv_cells=fmt == "csv")
                if require_images and parsed.images is None:
                    raise ValueError("no 'images' and no default reference images (--image); add images")
            except ValueError as err:
                error = str(err)
            else:
                rows.append(parsed)
                continue
        skipped.append(SkippedRow(index, line, error))
    return Manifest(path=path, format=fmt, rows=rows, skipped=skipped)


# ---------------------------------------------------------------------------------------------------- running rows


@dataclass(frozen=True)
class RowDefaults:
    """What a row gets for the keys it leaves out.

    Args:
        prompt: the prompt.
        seed: base seed; a row without ``seed`` uses ``seed + row`` (rows differ, and each is reproducible alone).
        scale: IP-Adapter scale.
        steps: denoising steps.
        bandwidth: ``"matched"``, ``"fit"`` or a positive ``h``.
    """

    prompt: str = "a photo"
    seed: int = 0
    scale: float = 1.0
    steps: int = 10
    bandwidth: str | float = "matched"

    def __post_init__(self) -> None:
        if not isinstance(self.prompt, str):
            raise TypeError(f"prompt: expected a string, got {type(self.prompt).__name__}")
        object.__setattr__(self, "seed", _parse_int(self.seed, "seed", 0))
        object.__setattr__(self, "scale", _parse_float(self.scale, "scale"))
        object.__setattr__(self, "steps", _parse_int(self.steps, "steps", 1))
        object.__setattr__(self, "bandwidth", parse_bandwidth(self.bandwidth))


@dataclass(frozen=True)
class RowSettings:
    """A row with every default filled in: exactly what runs. ``images`` is ``None`` for the default images."""

    row: int
    prompt: str
    images: tuple[str, ...] | None
    seed: int
    scale: float
    steps: int
    bandwidth: str | float


class SweepRunner:
    """Runs manifest rows on one pipeline with the probe on; one instance per process.

    Args:
        pipe: a diffusers SD / SDXL pipeline with an IP-Adapter loaded (see :func:`ipa_probe.probe`).
        defaults: values for the keys a row leaves out.
        default_images: reference images for rows without ``images`` (PIL images); ``None``: such rows fail.
        layers, heads: passed to :func:`ipa_probe.probe`.
        call_kwargs: further pipeline arguments for every row (``height``, ``width``, ``guidance_scale``, ...);
            ``prompt``, ``num_inference_steps``, ``generator`` and ``ip_adapter_image`` come from the row.
        settings: a JSON-able description of the model and options; part of each row's fingerprint, so rows written
            under other settings are recognised (:func:`run_sweep` refuses to mix them).

    Subclass and override :meth:`run_row` to run rows differently (tests use this to interrupt a sweep).
    """

    def __init__(
        self,
        pipe,
        defaults: RowDefaults | None = None,
        *,
        default_images: Sequence | None = None,
        layers: str | Sequence[str] | None = None,
        heads: Sequence[int] | None = None,
        call_kwargs: dict[str, Any] | None = None,
        settings: dict[str, Any] | None = None,
    ) -> None:
        reserved = {"prompt", "num_inference_steps", "generator", "ip_adapter_image"} & set(call_kwargs or {})
        if reserved:
            raise ValueError(f"call_kwargs: {sorted(reserved)} come from each manifest row; remove them")
        self.pipe = pipe
        self.defaults = defaults or RowDefaults()
        self.default_images = list(default_images) if default_images is not None else None
        self.layers = layers
        self.heads = tuple(heads) if heads is not None else None
        self.call_kwargs = dict(call_kwargs or {})
        self.settings = dict(settings or {})

    def resolve(self, row: ManifestRow) -> RowSettings:
        """The row's settings with the defaults filled in."""
        d = self.defaults
        return RowSettings(
            row=row.row,
            prompt=row.prompt if row.prompt is not None else d.prompt,
            images=row.images,
            seed=row.seed if row.seed is not None else d.seed + row.row,
            scale=row.scale if row.scale is not None else d.scale,
            steps=row.steps if row.steps is not None else d.steps,
            bandwidth=row.bandwidth if row.bandwidth is not None else d.bandwidth,
        )

    def fingerprint(self, row: ManifestRow) -> str:
        """A short hash of everything that shapes this row's table (row settings, model, options)."""
        record = {
            "row": asdict(self.resolve(row)),
            "settings": self.settings,
            "layers": self.layers,
            "heads": self.heads,
            "call_kwargs": self.call_kwargs,
        }
        text = json.dumps(record, sort_keys=True, default=str)
        return hashlib.sha256(text.encode()).hexdigest()[:20]

    def _images(self, settings: RowSettings) -> list:
        if settings.images is None:
            if self.default_images is None:
                raise RowInputError("no 'images' in the row and no default reference images; add images")
            return self.default_images
        try:
            return load_images(list(settings.images))
        except (OSError, ValueError, TypeError) as err:
            raise RowInputError(str(err)) from None

    def run_row(self, row: ManifestRow) -> pd.DataFrame:
        """Generate once with the probe on and return the probe's tidy table with ``row``, ``seed``, ``scale`` first.

        Raises:
            RowInputError: the row's images cannot be loaded (the sweep skips the row).
        """
        import torch

        from ..capture.run import probe

        settings = self.resolve(row)
        images = self._images(settings)
        pipe = self.pipe
        pipe.set_ip_adapter_scale(settings.scale)  # every row sets it: no scale leaks from the previous row
        generator = torch.Generator(device=pipe.device).manual_seed(settings.seed)
        kwargs = {"output_type": "latent", **self.call_kwargs}  # the probe reads the denoiser; no need to decode
        with probe(
            pipe, bandwidth=settings.bandwidth, layers=self.layers, heads=self.heads, seed=settings.seed
        ) as run:
            pipe(
                prompt=settings.prompt,
                ip_adapter_image=[images],
                num_inference_steps=settings.steps,
                generator=generator,
                **kwargs,
            )
        table = run.to_dataframe()
        table.insert(0, "row", np.int64(row.row))
        table.insert(1, "seed", np.int64(settings.seed))
        table.insert(2, "scale", float(settings.scale))
        return table


# ---------------------------------------------------------------------------------------------------- storage


@dataclass(frozen=True)
class SweepLayout:
    """Where a sweep keeps its files under ``root``.

    ``rows/row-000000.parquet, ...``: the Parquet dataset, one part per manifest row (hidden temp files while writing);
    ``skipped/``: rows skipped at run time (one JSON each); ``row_summary.parquet``: per row and timestep means;
    ``aggregate.parquet``: per timestep over rows, with the bootstrap interval; ``summary.json``; the plot
    ``rho_by_timestep.png``.
    """

    root: Path

    @property
    def rows(self) -> Path:
        return self.root / "rows"

    @property
    def skipped(self) -> Path:
        return self.root / "skipped"

    @property
    def row_summary(self) -> Path:
        return self.root / "row_summary.parquet"

    @property
    def aggregate(self) -> Path:
        return self.root / "aggregate.parquet"

    @property
    def summary(self) -> Path:
        return self.root / "summary.json"

    @property
    def plot(self) -> Path:
        return self.root / "rho_by_timestep.png"

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
        return sorted(p for folder in (self.rows, self.skipped) if folder.is_dir() for p in folder.glob(".*.tmp"))


@contextmanager
def _atomic_path(path: Path) -> Iterator[Path]:
    """Yield a hidden temp path beside ``path``; on success rename it onto ``path``, on any exit remove it."""
    temp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        yield temp
        with open(temp, "rb+") as handle:  # flushed to disk before the rename makes it visible
            os.fsync(handle.fileno())
        os.replace(temp, path)
    finally:
        temp.unlink(missing_ok=True)


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
    meta[_PART_METADATA_KEY] = json.dumps(metadata, sort_keys=True, default=str).encode()
    arrow = arrow.replace_schema_metadata(meta)
    with _atomic_path(path) as temp:
        pq.write_table(arrow, temp)
    return path


def _part_metadata(path: Path) -> dict[str, Any] | None:
    """The sweep metadata of a part file; ``None`` when the file is unreadable or was not written by a sweep."""
    import pyarrow.parquet as pq

    try:
        meta = pq.read_schema(path).metadata or {}
    except (OSError, ValueError):  # pyarrow raises ArrowInvalid (a ValueError) for damaged files
        return None
    raw = meta.get(_PART_METADATA_KEY)
    return json.loads(raw) if raw else None


def _write_json(path: Path, record: dict[str, Any]) -> None:
    with _atomic_path(path) as temp:
        temp.write_text(json.dumps(_jsonable(record), indent=2))


def _jsonable(value):
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, Path):
        return str(value)
    return value


def load_table(out: str | os.PathLike, rows: Sequence[int] | None = None) -> pd.DataFrame:
    """The sweep's results as one table, in row order (all parts, or those of ``rows``).

    Equivalent to ``pd.read_parquet(out / "rows")`` up to row order; reads each part once.

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


# ---------------------------------------------------------------------------------------------------- aggregation


def bootstrap_ci(
    values: np.ndarray, confidence: float = 0.95, n_resamples: int = 9999, rng: np.random.Generator | None = None
) -> tuple[float, float]:
    """Bootstrap confidence interval of the mean of ``values`` (``scipy.stats.bootstrap``, BCa).

    Falls back to the percentile method when BCa is undefined; returns ``(nan, nan)`` for fewer than two finite values
    and ``(v, v)`` when all values equal ``v``.

    Args:
        values: shape ``(n,)``; non-finite entries are dropped.
        confidence: two-sided confidence level in (0, 1).
        n_resamples: bootstrap resamples.
        rng: the random generator (default: seeded with 0, so the interval is reproducible).

    Returns:
        ``(low, high)``.
    """
    import inspect

    from scipy import stats

    if not 0 < confidence < 1:
        raise ValueError(f"confidence: expected a level in (0, 1), e.g. 0.95, got {confidence}")
    x = np.asarray(values, dtype=np.float64)
    x = x[np.isfinite(x)]
    if x.size < 2:
        return math.nan, math.nan
    if np.ptp(x) == 0:
        return float(x[0]), float(x[0])
    rng = rng if rng is not None else np.random.default_rng(0)
    # scipy >= 1.15 names the generator `rng`; older releases `random_state`
    key = "rng" if "rng" in inspect.signature(stats.bootstrap).parameters else "random_state"
    for method in ("BCa", "percentile"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            result = stats.bootstrap(
                (x,), np.mean, confidence_level=confidence, n_resamples=n_resamples, method=method, **{key: rng}
            )
        low, high = result.confidence_interval
        if math.isfinite(low) and math.isfinite(high):
            return float(low), float(high)
    return math.nan, math.nan


def row_summary(table: pd.DataFrame, threshold: float = 0.9) -> pd.DataFrame:
    """Per-timestep means of one row's table (:func:`~.capture.report.summarize`) plus ``row``, ``seed``, ``scale``."""
    summary = summarize(table, threshold=threshold)
    if summary.empty:
        return summary
    for position, key in enumerate(("row", "seed", "scale")):
        summary.insert(position, key, table[key].iloc[0])
    return summary


def aggregate(
    per_row: pd.DataFrame,
    *,
    threshold: float = 0.9,
    confidence: float = 0.95,
    n_resamples: int = 9999,
    seed: int = 0,
) -> pd.DataFrame:
    """Average per-row summaries over rows, per CFG branch and timestep.

    Each manifest row counts once: its Spearman is the mean over its layers, heads and adapters of the per-row
    (per latent pixel) Spearman rho between the attention weights and the NW weights (paper §D.4,
    ``per_row_spearman_mean``), and the interval is a bootstrap over rows of the mean of those values.

    Args:
        per_row: rows of :func:`row_summary` for many manifest rows (columns ``row``, ``branch``, ``timestep``,
            ``spearman``, ``pearson``, ``spearman_null``, ``frac_rho_gt_<threshold>``, ...).
        threshold: the rho threshold used when ``per_row`` was made.
        confidence: confidence level of the interval.
        n_resamples: bootstrap resamples.
        seed: seeds the bootstrap, group by group (the result does not depend on the order of ``per_row``).

    Returns:
        one row per (branch, timestep), timesteps in denoising order (high to low): ``rows`` (how many manifest rows
        reached it), ``spearman`` (mean over rows), ``spearman_ci_low``, ``spearman_ci_high``, ``spearman_std``
        (over rows), ``pearson``, ``frac_rho_gt_<threshold>`` (mean over rows of the fraction of layer x head cells
        with rho above the threshold), ``spearman_null`` (the permutation null), ``kl``, ``top1``, ``neff_attn``,
        ``neff_nw``, ``q_norm``, ``bandwidth`` (means) and ``nonfinite`` (max).
    """
    frac = f"frac_rho_gt_{threshold:g}"
    means = ["pearson", frac, "spearman_null", "kl", "top1", "neff_attn", "neff_nw", "q_norm", "bandwidth"]
    columns = ["branch", "timestep", "rows", "spearman", "spearman_ci_low", "spearman_ci_high", "spearman_std"]
    columns += [*means, "nonfinite"]
    if per_row.empty:
        return pd.DataFrame({c: pd.Series(dtype="float64") for c in columns})
    missing = [c for c in ("row", "branch", "timestep", "spearman", *means) if c not in per_row.columns]
    if missing:
        raise ValueError(f"per_row: missing column(s) {missing}; make it with row_summary(..., threshold={threshold})")
    records = []
    ordered = per_row.sort_values(["branch", "timestep", "row"], ascending=[True, False, True], kind="stable")
    for index, ((branch, timestep), group) in enumerate(ordered.groupby(["branch", "timestep"], sort=False)):
        rho = group["spearman"].to_numpy(np.float64)
        low, high = bootstrap_ci(rho, confidence, n_resamples, np.random.default_rng([seed, index]))
        finite = rho[np.isfinite(rho)]
        record = {
            "branch": branch,
            "timestep": float(timestep),
            "rows": int(group["row"].nunique()),
            "spearman": float(finite.mean()) if finite.size else math.nan,
            "spearman_ci_low": low,
            "spearman_ci_high": high,
            "spearman_std": float(finite.std(ddof=1)) if finite.size > 1 else math.nan,
        }
        record.update({key: float(group[key].mean()) for key in means})
        record["nonfinite"] = float(group["nonfinite"].max()) if "nonfinite" in group else math.nan
        records.append(record)
    return pd.DataFrame.from_records(records, columns=columns)


def plot_aggregate(agg: pd.DataFrame, ax=None, branch: str = "cond", confidence: float = 0.95):
    """Mean per-row Spearman over rows with its bootstrap interval as a band, Pearson, rho > 0.9 and the null.

    The x axis runs in the denoising direction (high timestep on the left). Falls back to the only branch present
    when ``branch`` is absent (a sweep without CFG has only ``"cond"``).
    """
    import matplotlib.pyplot as plt

    if ax is None:
        fig, ax = plt.subplots(figsize=(6, 3.6))
    else:
        fig = ax.figure
    part = agg[agg["branch"] == branch] if not agg.empty else agg
    if part.empty and not agg.empty:
        branch = str(agg["branch"].iloc[0])
        part = agg[agg["branch"] == branch]
    if not part.empty:
        part = part.sort_values("timestep", ascending=False)
        x = part["timestep"].to_numpy(np.float64)
        frac = next((c for c in part.columns if c.startswith("frac_rho_gt_")), None)
        ax.plot(x, part["spearman"], marker="o", label="Spearman ρ (mean over rows)")
        ax.fill_between(
            x,
            part["spearman_ci_low"].to_numpy(np.float64),
            part["spearman_ci_high"].to_numpy(np.float64),
            alpha=0.25,
            label=f"{confidence:.0%} bootstrap CI",
        )
        ax.plot(x, part["pearson"], marker=".", linestyle="--", label="Pearson r")
        if frac is not None:
            ax.plot(x, part[frac], linestyle="-.", label=f"fraction ρ > {frac.removeprefix('frac_rho_gt_')}")
        ax.plot(x, part["spearman_null"], color="grey", linestyle=":", label="permutation null")
        rows = int(part["rows"].max())
        ax.set_title(f"IP-Adapter attention vs Gaussian NW, {rows} row(s) ({branch} branch)")
    else:
        ax.set_title("IP-Adapter attention vs Gaussian NW (no rows)")
    style_timestep_axes(ax)
    ax.legend(fontsize=8, loc="lower left")
    fig.tight_layout()
    return fig


# ---------------------------------------------------------------------------------------------------- the sweep


@dataclass
class SweepResult:
    """What a sweep did. Complete on the main process; elsewhere only ``out``, ``rows``, ``resumed``, ``processes``
    and ``seconds`` are filled in (``done``, ``ran`` are 0 and the tables ``None``).

    Attributes:
        out: the output folder.
        rows: valid manifest rows.
        done: rows with results now.
        ran: rows computed by this call (all processes).
        resumed: rows already written before this call.
        skipped: rows not run (manifest problems and rows skipped at run time), in row order.
        processes: how many processes shared the rows.
        seconds: wall time of the row loop (from the split to the last process finishing).
        rows_by_process: process index -> rows it computed in this call (main process only).
    """

    out: Path
    rows: int
    done: int
    ran: int
    resumed: int
    skipped: list[SkippedRow]
    processes: int
    seconds: float
    rows_by_process: dict[int, list[int]] = field(default_factory=dict)
    row_summary: pd.DataFrame | None = None
    aggregate: pd.DataFrame | None = None
    threshold: float = 0.9

    def describe(self) -> str:
        """One line: rows done, resumed, skipped, and the statistics at the last timestep of the cond branch."""
        line = f"sweep: {self.done}/{self.rows} rows done ({self.ran} now, {self.resumed} resumed"
        line += f", {self.processes} process{'es' if self.processes > 1 else ''}"
        if self.ran and self.seconds > 0:
            line += f", {60 * self.ran / self.seconds:.1f} rows/min"
        line += ")"
        if self.skipped:
            lines = ", ".join(str(s.line) for s in self.skipped[:10]) + (", ..." if len(self.skipped) > 10 else "")
            line += f", {len(self.skipped)} skipped (line {lines})"
        line += f" -> {self.out}"
        agg = self.aggregate
        if agg is not None and not agg.empty:
            part = agg[agg["branch"] == "cond"] if (agg["branch"] == "cond").any() else agg
            last = part.sort_values("timestep").iloc[0]
            frac = f"frac_rho_gt_{self.threshold:g}"
            line += f"; last timestep t={last['timestep']:g}: spearman {last['spearman']:.3f}"
            if math.isfinite(last["spearman_ci_low"]):
                line += f" [{last['spearman_ci_low']:.3f}, {last['spearman_ci_high']:.3f}]"
            line += f", pearson {last['pearson']:.3f}, rho>{self.threshold:g} {last[frac]:.2f}"
            line += f", null {last['spearman_null']:.3f}"
        return line


class _OneProcess:
    """The part of accelerate's ``PartialState`` a sweep uses, for one process without accelerate."""

    num_processes = 1
    process_index = 0
    local_process_index = 0
    is_main_process = True

    def wait_for_everyone(self) -> None:
        pass

    @contextmanager
    def split_between_processes(self, inputs):
        yield inputs


def _scan(manifest: Manifest, runner: SweepRunner, layout: SweepLayout) -> tuple[set[int], list[str]]:
    """Rows whose part is present with the same fingerprint, and descriptions of parts with another one."""
    done: set[int] = set()
    stale: list[str] = []
    for row in manifest.rows:
        path = layout.part(row.row)
        if not path.is_file():
            continue
        meta = _part_metadata(path)
        if meta is None:
            stale.append(f"row {row.row} (line {row.line}): {path.name} is not a readable sweep part")
        elif meta.get("fingerprint") != runner.fingerprint(row):
            old = meta.get("settings", {})
            new = json.loads(json.dumps(asdict(runner.resolve(row)), default=str))
            changed = sorted(k for k in new if old.get(k, new[k]) != new[k]) or ["model or probe options"]
            stale.append(f"row {row.row} (line {row.line}): {', '.join(changed)} differ")
        else:
            done.add(row.row)
    return done, stale


def run_sweep(
    manifest: Manifest,
    runner: SweepRunner,
    out: str | os.PathLike,
    *,
    state=None,
    restart: bool = False,
    progress: bool = True,
    threshold: float = 0.9,
    confidence: float = 0.95,
    n_resamples: int = 9999,
    extra: dict[str, Any] | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> SweepResult:
    """Run every manifest row not yet written, one Parquet part per row, then merge and aggregate on the main process.

    With several processes (``accelerate launch``), every process calls this with the same manifest: the rows still
    to run are split between processes with ``state.split_between_processes`` (contiguous blocks in row order),
    each process writes its own parts, and after ``state.wait_for_everyone()`` the main process reads the parts,
    writes ``row_summary.parquet``, ``aggregate.parquet``, ``summary.json`` and the plot. Every row's table depends
    only on the row (its seed, settings and the model), so any split gives the same dataset.

    Resuming: a row whose part exists with the same fingerprint (:meth:`SweepRunner.fingerprint`) is not run again.
    A part written under other settings stops the sweep before anything runs, unless ``restart`` (which discards
    all parts first). An interrupt (Ctrl-C) or error leaves every finished part intact and no partial file behind.

    Args:
        manifest: from :func:`read_manifest`.
        runner: runs one row.
        out: output folder (created).
        state: accelerate's ``PartialState`` (or ``None`` for one process).
        restart: discard results already in ``out`` and run every row.
        progress: a tqdm bar per process (on stderr).
        threshold, confidence, n_resamples: see :func:`aggregate`.
        extra: JSON-able record added to ``summary.json``.
        clock: time source for ``seconds``.

    Returns:
        a :class:`SweepResult` (its tables only on the main process).

    Raises:
        ValueError: ``out`` holds rows written with other settings (pass ``restart=True`` or another folder).
    """
    from tqdm.auto import tqdm

    state = state if state is not None else _OneProcess()
    layout = SweepLayout(Path(out))
    if state.is_main_process:
        for skip in manifest.skipped:
            logger.warning("manifest %s line %d (row %d) skipped: %s", manifest.path, skip.line, skip.row, skip.reason)
        layout.rows.mkdir(parents=True, exist_ok=True)
        layout.skipped.mkdir(parents=True, exist_ok=True)
        for temp in layout.temp_files():  # left by a process that was killed mid-write
            temp.unlink(missing_ok=True)
        for record in layout.skipped.glob("*.json"):  # rows skipped at run time are tried again
            record.unlink()
        for merged in (layout.row_summary, layout.aggregate, layout.summary, layout.plot):
            merged.unlink(missing_ok=True)  # written again at the end: present only after a complete merge
        if restart:
            for part in layout.parts():
                part.unlink()
    state.wait_for_everyone()

    done, stale = _scan(manifest, runner, layout)
    if stale:
        more = f" and {len(stale) - 3} more" if len(stale) > 3 else ""
        raise ValueError(
            f"{layout.rows} already holds rows made with other settings ({'; '.join(stale[:3])}{more}). "
            "Use another output folder, or restart to discard them"
        )
    pending = [row for row in manifest.rows if row.row not in done]
    state.wait_for_everyone()  # everyone has scanned before anyone writes

    start = clock()
    with state.split_between_processes(pending) as mine:
        bar = tqdm(
            total=len(mine),
            desc=f"sweep [process {state.process_index + 1}/{state.num_processes}]",
            unit="row",
            position=state.local_process_index,
            disable=not progress,
            leave=True,
        )
        try:
            for row in mine:
                row_start = clock()
                try:
                    table = runner.run_row(row)
                except RowInputError as err:
                    logger.warning("manifest line %d (row %d) skipped: %s", row.line, row.row, err)
                    _write_json(layout.skip_record(row.row), {"row": row.row, "line": row.line, "reason": str(err)})
                else:
                    metadata = {
                        "fingerprint": runner.fingerprint(row),
                        "settings": asdict(runner.resolve(row)),
                        "line": row.line,
                        "process": state.process_index,
                        "seconds": clock() - row_start,
                    }
                    write_part(table, layout.part(row.row), metadata)
                bar.update(1)
        finally:
            bar.close()
    state.wait_for_everyone()
    seconds = clock() - start

    if not state.is_main_process:
        return SweepResult(layout.root, len(manifest.rows), 0, 0, len(done), [], state.num_processes, seconds)
    return _merge(
        manifest,
        runner,
        layout,
        ran_now={row.row for row in pending},
        resumed=done,
        processes=state.num_processes,
        seconds=seconds,
        threshold=threshold,
        confidence=confidence,
        n_resamples=n_resamples,
        extra=extra,
    )


def _merge(
    manifest: Manifest,
    runner: SweepRunner,
    layout: SweepLayout,
    *,
    ran_now: set[int],
    resumed: set[int],
    processes: int,
    seconds: float,
    threshold: float,
    confidence: float,
    n_resamples: int,
    extra: dict[str, Any] | None,
) -> SweepResult:
    """Read the parts of the manifest's rows one at a time, reduce each to per-timestep means, aggregate, write."""
    import matplotlib.pyplot as plt
    import pyarrow.parquet as pq

    summaries, by_process, row_seconds = [], {}, []
    run_skipped: list[SkippedRow] = []
    for row in manifest.rows:
        path = layout.part(row.row)
        if not path.is_file():
            record = layout.skip_record(row.row)
            if record.is_file():
                data = json.loads(record.read_text())
                run_skipped.append(SkippedRow(row.row, row.line, data["reason"]))
            else:
                logger.warning("row %d (line %d) has no results: did a process stop early?", row.row, row.line)
            continue
        meta = _part_metadata(path) or {}
        if row.row in ran_now:
            by_process.setdefault(int(meta.get("process", 0)), []).append(row.row)
            row_seconds.append(float(meta.get("seconds", math.nan)))
        summaries.append(row_summary(pq.read_table(path).to_pandas(), threshold))
    extra_parts = sorted({p.name for p in layout.parts()} - {layout.part(r.row).name for r in manifest.rows})
    if extra_parts:
        logger.warning(
            "%d part file(s) in %s are not valid rows of this manifest; left out", len(extra_parts), layout.rows
        )
    per_row = pd.concat(summaries, ignore_index=True) if summaries else pd.DataFrame()
    agg = aggregate(per_row, threshold=threshold, confidence=confidence, n_resamples=n_resamples)
    skipped = sorted([*manifest.skipped, *run_skipped], key=lambda s: s.row)
    done = len(summaries)
    result = SweepResult(
        out=layout.root,
        rows=len(manifest.rows),
        done=done,
        ran=len(ran_now) - len(run_skipped),
        resumed=len(resumed),
        skipped=skipped,
        processes=processes,
        seconds=seconds,
        rows_by_process=dict(sorted(by_process.items())),
        row_summary=per_row,
        aggregate=agg,
        threshold=threshold,
    )
    if not per_row.empty:
        per_row.to_parquet(layout.row_summary, index=False)
    agg.to_parquet(layout.aggregate, index=False)
    record = {
        "manifest": {"path": str(manifest.path), "format": manifest.format, "rows": manifest.total},
        "settings": {**runner.settings, "defaults": asdict(runner.defaults), "layers": runner.layers},
        "versions": versions(),
        **(extra or {}),
        "rows": {"valid": result.rows, "done": done, "ran": result.ran, "resumed": result.resumed},
        "skipped": [asdict(s) for s in skipped],
        "processes": processes,
        "rows_by_process": {str(k): v for k, v in result.rows_by_process.items()},
        "seconds": {"loop": seconds, "rows_total": float(np.nansum(row_seconds)) if row_seconds else 0.0},
        "aggregate": agg.to_dict(orient="records"),
    }
    _write_json(layout.summary, record)
    fig = plot_aggregate(agg, confidence=confidence)
    fig.savefig(layout.plot, dpi=120)
    plt.close(fig)
    return result
