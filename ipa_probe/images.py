"""Reference images from paths or PIL images, with errors that say what to pass instead."""

from __future__ import annotations

import os
import re
import warnings
from collections.abc import Iterable, Sequence
from contextlib import contextmanager
from pathlib import Path

from PIL import Image, UnidentifiedImageError

from ._io import check_input_file

__all__ = [
    "IMAGE_SUFFIXES",
    "check_image_file",
    "image_row",
    "load_image",
    "load_images",
    "plot_image_strip",
    "to_rgb",
]

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
        FileNotFoundError: it does not exist.
        ValueError: a folder, FIFO, device or socket (checked with ``stat``: never opened), a file that is not an
            image PIL can read, or one with more pixels than PIL's limit.
        PermissionError: it cannot be read (errno ``EACCES``, the path, and the remedy in ``remedy``).
    """
    path = _input_file(path)
    try:
        with _pixel_limit(path), Image.open(path):
            pass
    except (UnidentifiedImageError, OSError) as err:
        raise ValueError(
            f"image {str(path)!r} cannot be read ({err.__class__.__name__}); pass a PNG or JPEG file"
        ) from None


def _input_file(path: str | os.PathLike) -> Path:
    """``path`` if it is a regular, readable file, checked with ``stat`` only (a FIFO must never be opened: the open
    would wait for a writer). See :func:`ipa_probe._io.check_input_file`."""
    return check_input_file(path, "reference image", "an existing PNG or JPEG file")


def load_image(image: Image.Image | str | os.PathLike) -> Image.Image:
    """An RGB PIL image from a PIL image or a file path (16-bit grayscale scaled, see :func:`to_rgb`).

    Raises:
        FileNotFoundError: the path does not exist.
        ValueError: a folder, FIFO, device or socket (never opened), a file that is not an image PIL can read, or one
            with more pixels than PIL's limit.
        PermissionError: the file cannot be read (errno ``EACCES``; the message names the path, ``remedy`` the fix).
        TypeError: anything else (arrays and tensors included: convert them with ``PIL.Image.fromarray``).
    """
    if isinstance(image, Image.Image):
        return to_rgb(image)
    if isinstance(image, str | os.PathLike):
        path = _input_file(image)
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
        if isinstance(item, str | os.PathLike) and Path(item).expanduser().is_dir():
            files = sorted(p for p in _listing(Path(item).expanduser()) if p.suffix.lower() in IMAGE_SUFFIXES)
            if not files:
                raise ValueError(f"folder {str(item)!r} holds no image files ({', '.join(IMAGE_SUFFIXES)})")
            out.extend(load_image(p) for p in files)
        else:
            out.append(load_image(item))
    if not out:
        raise ValueError("no reference images given; pass at least one image")
    return out


def _listing(folder: Path) -> list[Path]:
    """The files of a folder of images (a FIFO, device or socket in it is skipped, never opened)."""
    try:
        return [p for p in folder.iterdir() if p.is_file()]
    except PermissionError as err:
        err.remedy = "no permission to list it: grant it (chmod u+rx, or ask its owner) or pass another folder"
        raise


def image_row(
    references: Iterable[Image.Image], generated: Iterable[Image.Image], cell: int = 96, gap: int = 4
) -> Image.Image:
    """One RGB strip: the references, a wider gap, then the generated images, each scaled to ``cell x cell``.

    Small images (the digits organism's 16 x 16) are enlarged with nearest-neighbour sampling so pixels stay sharp.

    ``gap``: pixels between cells (four times that between the two groups), on a white ground.
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


def plot_image_strip(
    references: Sequence[Image.Image],
    generated: Sequence[Image.Image],
    captions: Sequence[str] | None = None,
    correct: Sequence[bool | None] | None = None,
    title: str | None = None,
    cell: float = 1.0,
    width: float | None = None,
):
    """A titled strip: the references (framed and labelled as references), then the generated images, each with an
    optional caption (e.g. a classifier's verdict) coloured by whether it is right.

    ``captions``: one per generated image (e.g. ``"read as 3"``); ``correct``: per generated image, ``True`` (caption
    in green), ``False`` (red) or ``None`` (black). ``cell``: side of each image in inches (the largest); ``width``:
    the figure's width in inches (say :data:`ipa_probe.figstyle.DOUBLE_COLUMN`): the images shrink to fit it and the
    strip is centred; ``None``: as wide as the images at ``cell``. Small images are drawn with nearest-neighbour
    pixels.
    """
    import matplotlib.pyplot as plt
    import numpy as np

    references, generated = list(references), list(generated)
    if not references and not generated:
        raise ValueError("expected at least one image for plot_image_strip")
    for name, values in (("captions", captions), ("correct", correct)):
        if values is not None and len(values) != len(generated):
            raise ValueError(f"{name}: expected one per generated image ({len(generated)}), got {len(values)}")
    # every text at 8 pt or more (ipa_probe.figstyle.MIN_FONT_PT), the gaps in inches sized for it
    count, gap, side = len(references) + len(generated), (0.35 if references and generated else 0.0), 0.1
    if width is not None:
        cell = min(cell, (width - gap - 2 * side) / count - 0.1)
        if cell <= 0.05:
            raise ValueError(f"width: {width} in has no room for {count} images; give a larger width or fewer images")
        side = (width - count * (cell + 0.1) - gap) / 2  # centred
    step = cell + 0.1
    width = count * step + gap + 2 * side
    short = cell < 0.8  # "ref 0" under a narrow reference, "reference 0" where it fits
    lines = title.count("\n") + 1 if title else 0
    label_y = (0.06 + 0.17 * lines + 0.1 if title else 0.08) + 0.14  # the group labels' middle, inches from the top
    top = label_y + 0.34  # the images' top edge
    height = top + cell + (0.34 if captions is not None else 0.1)
    fig = plt.figure(figsize=(width, height))
    colours = {True: "#1a7f37", False: "#cf222e", None: "black"}
    blue = "#0550ae"
    for i, image in enumerate(references + generated):
        is_reference = i < len(references)
        x = side + i * step + (0.0 if is_reference else gap)
        ax = fig.add_axes([x / width, 1 - (top + cell) / height, cell / width, cell / height])
        ax.imshow(np.asarray(image.convert("RGB")), interpolation="nearest")
        ax.set_xticks([])
        ax.set_yticks([])
        if is_reference:
            ax.set_title(f"ref {i}" if short else f"reference {i}", fontsize=8, color=blue, pad=2)
            for spine in ax.spines.values():
                spine.set_edgecolor(blue)
                spine.set_linewidth(2.0)
            continue
        j = i - len(references)
        ax.set_title(f"#{j}" if short else f"image {j}", fontsize=8, pad=2)
        if captions is not None:
            ok = correct[j] if correct is not None else None
            ax.set_xlabel(captions[j], fontsize=8, color=colours[ok], labelpad=2)
    for start, count, label, colour in (
        (side, len(references), "references", blue),
        (side + len(references) * step + gap, len(generated), "generated", "black"),
    ):
        if count:
            middle = start + (count * step - 0.08) / 2
            fig.text(middle / width, 1 - label_y / height, label, ha="center", va="center", fontsize=9, color=colour)
    if title:
        fig.text(0.5, 1 - 0.06 / height, title, ha="center", va="top", fontsize=9)
    return fig
