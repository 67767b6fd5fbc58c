"""Sweep manifests: JSON Lines or CSV rows parsed and validated, bad rows set aside with their line number."""

from __future__ import annotations

import csv
import io
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .._checks import MAX_SEED, check_flag, parse_bandwidth, parse_float, parse_int
from .._io import Unreadable, check_input_file, parse_json, read_bounded
from ..images import IMAGE_SUFFIXES, check_image_file

#: Keys a manifest row may have. All are optional: a row leaves out what the sweep's defaults should fill in.
MANIFEST_KEYS: tuple[str, ...] = ("prompt", "images", "seed", "scale", "steps", "bandwidth")

#: In a CSV manifest, several images in one cell are separated by one of these (a comma separates cells).
CSV_IMAGE_SEPARATORS: tuple[str, ...] = (";", "|")

_JSONL_SUFFIXES = (".jsonl", ".ndjson", ".json")
_CSV_SUFFIXES = (".csv",)
_BOOL_NAMES = ("true", "false")


class ManifestError(ValueError):
    """The manifest as a whole cannot be used (empty, not JSON Lines or CSV, a CSV header with unknown columns)."""


class RowInputError(ValueError):
    """One row cannot run because of its input (e.g. an image that fails to load); the sweep skips it and goes on."""


# ---------------------------------------------------------------------------------------------------- the manifest


@dataclass(frozen=True)
class ManifestRow:
    """One valid manifest row, as written (``None``: the row leaves that key to the sweep's defaults).

    ``row``: position among the manifest's rows, from 0 (skipped rows count, so a row keeps its index when an earlier
    row is fixed), the ``row`` column of the results; ``line``: the 1-based line where the row starts; ``images``:
    folders already expanded, paths resolved against the manifest's folder; ``seed`` also seeds the probe's
    permutation null; ``bandwidth``: ``"matched"``, ``"fit"`` or a positive NW bandwidth ``h``.
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
    """A manifest row without results, and why.

    Attributes:
        row, line: the row's index and its line in the manifest.
        reason: one line.
        stage: ``"manifest"`` (rejected by the checks before anything runs: a bad value, a missing or unreadable
            image) or ``"run"`` (failed while running).
        kept_part: a part the row finished earlier is kept in ``rows/`` (left out of the aggregate until the row
            passes its checks again; then it counts without running again).
    """

    row: int
    line: int
    reason: str
    stage: str = "manifest"
    kept_part: bool = False

    def describe(self) -> str:
        kept = "; its finished part is kept" if self.kept_part else ""
        return f"line {self.line} (row {self.row}): {self.reason}{kept}"


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


def _image_files(value: Any, base: Path, separated: bool) -> tuple[str, ...]:
    """Resolve an ``images`` entry to image files that exist and that PIL recognises."""
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
            check_image_file(path)  # stat first (a FIFO is never opened), then the header only; pixels when it runs
        except PermissionError as err:  # the row fails, naming the path and the remedy (not "not an image")
            remedy = getattr(err, "remedy", "grant read permission or pass another file")
            raise ValueError(f"image {err.filename!r}: {err.strerror}; {remedy}") from None
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
        seed=parse_int(values["seed"], "seed", 0, MAX_SEED) if "seed" in values else None,
        scale=parse_float(values["scale"], "scale", 0.0) if "scale" in values else None,
        steps=parse_int(values["steps"], "steps", 1) if "steps" in values else None,
        bandwidth=parse_bandwidth(values["bandwidth"]) if "bandwidth" in values else None,
    )


def _jsonl_records(text: str) -> Iterator[tuple[int, dict[str, Any] | None, str | None]]:
    """(line, object or None, error or None) for each non-blank line."""
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            value = parse_json(line)
        except json.JSONDecodeError as err:
            yield number, None, f"not valid JSON ({err.msg} at column {err.colno})"
            continue
        except ValueError as err:  # nested past the cap
            yield number, None, f"not a row: it {err}"
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

    The format (keys, image lists, defaults; docs/sweeps.md) follows the suffix (``.jsonl``/``.ndjson``/``.json``,
    ``.csv``) or, for other names, the content; relative image paths start from the manifest's folder. A row with an
    unknown key, a missing or unreadable image, or a bad value is not run: it is listed in :attr:`Manifest.skipped`
    with its line number.

    ``require_images``: also skip rows without ``images`` (when the sweep has no default reference images).

    Raises:
        PermissionError: the file cannot be read (the path, and the remedy in ``remedy``).
        ManifestError: the file is missing or not a regular file (a FIFO is never opened), empty, not text,
            neither JSON Lines nor CSV, or its CSV header names unknown columns: nothing can be run.
        TypeError: ``path`` is not a path, or ``require_images`` not a bool.
    """
    if not isinstance(path, str | os.PathLike):
        raise TypeError(f"path: expected a manifest file path (str or Path), got {type(path).__name__}")
    check_flag(require_images, "require_images")
    path = Path(path)
    name = str(path)
    if path.is_dir():
        raise ManifestError(f"manifest {name!r} is a folder; pass a JSON Lines or CSV file")
    try:
        check_input_file(path, "manifest", "a JSON Lines or CSV file")  # stat only: a FIFO is never opened
    except (FileNotFoundError, ValueError) as err:
        raise ManifestError(str(err)) from None
    try:  # regular, at most MAX_READ_BYTES (a FIFO swapped in after the check cannot hang it either)
        text = (read_bounded(path, follow=True) or b"").decode("utf-8-sig")
    except UnicodeDecodeError:
        raise ManifestError(f"manifest {name!r} is not UTF-8 text; expected JSON Lines or CSV") from None
    except Unreadable as err:
        raise ManifestError(f"manifest {err}; pass a JSON Lines or CSV file") from None
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
            except (ValueError, TypeError) as err:  # a row with a value of the wrong type fails alone
                error = str(err)
            else:
                rows.append(parsed)
                continue
        skipped.append(SkippedRow(index, line, error))
    return Manifest(path=path, format=fmt, rows=rows, skipped=skipped)
