"""Running one manifest row: defaults filled in, the pipeline called once with the probe on."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import pandas as pd
from PIL import Image

from .._checks import MAX_SEED, check_int, check_items, parse_bandwidth, parse_float, parse_int
from ..images import load_images
from ..layers import check_layer_selection
from .manifest import ManifestRow, RowInputError


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
        object.__setattr__(self, "seed", parse_int(self.seed, "seed", 0, MAX_SEED))
        object.__setattr__(self, "scale", parse_float(self.scale, "scale", 0.0))
        object.__setattr__(self, "steps", parse_int(self.steps, "steps", 1))
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
        if defaults is not None and not isinstance(defaults, RowDefaults):
            raise TypeError(f"defaults: expected RowDefaults(...) or None, got {type(defaults).__name__}")
        if call_kwargs is not None and not isinstance(call_kwargs, dict):
            raise TypeError(f"call_kwargs: expected a dict of pipeline arguments, got {type(call_kwargs).__name__}")
        if settings is not None and not isinstance(settings, dict):
            raise TypeError(f"settings: expected a JSON-able dict or None, got {type(settings).__name__}")
        if default_images is not None:
            default_images = check_items(default_images, "default_images", "PIL images")
            if not default_images or not all(isinstance(image, Image.Image) for image in default_images):
                raise TypeError("default_images: expected a non-empty list of PIL images (files: use load_images)")
        if heads is not None:
            heads = check_items(heads, "heads", "head indices (ints)")
            for head in heads:
                check_int(head, "heads", 0)
        check_layer_selection(layers)
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
        self._file_hashes: dict[tuple[str, int, int], str] = {}
        self._default_hash: str | None = None

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

    def inputs(self, row: ManifestRow) -> str:
        """A short hash of the bytes of the row's images (the default images' pixels for a row without images).

        Stored with each row's part: a row whose image files changed since it ran is run again. A file is hashed once
        per size and modification time.

        Raises:
            RowInputError: an image file cannot be read.
        """
        digest = hashlib.sha256()
        if row.images is None:
            if self._default_hash is None:
                pixels = hashlib.sha256()
                for image in self.default_images or ():
                    pixels.update(f"{image.mode}{image.size}".encode())
                    pixels.update(image.tobytes())
                self._default_hash = pixels.hexdigest()
            digest.update(self._default_hash.encode())
        for name in row.images or ():
            digest.update(name.encode() + b"\0" + self._file_hash(name).encode())
        return digest.hexdigest()[:20]

    def _file_hash(self, name: str) -> str:
        try:
            stat = os.stat(name)
            key = (name, stat.st_mtime_ns, stat.st_size)
            if key not in self._file_hashes:
                file_hash = hashlib.sha256()
                with open(name, "rb") as handle:
                    for block in iter(lambda: handle.read(1 << 20), b""):
                        file_hash.update(block)
                self._file_hashes[key] = file_hash.hexdigest()
        except OSError as err:
            raise RowInputError(f"image {name!r} cannot be read ({err.strerror or err})") from None
        return self._file_hashes[key]

    def check(self, settings: RowSettings) -> None:
        """Raise :class:`RowInputError` if the pipeline would reject the row's settings (seed, steps)."""
        from .._checks import check_steps

        if not 0 <= settings.seed <= MAX_SEED:
            raise RowInputError(f"seed: {settings.seed} (base seed + row) is above {MAX_SEED}; give the row a seed")
        try:
            check_steps(self.pipe.scheduler, settings.steps)
        except ValueError as err:
            raise RowInputError(str(err)) from None

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
            RowInputError: the row's images cannot be loaded or the pipeline would reject its settings. Any error
                fails this row alone: :func:`run_sweep` records it with the row's line and goes on.
        """
        import torch

        from ..capture.run import probe

        settings = self.resolve(row)
        self.check(settings)
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

    def write_maps(self, row: ManifestRow, directory) -> dict:
        """Generate the row again (same seed, decoded) with ``maps=True`` and write its ``reference_maps.png`` and
        ``map_table.parquet`` into ``directory`` (see :func:`ipa_probe.capture.mapplots.save_reference_maps`)."""
        import torch

        from ..capture.mapplots import save_reference_maps
        from ..capture.run import probe

        settings = self.resolve(row)
        images = self._images(settings)
        self.pipe.set_ip_adapter_scale(settings.scale)
        generator = torch.Generator(device=self.pipe.device).manual_seed(settings.seed)
        kwargs = {**self.call_kwargs, "output_type": "pil"}
        with probe(self.pipe, bandwidth=settings.bandwidth, layers=self.layers, heads=self.heads, maps=True) as run:
            out = self.pipe(
                prompt=settings.prompt,
                ip_adapter_image=[images],
                num_inference_steps=settings.steps,
                generator=generator,
                **kwargs,
            )
        return save_reference_maps(run, directory, out.images[0], [images])
