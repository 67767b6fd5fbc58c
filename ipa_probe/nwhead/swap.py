"""The NW-head swap: put each family's NW processor into a pipeline's IP-Adapter layers, and take it out again.

The feature has diffusers' hooks shape: a :class:`NWHeadConfig` validated on construction, :func:`apply_nw_head` /
:func:`remove_nw_head` (and the context manager :func:`nw_head`), the name :data:`NW_HEAD` under which the swap is
claimed on the denoiser (see :func:`ipa_probe.list_hooks`), and removal in one place, :meth:`NWHeadSwap.remove`.
This module sits above the per-family processors (:mod:`.unet`, :mod:`.flux`, :mod:`.sd3`) and picks one per layer.

Two frames (see :mod:`.kernel`): ``frame="stored"`` (the default) takes the key term ``|k|^2 / (2 h^2)`` from the
stored keys and so depends on the basis the q/k weights are stored in (a per-head ``q -> A q``, ``k -> A^-T k`` that
changes no output of the model changes its images); ``frame="query"`` takes it from the current pass's own logits and
gives the same images for every such basis. Usage: docs/nw-head.md.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from .._checks import check_nw_frame
from ..capture import spine
from ..layers import (
    IPLayer,
    LayerSelection,
    check_layer_selection,
    claim,
    denoiser_of,
    find_ip_layers,
    keep,
    kept,
    list_hooks,
    model_of,
    release,
)
from ..statistics import bandwidth as bw
from ..statistics.bandwidth import BandwidthSpec
from .flux import FluxNWHeadAttnProcessor
from .kernel import TimestepClock, check_head_bandwidth
from .sd3 import SD3NWHeadAttnProcessor
from .unet import NWHeadAttnProcessor

__all__ = ["NW_HEAD", "NW_PROCESSORS", "NWHeadConfig", "NWHeadSwap", "apply_nw_head", "nw_head", "remove_nw_head"]

logger = logging.getLogger(__name__)

#: The feature's name: its claim on the denoiser (:func:`ipa_probe.list_hooks`) and the key of its state there.
NW_HEAD = "nw_head"

#: The NW processor of each model family (see :data:`ipa_probe.layers.FAMILIES`).
NW_PROCESSORS: dict[str, type] = {
    "unet": NWHeadAttnProcessor,
    "flux": FluxNWHeadAttnProcessor,
    "sd3": SD3NWHeadAttnProcessor,
}


@dataclass(frozen=True)
class NWHeadConfig:
    """Settings of the NW-head swap, validated on construction (nothing about a pipeline is touched here).

    Args:
        bandwidth: the Gaussian bandwidth ``h`` of the image branch: ``"matched"`` (``h^2 = sqrt(d_head)``, the
            learned head's own temperature, so the two heads differ only by the key-norm bias), a positive float,
            or a callable of the timestep (see :mod:`ipa_probe.statistics.bandwidth`). Stored frame only: the query
            frame's logits are the model's own ``q·k / sqrt(d_head)`` and any other value than ``"matched"`` is
            refused.
        layers: a regex (``re.search`` on the layer id), a list of them, or ``None`` for every IP-Adapter layer.
        frame: ``"stored"`` (default): the key term is ``|k_i|^2 / (2 h^2)`` of the stored keys, which depends on
            the basis the q/k weights are stored in (gauge dependent). ``"query"``: the key term is
            ``b_i = log mean_q exp(L_qi)`` over the current call's queries (per layer, head, batch item and step),
            ``L`` the row-centred model logits; a function of the logits alone, hence gauge invariant.
        form: query frame only: ``"exact"`` (default) or ``"gaussian"`` (``b_i = mean_q L_qi + Var_q(L_qi) / 2``);
            see :func:`ipa_probe.statistics.kernels.query_frame_bias`.
    """

    bandwidth: BandwidthSpec = "matched"
    layers: LayerSelection = None
    frame: str = "stored"
    form: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "bandwidth", check_head_bandwidth(self.bandwidth))
        frame, form = check_nw_frame(self.frame, self.form, self.bandwidth)
        object.__setattr__(self, "frame", frame)
        object.__setattr__(self, "form", form)
        check_layer_selection(self.layers)

    def describe(self) -> dict[str, Any]:
        """JSON-friendly settings: ``bandwidth``, ``layers``, ``frame``, ``form`` and ``gauge`` (what the head's
        images are invariant under)."""
        layers = self.layers
        return {
            "bandwidth": bw.describe(self.bandwidth),
            "layers": layers if isinstance(layers, str | None) else [getattr(p, "pattern", p) for p in layers],
            "frame": self.frame,
            "form": self.form,
            "gauge": (
                "invariant: key term from the current pass's logits (per layer, head, batch item and step)"
                if self.frame == "query"
                else "dependent: key term |k|^2 from the stored keys"
            ),
        }

    def summary(self) -> str:
        """One line for logs and :func:`ipa_probe.list_hooks`."""
        if self.frame == "query":
            return f"frame=query (form={self.form}, the model's own temperature)"
        return f"bandwidth={bw.describe(self.bandwidth)}, frame=stored"


@dataclass
class NWHeadSwap:
    """An installed NW head: what was replaced, so that it can be put back.

    Attributes:
        config: the settings.
        originals: processor key (``<layer id>.processor``) -> the processor object that was there.
        installed: processor key -> the NW processor put in its place.
        clock: the timestep holder (hooked to the denoiser only for a callable bandwidth).
    """

    config: NWHeadConfig
    originals: dict[str, torch.nn.Module]
    installed: dict[str, torch.nn.Module]
    clock: TimestepClock = field(default_factory=TimestepClock)
    _denoiser: torch.nn.Module | None = field(default=None, repr=False)
    _handle: Any = field(default=None, repr=False)

    @property
    def layers(self) -> list[str]:
        """The swapped layer ids."""
        return [key.removesuffix(".processor") for key in self.installed]

    @property
    def active(self) -> bool:
        return self._denoiser is not None

    def remove(self) -> None:
        """Put the original processors back where the NW head still sits and drop the claim; idempotent.

        The one place where the swap is undone (:func:`remove_nw_head`, :func:`nw_head` and a failed
        :func:`apply_nw_head` all come here). Layers that no longer hold the NW processor (e.g. after
        ``pipe.unload_ip_adapter()`` inside the block) are left as they are, so an unloaded adapter is not resurrected.
        """
        denoiser = self._denoiser
        if denoiser is None:
            return
        try:
            if self._handle is not None:
                spine.detach(denoiser, self.clock)
                self._handle = None
            model = model_of(denoiser)  # diffusers' own processor keys
            current = model.attn_processors
            restore = {key: self.originals[key] for key, nw in self.installed.items() if current.get(key) is nw}
            if restore:
                processors = {**current, **restore}
                model.set_attn_processor(dict(processors))  # set_attn_processor pops what it is given: a copy
            skipped = len(self.installed) - len(restore)
            if skipped:
                logger.info("nw_head: %d layer(s) no longer held the NW head and were left as they are", skipped)
        finally:
            keep(denoiser, NW_HEAD, None)
            release(denoiser, NW_HEAD)
            self._denoiser = None


def _nw_processor(layer: IPLayer, config: NWHeadConfig, clock: TimestepClock) -> torch.nn.Module:
    """The NW head for one layer, of its model family's class."""
    return NW_PROCESSORS[layer.family](layer.processor, config.bandwidth, clock, frame=config.frame, form=config.form)


def apply_nw_head(
    pipe,
    bandwidth: BandwidthSpec = "matched",
    *,
    layers: LayerSelection = None,
    frame: str = "stored",
    form: str | None = None,
) -> NWHeadSwap:
    """Swap the NW head into a pipeline's IP-Adapter layers (until :func:`remove_nw_head`).

    Prefer the context manager :func:`nw_head` in scripts; this pair is for notebooks. Arguments as in :func:`nw_head`.

    Returns:
        the :class:`NWHeadSwap` (its ``layers`` lists the swapped layer ids).

    Raises:
        ValueError / TypeError: bad settings, no IP-Adapter, an unsupported processor, a selection matching nothing:
            raised before anything is modified.
        RuntimeError: the NW head is already applied to this pipeline.
    """
    config = NWHeadConfig(bandwidth, layers, frame, form)
    found = find_ip_layers(pipe, config.layers)
    gauged = {name for c in list_hooks(pipe) if c.feature == "gauge" for name in c.layers}
    if config.frame == "stored" and gauged & {layer.name for layer in found}:  # as the gauge refuses a stored head
        raise ValueError(
            "nw_head(frame='stored') reads the NW key term |k|^2, which the active q/k gauge changes; leave the "
            "gauge first, or swap in nw_head(pipe, frame='query')"
        )
    clock = TimestepClock()  # a client of the pipeline's spine, whose clock knows where the timestep is
    installed = {f"{layer.name}.processor": _nw_processor(layer, config, clock) for layer in found}
    what = f"NW processors swapped in, {config.summary()}"
    claim(pipe, NW_HEAD, [layer.name for layer in found], what)
    swap = NWHeadSwap(config, {f"{layer.name}.processor": layer.processor for layer in found}, installed, clock)
    swap._denoiser = denoiser = denoiser_of(pipe)
    try:
        keep(denoiser, NW_HEAD, swap)
        model = model_of(denoiser)  # diffusers' own processor keys
        model.set_attn_processor({**model.attn_processors, **installed})  # a fresh dict: it is popped
        if callable(config.bandwidth):
            swap._handle = spine.attach(pipe, clock)
    except BaseException:
        swap.remove()
        raise
    logger.info("nw_head: swapped %d IP-Adapter layer(s), %s", len(found), config.summary())
    return swap


def remove_nw_head(pipe) -> None:
    """Undo :func:`apply_nw_head`: put the original processor objects back (see :meth:`NWHeadSwap.remove`).

    Raises:
        ValueError: no NW head is applied to this pipeline.
    """
    swap = kept(denoiser_of(pipe), NW_HEAD)
    if swap is None:
        raise ValueError("no NW head is applied to this pipeline; call ipa_probe.nwhead.apply_nw_head(pipe) first")
    swap.remove()


@contextlib.contextmanager
def nw_head(
    pipe,
    bandwidth: BandwidthSpec = "matched",
    *,
    layers: LayerSelection = None,
    frame: str = "stored",
    form: str | None = None,
) -> Iterator[NWHeadSwap]:
    """Run a pipeline with the NW head in its IP-Adapter layers; the original processors come back on exit.

    On exit (normal, exception or KeyboardInterrupt) every layer that still holds the NW head gets its original
    processor object back; ``set_ip_adapter_scale`` inside the block acts on the shared ``scale`` lists and so
    persists, and ``unload_ip_adapter`` inside the block is respected.

    Args:
        pipe: a diffusers pipeline (SD 1.5 / SDXL, Flux, SD3) with an IP-Adapter loaded, or its denoiser.
        bandwidth: ``"matched"`` (``h^2 = sqrt(d_head)``), a positive float, or a callable of the timestep (0-d
            tensor on the device, scheduler scale 0-1000 -> float or tensor). Stored frame only.
        layers, frame, form: as :class:`NWHeadConfig` states them (``frame="stored"``, the default, is gauge
            dependent: two models related by a per-head basis change of q/k give different images; ``"query"`` not).

    Yields:
        the :class:`NWHeadSwap`.

    Example:
        ```py
        >>> with ipa_probe.nw_head(pipe, bandwidth="matched"):
        ...     image = pipe("a photo", ip_adapter_image=[refs], num_inference_steps=4).images[0]
        ```
    """
    swap = apply_nw_head(pipe, bandwidth, layers=layers, frame=frame, form=form)
    try:
        yield swap
    finally:
        swap.remove()
