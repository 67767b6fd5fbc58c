"""Side by side: the learned IP-Adapter, the zero-parameter NW head, and the exact empirical denoiser.

From the same seeds, one pipeline generates with ``ip_adapter`` (as loaded), ``nw_head`` (the image branch swapped
for Gaussian NW weights, :func:`ipa_probe.nw_head`) and ``exact`` (the exact empirical denoiser of the references'
VAE latents, :func:`ipa_probe.exact_pipeline`, paper §C.5), and each image is scored against the reference set with
open_clip image embeddings (:mod:`.compare_scores`: ``clip_i_nearest``, ``clip_i_mean``, ``pixel_nearest``,
``diversity``), beside a ``vae_roundtrip`` row (the references through the VAE: the floor of ``pixel_nearest``).
Offline, the open_clip model has random weights and every output says so. The columns: docs/nw-head.md.
"""

from __future__ import annotations

import inspect
import logging
import math
import time
from collections.abc import Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import PIL.Image
import torch

from ._checks import check_items, check_nw_frame, check_seed
from .compare_scores import RANDOM_WEIGHTS_NOTE, SCORES, ClipScorer, diversity, image_pixels, score_method
from .statistics.bandwidth import describe as describe_bandwidth

__all__ = [
    "METHODS",
    "METHOD_LABELS",
    "ROUNDTRIP",
    "ClipScorer",
    "Comparison",
    "compare_methods",
    "diversity",
    "generate_methods",
    "grid_figure",
    "make_grid",
    "markdown_table",
    "score_method",
    "vae_roundtrip",
]

logger = logging.getLogger(__name__)

#: The compared methods, in table and grid order.
METHODS: tuple[str, ...] = ("ip_adapter", "nw_head", "exact")
METHOD_LABELS: dict[str, str] = {
    "ip_adapter": "IP-Adapter (learned)",
    "nw_head": "NW head (zero-parameter)",
    "exact": "exact NW denoiser",
}
#: The table row of the references passed through the VAE (the memorisation floor).
ROUNDTRIP = "vae_roundtrip"
# ---------------------------------------------------------------------------------------------------------------------
# Generation
# ---------------------------------------------------------------------------------------------------------------------


def _resized(images: Sequence[PIL.Image.Image], width: int, height: int) -> list[PIL.Image.Image]:
    return [im.convert("RGB").resize((width, height), PIL.Image.Resampling.BICUBIC) for im in images]


def _generator(device: torch.device, seed: int) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(int(seed))


def _output_size(pipe, call_kwargs: dict) -> tuple[int, int]:
    """The (height, width) the pipeline generates at with these arguments."""
    from .exact import _default_size

    height, width = _default_size(pipe)
    return call_kwargs.get("height") or height, call_kwargs.get("width") or width


