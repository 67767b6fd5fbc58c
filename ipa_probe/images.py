"""Reference images from paths or PIL images, with errors that say what to pass instead."""

from __future__ import annotations

import os
import re
import warnings
from collections.abc import Iterable
from contextlib import contextmanager
from pathlib import Path

from PIL import Image, UnidentifiedImageError

__all__ = ["IMAGE_SUFFIXES", "check_image_file", "image_row", "load_image", "load_images", "to_rgb"]

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".gif", ".tif", ".tiff")

#: PIL modes of 16- and 32-bit integer grayscale (16-bit PNGs open as one of these).
_WIDE_GRAY_MODES = ("I", "I;16", "I;16L", "I;16B", "I;16N")


def to_rgb(image: Image.Image) -> Image.Image:
    """``image`` as 8-bit RGB, keeping the brightness of 16-bit grayscale.

    ``Image.convert("RGB")`` clips 16-bit values at 255, which turns a 16-bit grayscale PNG almost all white; here
    such images are scaled from ``[0, 65535]`` to ``[0, 255]`` first (32-bit ``I`` images whose values reach past
    65535 are scaled by their own maximum). Float ``F`` images are taken as ``[0, 1]`` when they stay in it.
    """
    import numpy as np

    if image.mode in _WIDE_GRAY_MODES or image.mode == "F":
        values = np.asarray(image, dtype=np.float64)  # (H, W)
        top = float(values.max()) if values.size else 0.0
        if image.mode == "F":
            scale = 255.0 if top <= 1.0 else 255.0 / max(top, 1.0)
        else:
            scale = 255.0 / 65535.0 if top <= 65535 else 255.0 / top
        gray = np.clip(np.rint(values * scale), 0, 255).astype(np.uint8)
        return Image.fromarray(gray, mode="L").convert("RGB")
    return image.convert("RGB")


@contextmanager
def _pixel_limit(path: Path):
    """PIL's decompression-bomb warning and error as one ValueError naming the file and the remedy."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        try:
            yield
        except (Image.DecompressionBombError, Image.DecompressionBombWarning) as err:
            # PIL words its warning and its error with different limits (its error fires at twice the limit): quote
            # the image's own size and the one limit the user can change, PIL.Image.MAX_IMAGE_PIXELS
            size = re.search(r"\((\d+) pixels\)", str(err))
            pixels = f"{int(size.group(1)):,} pixels, " if size else ""
            raise ValueError(
                f"image {str(path)!r} is larger than PIL's limit ({pixels}limit PIL.Image.MAX_IMAGE_PIXELS = "
                f"{Image.MAX_IMAGE_PIXELS:,}); downscale it, or raise PIL.Image.MAX_IMAGE_PIXELS if you trust the file"
            ) from None


def check_image_file(path: str | os.PathLike) -> None:
    """Read only the header of an image file: cheap, and catches files that are not images or are too large.

    Raises:
        ValueError: the file is not an image PIL can read, or has more pixels than PIL's limit.
    """
    path = Path(path)
    try:
        with _pixel_limit(path), Image.open(path):
            pass
    except (UnidentifiedImageError, OSError) as err:
        raise ValueError(
            f"image {str(path)!r} cannot be read ({err.__class__.__name__}); pass a PNG or JPEG file"
        ) from None


def load_image(image: Image.Image | str | os.PathLike) -> Image.Image:
    """An RGB PIL image from a PIL image or a file path (16-bit grayscale scaled, see :func:`to_rgb`).

    Raises:
        FileNotFoundError: the path does not exist.
        ValueError: the file is not an image PIL can read, or has more pixels than PIL's limit.
        TypeError: anything else (arrays and tensors included: convert them with ``PIL.Image.fromarray``).
    """
    if isinstance(image, Image.Image):
        return to_rgb(image)
    if isinstance(image, str | os.PathLike):
        path = Path(image)
        if not path.is_file():
            raise FileNotFoundError(f"reference image {str(path)!r} does not exist; pass an existing PNG or JPEG file")
        try:
            with _pixel_limit(path), Image.open(path) as opened:
                return to_rgb(opened)
        except (UnidentifiedImageError, OSError) as err:
            raise ValueError(
                f"{str(path)!r} is not an image PIL can read ({err.__class__.__name__}); pass a PNG or JPEG file"
            ) from None
    raise TypeError(
        f"expected a PIL image or an image file path, got {type(image).__name__}; "
        "convert arrays with PIL.Image.fromarray(...)"
    )


def load_images(images: Iterable[Image.Image | str | os.PathLike]) -> list[Image.Image]:
    """:func:`load_image` for each item; a folder expands to the images in it (sorted by name)."""
    out: list[Image.Image] = []
    for item in images:
        if isinstance(item, str | os.PathLike) and Path(item).is_dir():
            files = sorted(p for p in Path(item).iterdir() if p.suffix.lower() in IMAGE_SUFFIXES)
            if not files:
                raise ValueError(f"folder {str(item)!r} holds no image files ({', '.join(IMAGE_SUFFIXES)})")
            out.extend(load_image(p) for p in files)
        else:
            out.append(load_image(item))
    if not out:
        raise ValueError("no reference images given; pass at least one image")
    return out


def image_row(
    references: Iterable[Image.Image], generated: Iterable[Image.Image], cell: int = 96, gap: int = 4
) -> Image.Image:
    """One RGB strip: the references, a wider gap, then the generated images, each scaled to ``cell x cell``.

    Small images (the digits organism's 16 x 16) are enlarged with nearest-neighbour sampling so pixels stay sharp.

    Args:
        references: reference images (left).
        generated: generated images (right).
        cell: side of each square cell in pixels.
        gap: pixels between cells (four times that between the two groups).

    Returns:
        the strip, on a white ground.
    """
    left, right = [im.convert("RGB") for im in references], [im.convert("RGB") for im in generated]
    if not left and not right:
        raise ValueError("expected at least one image for image_row")
    width = (len(left) + len(right)) * (cell + gap) + 3 * gap
    strip = Image.new("RGB", (width, cell + 2 * gap), "white")
    x = gap
    for i, image in enumerate(left + right):
        if i == len(left) and left:
            x += 3 * gap
        resample = Image.Resampling.NEAREST if max(image.size) < cell else Image.Resampling.BICUBIC
        strip.paste(image.resize((cell, cell), resample), (x, gap))
        x += cell + gap
    return strip
