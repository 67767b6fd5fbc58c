"""What :mod:`ipa_probe.tiny.zoo` and its builders share: the run settings, :class:`Run`, :class:`ZooEntry`, the
shared tiny bases (:class:`ZooBases`) and :func:`ip_adapter_pipeline_classes`.

It sits below both :mod:`ipa_probe.tiny.zoo_builders` (which builds each class from these) and
:mod:`ipa_probe.tiny.zoo` (which looks the builders up), so neither imports the other's importer.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import PIL.Image

__all__ = ["PROMPT", "SIZE", "STEPS", "Run", "ZooBases", "ZooEntry", "ip_adapter_pipeline_classes"]

#: The prompt of every run.
PROMPT = "a photo of a flower"
#: Denoising steps of every run.
STEPS = 2

#: Image side of every run unless it says otherwise (8 x 8 latents through the 8x VAEs).
SIZE = 64

_NEGATIVE = "blurry"
_FRAMES = 2


def ip_adapter_pipeline_classes() -> dict[str, type]:
    """Every pipeline class of the installed diffusers whose ``__call__`` takes ``ip_adapter_image``.

    Walks ``diffusers.pipelines`` and imports each ``pipeline_*`` module whose source mentions ``ip_adapter_image``
    itself (a class whose optional dependency is missing is a dummy in ``diffusers``' namespace but real in its
    module); modules that fail to import are skipped. Classes whose ``__call__`` is inherited are found with their
    parent's module only if they are defined there.

    Returns:
        ``{class name: class}``, sorted by name.
    """
    import diffusers.pipelines
    from diffusers import DiffusionPipeline

    found: dict[str, type] = {}
    for info in pkgutil.walk_packages(diffusers.pipelines.__path__, "diffusers.pipelines."):
        if not info.name.rsplit(".", 1)[-1].startswith("pipeline_"):
            continue
        spec = info.module_finder.find_spec(info.name, None)
        origin = Path(spec.origin) if spec is not None and spec.origin else None
        if origin is None or "ip_adapter_image" not in origin.read_text(encoding="utf-8", errors="ignore"):
            continue  # a class defined here cannot take it (one inheriting __call__ would need its parent's module)
        try:
            module = importlib.import_module(info.name)
        except Exception:  # an optional dependency missing: its classes cannot be built here either
            continue
        for name, cls in vars(module).items():
            if (
                inspect.isclass(cls)
                and cls.__module__ == module.__name__
                and issubclass(cls, DiffusionPipeline)
                and "ip_adapter_image" in inspect.signature(cls.__call__).parameters
            ):
                found[name] = cls
    return dict(sorted(found.items()))


@dataclass(frozen=True)
class Run:
    """One call of a zoo pipeline.

    Attributes:
        name: what the run varies (``"cfg"``, ``"no cfg"``, ``"freenoise"``).
        kwargs: keyword arguments of the call besides the prompt, the reference images, the steps and the generator.
        labels: the branch labels diffusers' source gives the batch items of the run, in buffer order.
    """

    name: str
    kwargs: dict[str, Any]
    labels: tuple[str, ...]


@dataclass
class ZooEntry:
    """A built pipeline and how to call it.

    Attributes:
        pipe: the pipeline, with one tiny IP-Adapter loaded.
        runs: its calls.
        notes: what is special about the build or the calls.
        images: how the reference images are passed: ``"list"`` (``ip_adapter_image``, one support set per
            adapter), ``"single"`` (one image: SD3's adapter takes one; pipelines that pass hidden states) or
            ``"embeds"`` (``ip_adapter_image_embeds`` from the pipeline's own ``prepare_ip_adapter_image_embeds``).
        references: how many of the reference images to pass (``None``: all).
        prepare: called before each run with the pipeline (LEdits++ inverts its input image there).
    """

    pipe: Any
    runs: list[Run]
    notes: str = ""
    images: str = "list"
    references: int | None = None
    prepare: Callable[[Any], None] | None = None


CFG = Run("cfg", {"negative_prompt": _NEGATIVE}, ("uncond", "cond"))
NO_CFG = Run("no cfg", {"guidance_scale": 1.0}, ("cond",))


def _image(color: tuple[int, int, int] = (120, 80, 40), size: int = SIZE) -> PIL.Image.Image:
    return PIL.Image.new("RGB", (size, size), color)


def _mask(size: int = SIZE) -> PIL.Image.Image:
    mask = PIL.Image.new("L", (size, size), 0)
    mask.paste(255, (0, 0, size // 2, size))
    return mask


def _with(runs: list[Run], **kwargs) -> list[Run]:
    """The runs with ``kwargs`` added to each."""
    return [Run(run.name, {**run.kwargs, **kwargs}, run.labels) for run in runs]


class ZooBases:
    """The tiny base pipelines the builders share (:meth:`base`), each built once; :class:`~ipa_probe.tiny.zoo.Zoo`
    adds :meth:`~ipa_probe.tiny.zoo.Zoo.build`.

    Args:
        seed: seed of every component's weights.
    """

    def __init__(self, seed: int = 0) -> None:
        self.seed = seed
        self._bases: dict[str, Any] = {}

    # ------------------------------------------------------------------ bases
    def base(self, kind: str) -> Any:
        """A tiny pipeline with an IP-Adapter loaded: ``"sd15"``, ``"sd15-plus"`` (IP-Adapter Plus), ``"sdxl"``,
        ``"flux"`` or ``"sd3"``."""
        if kind not in self._bases:
            from .dit import tiny_flux_pipeline, tiny_sd3_pipeline
            from .sd import tiny_pipeline

            makers = {
                "sd15": lambda: tiny_pipeline("sd15", seed=self.seed),
                "sd15-plus": lambda: tiny_pipeline("sd15", ip_adapter="plus", seed=self.seed),
                "sdxl": lambda: tiny_pipeline("sdxl", seed=self.seed),
                "flux": lambda: tiny_flux_pipeline(seed=self.seed),
                "sd3": lambda: tiny_sd3_pipeline(seed=self.seed),
            }
            self._bases[kind] = makers[kind]()
        return self._bases[kind]