def generate_methods(
    pipe,
    references: Sequence[PIL.Image.Image],
    seeds: Sequence[int],
    call_kwargs: dict | None = None,
    bandwidth: Any = "matched",
    methods: Sequence[str] = METHODS,
    progress: bool = True,
    nw_frame: str = "stored",
) -> tuple[dict[str, list[PIL.Image.Image]], dict[str, float]]:
    """Generate one image per seed with each method, from the same initial noise.

    One progress bar per method, labelled with its name, counts its denoising steps over all seeds (the methods run
    on a second pipeline object over ``pipe``'s modules, whose per-call bar is off; ``pipe``'s is left as it is).

    ``pipe``: an SD 1.5 / SDXL pipeline with one IP-Adapter loaded; ``references`` (PIL) are its image prompt and
    the exact denoiser's support; ``call_kwargs``: more pipeline arguments (``prompt``, ``num_inference_steps``, ...);
    ``bandwidth`` and ``nw_frame`` (``"stored"``, or ``"query"`` with ``"matched"``) are the NW head's
    (:func:`ipa_probe.nw_head`); ``methods`` a subset of :data:`METHODS`. Returns ``(images, seconds)``: method ->
    list of PIL images (one per seed), and method -> wall time in seconds.
    """
    from .exact import exact_pipeline
    from .nwhead import nw_head
    from .nwhead.kernel import check_head_bandwidth

    unknown = [m for m in check_items(methods, "methods", "method names") if m not in METHODS]
    if unknown:
        raise ValueError(f"unknown method(s) {unknown}; choose from {list(METHODS)}")
    references, seeds = _check_references(references), _check_seeds(seeds)
    check_head_bandwidth(bandwidth)
    check_nw_frame(nw_frame, None, bandwidth)
    if call_kwargs is not None and not isinstance(call_kwargs, dict):
        raise TypeError(f"call_kwargs: expected a dict of pipeline arguments, got {type(call_kwargs).__name__}")
    call_kwargs = dict(call_kwargs or {})
    call_kwargs.setdefault("prompt", "a photo")
    references = list(references)
    device = pipe.device
    images: dict[str, list[PIL.Image.Image]] = {}
    seconds: dict[str, float] = {}

    params = inspect.signature(type(pipe)).parameters  # a twin on pipe's modules and settings, its own progress bar
    twin = type(pipe)(
        **pipe.components, **{k: v for k, v in pipe.config.items() if k in params.keys() - pipe.components.keys()}
    )

    def learned() -> list[PIL.Image.Image]:
        return [
            twin(ip_adapter_image=[references], generator=_generator(device, s), **call_kwargs).images[0]
            for s in seeds
        ]

    steps = call_kwargs.get("num_inference_steps", 50)
    for method in methods:
        start = time.perf_counter()
        if method == "ip_adapter":
            with _bar_for(twin, method, len(seeds) * steps, progress):
                images[method] = learned()
        elif method == "nw_head":
            with (
                nw_head(twin, bandwidth=bandwidth, frame=nw_frame),
                _bar_for(twin, method, len(seeds) * steps, progress),
            ):
                images[method] = learned()
        else:
            height, width = _output_size(pipe, call_kwargs)
            # Resize here (as the VAE preprocessing would) so that the exact pipeline does not warn on every run.
            support = _resized(references, width, height)
            exact = exact_pipeline(pipe, support, height=height, width=width)
            with _bar_for(exact, method, len(seeds) * steps, progress):
                images[method] = [
                    exact(num_inference_steps=steps, generator=_generator(exact.unet.device, s)).images[0]
                    for s in seeds
                ]
        seconds[method] = time.perf_counter() - start
        logger.info("compare: %s, %d image(s) in %.1f s", method, len(seeds), seconds[method])
    return images, seconds


@contextmanager
def _bar_for(pipeline, label: str, total: int, show: bool):
    """A context in which ``pipeline`` (compare's own: the twin or the exact pipeline) advances one labelled bar at
    every denoising step of its calls, through its own ``progress_bar`` (its loop's step report, diffusers' and the
    exact pipeline's alike): no hook on the denoiser, whose hooks stay the features' (the NW head's spine)."""
    from tqdm.auto import tqdm

    def advancing(iterable):
        for item in iterable:
            yield item
            bar.update()

    def steps(iterable=None, total=None):  # iterated by the loop, or entered and ``update()``-d (diffusers)
        return nullcontext(bar) if iterable is None else advancing(iterable)

    with tqdm(total=total, desc=label, unit="step", disable=not show) as bar:
        pipeline.progress_bar = steps
        try:
            yield
        finally:
            del pipeline.progress_bar


@torch.no_grad()
def vae_roundtrip(pipe, references: Sequence[PIL.Image.Image], height: int, width: int) -> list[PIL.Image.Image]:
    """The references encoded and decoded by the pipeline's VAE at ``height x width`` (PIL images)."""
    from .exact import encode_references

    latents = encode_references(pipe, _resized(references, width, height), height=height, width=width)  # scaled
    vae = pipe.vae
    z = latents / vae.config.scaling_factor
    shift = getattr(vae.config, "shift_factor", None)
    if shift is not None:
        z = z + shift
    decoded = vae.decode(z.to(vae.dtype), return_dict=False)[0]
    return pipe.image_processor.postprocess(decoded, output_type="pil")


# ---------------------------------------------------------------------------------------------------------------------
# The result
# ---------------------------------------------------------------------------------------------------------------------


