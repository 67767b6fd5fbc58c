"""Reference images from paths or PIL images, with errors that say what to pass instead."""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

from PIL import Image, UnidentifiedImageError

__all__ = ["IMAGE_SUFFIXES", "image_row", "load_image", "load_images"]

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".gif", ".tif", ".tiff")


def load_image(image: Image.Image | str | os.PathLike) -> Image.Image:
    """An RGB PIL image from a PIL image or a file path.

    Raises:
        FileNotFoundError: the path does not exist.
        ValueError: the file is not an image PIL can read.
        TypeError: anything else (arrays and tensors included: convert them with ``PIL.Image.fromarray``).
    """
    if isinstance(image, Image.Image):
        return image.convert("RGB")
    if isinstance(image, str | os.PathLike):
        path = Path(image)
        if not path.is_file():
            raise FileNotFoundError(f"reference image {str(path)!r} does not exist; pass an existing PNG or JPEG file")
        try:
            with Image.open(path) as opened:
                return opened.convert("RGB")
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