@dataclass
class Comparison:
    """Images and scores of the three methods.

    Attributes:
        references: the reference images.
        seeds: the generator seeds (grid columns).
        images: method -> one PIL image per seed.
        roundtrip: the references passed through the VAE (one per reference), or ``None``.
        per_image: one row per method x seed: ``method``, ``seed``, ``clip_i_nearest``, ``clip_i_mean``,
            ``pixel_nearest``, ``nearest_reference``.
        table: one row per method (and ``vae_roundtrip``): means (and stds over seeds) of the per-image scores,
            ``diversity``.
        settings: what was run (model, prompt, steps, bandwidth, CLIP model, whether its weights are random) and the
            wall time of each method (``seconds``; the first method's includes the pipeline's warm-up).
    """

    references: list[PIL.Image.Image]
    seeds: list[int]
    images: dict[str, list[PIL.Image.Image]]
    per_image: pd.DataFrame
    table: pd.DataFrame
    settings: dict[str, Any] = field(default_factory=dict)
    roundtrip: list[PIL.Image.Image] | None = None

    def grid(self) -> PIL.Image.Image:
        """The image grid: references (and their VAE round trip), then one row per method, one column per seed,
        titled, each image's scores under it (:meth:`grid_captions`), as ``grid.png`` holds it."""
        return make_grid(self.references, self.images, self.seeds, self.roundtrip, *self.grid_captions())

    def grid_captions(self) -> tuple[dict[str, list], str]:
        """The grid's captions (row -> per image ``(text, read right or None)``) and title: CLIP-I to the nearest
        reference and RMS pixel distance to it under each image, and on the organism the digit classifier's
        probability of the digit (green where it reads the digit, red where not) and the references' readings."""
        captions, digit = {}, self.settings.get("run", {}).get("digit")
        for method, rows in self.per_image.groupby("method", sort=False):
            read = [np.isfinite(getattr(r, "digit_confidence", np.nan)) for r in rows.itertuples()]
            captions[method] = [(f"CLIP-I {r.clip_i_nearest:.2f}\npixel {r.pixel_nearest:.3f}"
                                 + (f"\np({digit}) {r.digit_confidence:.2f}" if ok else ""), bool(r.digit_right) if ok
                                 else None) for r, ok in zip(rows.itertuples(), read, strict=True)]  # fmt: skip
        readings = self.settings.get("digit_readings", {}).get("references", {}).get("labels", [])
        captions["references"] = [(f"reads {label}", label == digit) for label in readings]
        clip = "CLIP with random weights: scores only compare methods" * bool(self.settings.get("clip_random_weights"))
        title = (f"{len(self.references)} references" + (f" of a {digit}" if digit is not None else "")
                 + f", {len(self.images)} methods x {len(self.seeds)} seeds\nunder each image: CLIP-I and RMS pixel "
                 "distance to the nearest reference" + (f",\nthe digit classifier's p({digit}) (green: read as a "
                 f"{digit}, red: not)" if readings else "") + (f"\n({clip})" if clip else ""))  # fmt: skip
        return captions, title

    def grid_provenance(self) -> dict:
        """What ``grid.png`` carries: the digest of :data:`GRID_CODE` and each image's mean brightness (the rows in
        order), within a tolerance of 0.02 (pixels move by ~1e-6 between CPUs; 0.02 is below a visible change)."""
        from ._io import code_digest

        rows = [self.references, *(self.roundtrip and [self.roundtrip] or []), *self.images.values()]
        data = [round(float(np.asarray(im.convert("L"), dtype=np.float64).mean() / 255), 3) for r in rows for im in r]
        return {"code": code_digest(*GRID_CODE), "data": data, "atol": 0.02}

    def markdown(self) -> str:
        """The per-method table as GitHub markdown."""
        return markdown_table(self.table)

    def save(self, directory: str | Path, overwrite: bool = False) -> dict[str, Path]:
        """Write ``compare.csv``, ``compare.md``, ``per_image.csv``, ``grid.png``, ``compare.json`` and the images
        into the folder ``directory`` by the folder rules of the command line (:class:`ipa_probe.runfolder.RunFolder`):
        under the folder's lock, written aside and renamed into place when whole, with ``ipa_probe_manifest.json``,
        so that an interrupted save leaves the folder as it was. A folder holding another run's files, or files no
        manifest lists, raises :class:`~ipa_probe.runfolder.RunConflict` unless ``overwrite`` (which replaces only
        the previous run's own files); a folder another process holds raises
        :class:`~ipa_probe._io.OutputLocked`.

        Returns:
            name -> path of each file written.
        """
        from .runfolder import save_into

        return save_into(directory, "ipa_probe Comparison.save", self.settings, self._write, overwrite=overwrite)

    def _write(self, directory: Path) -> dict[str, Path]:
        """:meth:`save`'s files, written into ``directory`` (a staging folder)."""
        from ._io import versions, write_atomic, write_figure, write_image, write_json, write_table

        directory = Path(directory)
        paths = {
            "table": directory / "compare.csv",
            "markdown": directory / "compare.md",
            "per_image": directory / "per_image.csv",
            "grid": directory / "grid.png",
            "record": directory / "compare.json",
        }
        write_table(self.table, paths["table"])
        write_table(self.per_image, paths["per_image"])
        note = f"\n\n_{RANDOM_WEIGHTS_NOTE}._\n" if self.settings.get("clip_random_weights") else "\n"
        write_atomic(paths["markdown"], self.markdown() + note)
        figure = grid_figure(self.references, self.images, self.seeds, self.roundtrip, *self.grid_captions())
        write_figure(figure, paths["grid"], provenance=self.grid_provenance())
        images_dir = directory / "images"
        images_dir.mkdir(exist_ok=True)
        for method, items in self.images.items():
            for seed, image in zip(self.seeds, items, strict=True):
                write_image(image, images_dir / f"{method}_seed{seed}.png")
        record = {
            "settings": self.settings,
            "versions": {**versions(), "open_clip": _open_clip_version()},
            "methods": {m: METHOD_LABELS[m] for m in self.images},
            "roundtrip_row": f"{ROUNDTRIP}: the references encoded and decoded by the VAE (pixel_nearest floor)",
            "seeds": self.seeds,
            "table": self.table.to_dict(orient="records"),
            "per_image": self.per_image.to_dict(orient="records"),
            "files": {k: p.name for k, p in paths.items()},
        }
        write_json(paths["record"], record)
        return paths


def _open_clip_version() -> str:
    import open_clip

    return open_clip.__version__


def markdown_table(table: pd.DataFrame, digits: int = 3) -> str:
    """A GitHub markdown table of ``table`` (floats rounded to ``digits``; ``mean ± std`` where a ``_std`` exists)."""
    columns = [c for c in table.columns if not c.endswith("_std")]
    rows = []
    for _, row in table.iterrows():
        cells = []
        for column in columns:
            value = row[column]
            if isinstance(value, float | np.floating):
                text = "n/a" if not np.isfinite(value) else f"{value:.{digits}f}"
                std = row.get(f"{column}_std")
                if std is not None and np.isfinite(std) and np.isfinite(value):
                    text += f" ± {std:.{digits}f}"
            else:
                text = str(value)
            cells.append(text)
        rows.append(cells)
    lines = ["| " + " | ".join(columns) + " |", "|" + "|".join("---" for _ in columns) + "|"]
    lines += ["| " + " | ".join(cells) + " |" for cells in rows]
    return "\n".join(lines)


def grid_figure(
    references: Sequence[PIL.Image.Image],
    images: dict[str, Sequence[PIL.Image.Image]],
    seeds: Sequence[int],
    roundtrip: Sequence[PIL.Image.Image] | None = None,
    captions: dict[str, Sequence[tuple[str, bool | None]]] | None = None,
    title: str | None = None,
):
    """The labelled grid of :func:`make_grid` as a matplotlib figure 7 in wide (a paper's page): each row named at its
    left (references, their VAE round trip, each method), the columns by reference and by seed, optional captions
    under the images, every text at 8 pt or more; a cell with no image (fewer references than seeds) is left blank.

    Rows: the references, optionally their VAE ``roundtrip``, then ``images`` (method -> one image per seed, in
    order); columns titled by ``seeds``. ``captions``: row (``"references"``, ``ROUNDTRIP`` or a method) -> per image
    ``(text, right)``: ``right`` colours it green (``True``), red (``False``) or black (``None``). Returns a
    ``matplotlib.figure.Figure`` on an Agg canvas (no pyplot state).
    """
    # The object-oriented API with an Agg canvas: no pyplot state, no backend switch in the caller's session.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    from .figstyle import DOUBLE_COLUMN, MAX_HEIGHT, PAPER_RC

    head_rows = [("references", references)] + ([("references\nthrough the VAE", roundtrip)] if roundtrip else [])
    rows = len(head_rows) + len(images)
    cols = max(len(seeds), len(references))
    captions = captions or {}
    lines = max((text.count("\n") + 1 for row in captions.values() for text, _ in row), default=0)
    head = 0.14 * (title.count("\n") + 1) + 0.1 if title else 0.0
    cell = min(1.1, (DOUBLE_COLUMN - 1.3) / cols - 0.1, (MAX_HEIGHT - head) / rows - 0.2 - 0.14 * lines)
    size = PAPER_RC["font.size"]
    height = rows * (cell + 0.2 + 0.14 * lines) + head
    fig = Figure(figsize=(DOUBLE_COLUMN, height), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(rows, cols, squeeze=False)
    for ax in axes.flat:
        ax.set_xticks([])
        ax.set_yticks([])
        for spine in ax.spines.values():
            spine.set_visible(False)
    colours = {True: "#1a7f37", False: "#cf222e", None: "black"}
    keys = ["references", ROUNDTRIP][: len(head_rows)] + list(images)
    named = [label for label, _ in head_rows] + [METHOD_LABELS.get(m, m).replace(" (", "\n(") for m in images]
    for i, (key, label, items) in enumerate(zip(keys, named, [r for _, r in head_rows] + list(images.values()),
                                                strict=True)):  # fmt: skip
        for j, image in enumerate(items):
            axes[i, j].imshow(image.convert("RGB"))
            if i in (0, len(head_rows)):
                axes[i, j].set_title(f"reference {j}" if i == 0 else f"seed {seeds[j]}", fontsize=size)
            if j < len(captions.get(key, ())):
                text, right = captions[key][j]
                axes[i, j].set_xlabel(text, fontsize=size, color=colours[right], labelpad=2)
        axes[i, 0].set_ylabel(label, fontsize=size)
    for ax in axes.flat:
        if not ax.get_images():  # nothing drawn in this cell: no axes either
            ax.set_axis_off()
    if title:
        fig.suptitle(title, fontsize=size)
    return fig


def make_grid(
    references: Sequence[PIL.Image.Image],
    images: dict[str, Sequence[PIL.Image.Image]],
    seeds: Sequence[int],
    roundtrip: Sequence[PIL.Image.Image] | None = None,
    captions: dict[str, Sequence[tuple[str, bool | None]]] | None = None,
    title: str | None = None,
) -> PIL.Image.Image:
    """A labelled grid: references first row, then one row per method, one column per seed (:func:`grid_figure`),
    at the resolution ``grid.png`` is saved with (:data:`ipa_probe.figstyle.SAVE_DPI`).

    Arguments as :func:`grid_figure` takes them; an RGB PIL image.
    """
    from .figstyle import SAVE_DPI

    fig = grid_figure(references, images, seeds, roundtrip, captions, title)
    fig.set_dpi(SAVE_DPI)
    fig.canvas.draw()
    return PIL.Image.fromarray(np.asarray(fig.canvas.buffer_rgba())).convert("RGB")


#: The code that draws ``grid.png``: its digest is the grid's provenance (``make figures``).
GRID_CODE = (grid_figure, make_grid, Comparison.grid_captions)


def _check_seeds(seeds: Any) -> list[int]:
    """A non-empty list of seeds, each an int in ``[0, 2**63 - 1]``."""
    seeds = [check_seed(seed, "seeds") for seed in check_items(seeds, "seeds", "ints")]
    if not seeds:
        raise ValueError("seeds: expected at least one seed; pass e.g. seeds=[0, 1, 2]")
    return seeds


def _check_references(references: Any) -> list[PIL.Image.Image]:
    """A non-empty list of PIL images, checked before anything runs."""
    if isinstance(references, PIL.Image.Image):
        raise TypeError("references: expected a list of PIL images, got one image; pass [image]")
    references = list(check_items(references, "references", "PIL images"))
    if not references:
        raise ValueError("references: expected at least one reference image; pass the image prompt(s) as PIL images")
    if not all(isinstance(image, PIL.Image.Image) for image in references):
        kinds = sorted({type(image).__name__ for image in references})
        raise TypeError(f"references: expected PIL images, got {kinds}; load files with ipa_probe.images.load_images")
    return references


def compare_methods(
    pipe,
    references: Sequence[PIL.Image.Image],
    seeds: Sequence[int] = (0, 1, 2),
    call_kwargs: dict | None = None,
    *,
    bandwidth: Any = "matched",
    scorer: ClipScorer | None = None,
    methods: Sequence[str] = METHODS,
    settings: dict | None = None,
    progress: bool = True,
    nw_frame: str = "stored",
) -> Comparison:
    """Generate with the learned IP-Adapter, the NW head and the exact denoiser from the same seeds, and score them.

    Arguments as in :func:`generate_methods` (one image per method and seed); ``scorer``: the :class:`ClipScorer`
    (default: ``ViT-B-32`` with random weights, offline); ``settings``: extra JSON-friendly settings to record.

    Example:
        ```py
        >>> pipe = ipa_probe.tiny.sd.tiny_pipeline()
        >>> refs = ipa_probe.tiny.sd.default_reference_images()
        >>> result = compare_methods(pipe, refs, seeds=[0, 1], call_kwargs={"num_inference_steps": 4})
        >>> result.table
        ```
    """
    references, seeds = _check_references(references), _check_seeds(seeds)  # generate_methods checks the rest
    if scorer is not None and not isinstance(scorer, ClipScorer):
        raise TypeError(f"scorer: expected a ClipScorer or None, got {type(scorer).__name__}")
    if settings is not None and not isinstance(settings, dict):
        raise TypeError(f"settings: expected a JSON-able dict or None, got {type(settings).__name__}")
    images, seconds = generate_methods(pipe, references, seeds, call_kwargs, bandwidth, methods, progress, nw_frame)
    scorer = scorer or ClipScorer()
    size = next(iter(images.values()))[0].size  # (width, height)
    start = time.perf_counter()
    roundtrip = vae_roundtrip(pipe, references, height=size[1], width=size[0])
    seconds[ROUNDTRIP] = time.perf_counter() - start
    ref_emb = scorer.embed(references)
    ref_pix = image_pixels(references, size)
    per_image, rows = [], []
    for method, items in [*images.items(), (ROUNDTRIP, roundtrip)]:
        emb = scorer.embed(items)
        scores = score_method(emb, ref_emb, image_pixels(items, size), ref_pix)
        labels = seeds if method != ROUNDTRIP else [-1] * len(items)  # the round trip has no seed
        frame = pd.DataFrame({"method": method, "seed": labels, **{k: v.numpy() for k, v in scores.items()}})
        per_image.append(frame)
        row: dict[str, Any] = {"method": method, "images": len(items)}
        for name in SCORES:
            row[name] = float(frame[name].mean())
            row[f"{name}_std"] = float(frame[name].std(ddof=0))
        row["diversity"] = diversity(emb) if method != ROUNDTRIP else math.nan
        rows.append(row)
    record = {
        **(settings or {}),
        "seeds": seeds,
        "bandwidth": describe_bandwidth(bandwidth),
        "nw_frame": nw_frame,
        "call": {k: v for k, v in (call_kwargs or {}).items() if isinstance(v, str | int | float | bool)},
        "references": len(references),
        "image_size": list(size),
        "seconds": seconds,
        **scorer.describe(),
    }
    return Comparison(
        references=list(references),
        seeds=seeds,
        images=images,
        per_image=pd.concat(per_image, ignore_index=True),
        table=pd.DataFrame(rows),
        settings=record,
        roundtrip=roundtrip,
    )
