"""Which attention layers carry an IP-Adapter, and the contracts we keep with diffusers' processors.

diffusers stores IP-Adapter weights inside the attention *processor* (``to_k_ip``/``to_v_ip``), and its loaders find
those processors with ``isinstance``. So ipa_probe never replaces a user's processor class behind their back: the
probe only hooks modules the processor already calls, and the NW head swaps in a *subclass* sharing the same weights.

Three model families are understood (:mod:`~.capture.taps` has where each forms its image-branch query and keys):

- ``"unet"``: SD 1.5 / SDXL UNets, ``IPAdapterAttnProcessor2_0`` / ``IPAdapterAttnProcessor`` in the cross-attention
  layers (``attn2``);
- ``"flux"``: Flux transformers, ``FluxIPAdapterAttnProcessor`` in the double-stream blocks;
- ``"sd3"``: SD3 transformers, ``SD3IPAdapterJointAttnProcessor2_0`` in the joint blocks.

Layer ids are diffusers' ``attn_processors`` keys without ``.processor``, e.g.
``down_blocks.0.attentions.0.transformer_blocks.0.attn2`` or ``transformer_blocks.0.attn``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from diffusers.models.attention import AttentionModuleMixin
from diffusers.models.attention_processor import (
    Attention,
    IPAdapterAttnProcessor,
    IPAdapterAttnProcessor2_0,
    IPAdapterXFormersAttnProcessor,
    SD3IPAdapterJointAttnProcessor2_0,
)
from diffusers.models.transformers.transformer_flux import FluxIPAdapterAttnProcessor
from diffusers.utils.torch_utils import unwrap_module

from .statistics.kernels import dot_logits

__all__ = [
    "FAMILIES",
    "Attachment",
    "Attachments",
    "SUPPORTED_PROCESSORS",
    "IPLayer",
    "LayerSelection",
    "check_layer_selection",
    "compile_selection",
    "claim",
    "denoiser_of",
    "family_of",
    "find_ip_layers",
    "model_of",
    "image_branch_logits",
    "list_hooks",
    "observer",
    "refind_ip_layers",
    "release",
]

#: Processor classes (and their subclasses) whose image branch ipa_probe understands, with their model family.
FAMILIES: dict[type, str] = {
    IPAdapterAttnProcessor2_0: "unet",
    IPAdapterAttnProcessor: "unet",
    FluxIPAdapterAttnProcessor: "flux",
    SD3IPAdapterJointAttnProcessor2_0: "sd3",
}
#: The supported processor classes (and their subclasses).
SUPPORTED_PROCESSORS: tuple[type, ...] = tuple(FAMILIES)

#: Image-prompt processors we recognise but cannot probe (yet), with the reason given to the user.
_UNSUPPORTED_REASONS: dict[str, str] = {
    IPAdapterXFormersAttnProcessor.__name__: "xformers computes the image branch inside one fused call; "
    "switch back with `pipe.unet.set_attn_processor(AttnProcessor2_0())` before `load_ip_adapter`, or call "
    "`pipe.disable_xformers_memory_efficient_attention()`",
}

LayerSelection = str | re.Pattern | Iterable[str] | None

#: ipa_probe's one attribute on a denoiser (its ``__dict__``): a dict of what the attached features keep there (the
#: attachment core with the hook points and interventions, the NW head, the claims), gone with its last entry
STATE_ATTRIBUTE = "_ipa_probe"


def kept(denoiser: torch.nn.Module, key: str, default: Any = None) -> Any:
    """What the features attached to ``denoiser`` keep under ``key`` (:data:`STATE_ATTRIBUTE`), or ``default``."""
    return denoiser.__dict__.get(STATE_ATTRIBUTE, {}).get(key, default)


def keep(denoiser: torch.nn.Module, key: str, value: Any = None) -> None:
    """Keep ``value`` under ``key`` on ``denoiser``, or drop the key for an empty ``value``; the attribute goes with
    its last key, so that a denoiser with nothing attached carries no trace of ipa_probe."""
    state = denoiser.__dict__.setdefault(STATE_ATTRIBUTE, {})
    if value is None or (isinstance(value, list | tuple) and not value):
        state.pop(key, None)
    else:
        state[key] = value
    if not state:
        del denoiser.__dict__[STATE_ATTRIBUTE]


def _supported_names() -> str:
    return ", ".join(cls.__name__ for cls in SUPPORTED_PROCESSORS)


@dataclass(frozen=True)
class IPLayer:
    """One IP-Adapter cross-attention layer.

    Attributes:
        name: the layer id (``attn_processors`` key without ``.processor``).
        attention: the diffusers attention module that owns the processor (``Attention`` or ``FluxAttention``).
        processor: the processor installed when the layer was found.
    """

    name: str
    attention: torch.nn.Module
    processor: torch.nn.Module

    @property
    def heads(self) -> int:
        return self.attention.heads

    @property
    def family(self) -> str:
        """``"unet"``, ``"flux"`` or ``"sd3"`` (see :data:`FAMILIES`)."""
        return family_of(self.processor)

    @property
    def num_adapters(self) -> int:
        """Loaded IP-Adapters: one ``to_k_ip`` per adapter (SD3 processors hold a single adapter, not a list)."""
        to_k_ip = self.processor.to_k_ip
        return len(to_k_ip) if isinstance(to_k_ip, torch.nn.ModuleList | list | tuple) else 1


def family_of(processor: torch.nn.Module) -> str:
    """The model family of a supported IP-Adapter processor (its class or a subclass)."""
    for cls, family in FAMILIES.items():
        if isinstance(processor, cls):
            return family
    raise ValueError(f"expected an IP-Adapter processor of a class in {_supported_names()}, got {type(processor)}")


def denoiser_of(pipe) -> torch.nn.Module:
    """The denoising network of a diffusers pipeline (``pipe.unet`` or ``pipe.transformer``), or the module itself
    if one is passed."""
    if isinstance(pipe, torch.nn.Module):
        return pipe
    for name in ("unet", "transformer"):
        denoiser = getattr(pipe, name, None)
        if isinstance(denoiser, torch.nn.Module):
            return denoiser
    raise TypeError(
        f"expected a diffusers pipeline with a `unet` (SD 1.5 / SDXL) or a `transformer` (Flux, SD3), got "
        f"{type(pipe).__name__}; pass a pipeline such as StableDiffusionPipeline or FluxPipeline (see "
        "ipa_probe.tiny.sd.tiny_pipeline and ipa_probe.tiny.dit for small ones)"
    )


def model_of(pipe) -> torch.nn.Module:
    """:func:`denoiser_of` beneath a ``torch.compile`` wrapper: the model whose module ids are diffusers' own (no
    ``_orig_mod.`` prefix) and whose modules the compiled code calls."""
    return unwrap_module(denoiser_of(pipe))


def check_layer_selection(layers: LayerSelection) -> None:
    """Raise ``TypeError`` / ``ValueError`` unless ``layers`` is ``None``, a regex, a compiled pattern or a list of
    them, each a valid regular expression (whether it matches a layer is checked against the pipeline)."""
    compile_selection(layers)


def compile_selection(layers: LayerSelection) -> list[re.Pattern] | None:
    if layers is None:
        return None
    if isinstance(layers, str | re.Pattern):
        layers = [layers]
    elif isinstance(layers, bytes | dict) or not hasattr(layers, "__iter__"):
        raise TypeError(f"layers: expected a regex string, a compiled pattern or a list of them, got {layers!r}")
    patterns = []
    for item in layers:
        if isinstance(item, re.Pattern):
            patterns.append(item)
        elif isinstance(item, str):
            try:
                patterns.append(re.compile(item))
            except re.error as err:
                raise ValueError(f"layers: {item!r} is not a valid regular expression ({err})") from None
        else:
            raise TypeError(f"layers: expected a regex string, a compiled pattern or a list of them, got {item!r}")
    return patterns


def find_ip_layers(pipe, layers: LayerSelection = None) -> list[IPLayer]:
    """Find the IP-Adapter cross-attention layers of a pipeline (or denoiser), optionally selected by regex.

    ``pipe``: a diffusers pipeline with a ``unet`` or ``transformer``, or the denoiser module itself. ``layers``:
    ``None`` for all IP layers; a regex (``re.search`` on the layer id) or a list of them (union). Returns the
    selected layers in module order; nothing is modified. ValueError, naming the remedy: no IP-Adapter is loaded, a
    processor class is not supported, or the selection matches nothing.
    """
    denoiser = model_of(pipe)
    patterns = compile_selection(layers)
    found: list[IPLayer] = []
    for name, module in denoiser.named_modules():
        if not isinstance(module, Attention | AttentionModuleMixin):
            continue
        processor = module.processor
        if isinstance(processor, SUPPORTED_PROCESSORS):
            found.append(IPLayer(name, module, processor))
        elif hasattr(processor, "to_k_ip") or type(processor).__name__ in _UNSUPPORTED_REASONS:
            cls = type(processor).__name__
            reason = _UNSUPPORTED_REASONS.get(cls, "its image branch is not one ipa_probe knows how to read")
            raise ValueError(
                f"layer {name!r} uses the unsupported processor class {cls}: {reason}. "
                f"Supported processor classes: {_supported_names()}."
            )
    if not found:
        raise ValueError(
            "this pipeline has no IP-Adapter loaded (no attention layer uses an IP-Adapter processor); call "
            "`pipe.load_ip_adapter(...)` first (ipa_probe.tiny.sd.tiny_pipeline() and "
            "ipa_probe.tiny.dit.tiny_flux_pipeline() / tiny_sd3_pipeline() give small pipelines with one). "
            f"Supported processor classes: {_supported_names()}."
        )
    families = {layer.family for layer in found}
    if len(families) > 1:
        raise ValueError(
            f"this denoiser mixes IP-Adapter processors of the families {sorted(families)}; ipa_probe reads one "
            "model family at a time: load the IP-Adapter that matches the model with `pipe.load_ip_adapter(...)`"
        )
    if patterns is None:
        return found
    selected = [layer for layer in found if any(p.search(layer.name) for p in patterns)]
    if not selected:
        shown = ", ".join(layer.name for layer in found[:4])
        raise ValueError(
            f"layers={[p.pattern for p in patterns]} matched none of the {len(found)} IP-Adapter layers "
            f"(e.g. {shown}); pass a regex that `re.search` finds in one of these ids, or None for all"
        )
    return selected


def refind_ip_layers(pipe, layers: list[IPLayer], selection: LayerSelection = None) -> list[IPLayer] | None:
    """The IP-Adapter layers of ``pipe`` found again after processors were replaced (``load_ip_adapter`` called
    again, or processor subclasses swapped in, ``selection`` the one they were found with), when they match the
    ``layers`` found before: the same ids, families, adapter counts and heads, each with its current processor.
    ``None`` when no layer holds an IP-Adapter processor any more (``unload_ip_adapter``); RuntimeError, naming
    ``load_ip_adapter``, when the layers, adapters or heads changed.
    """
    if not any(isinstance(layer.attention.processor, SUPPORTED_PROCESSORS) for layer in layers):
        return None
    try:
        found = find_ip_layers(pipe, selection)
    except ValueError:
        found = []

    def shape(layers: list[IPLayer]) -> list[tuple]:
        return [(layer.name, layer.family, layer.num_adapters, layer.heads) for layer in layers]

    if shape(found) != shape(layers):
        adapters = max((layer.num_adapters for layer in found), default=0)
        raise RuntimeError(
            "the IP-Adapter layers changed while ipa_probe was attached (`load_ip_adapter` or `set_attn_processor` "
            f"ran inside the block): {len(layers)} layers with {max(layer.num_adapters for layer in layers)} "
            f"adapter(s) were found before, now {len(found)} layers with {adapters}; call `pipe.load_ip_adapter(...)` "
            "before the `with` block, or start a new block after loading"
        )
    return found


def image_branch_logits(
    processor: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, other: torch.Tensor | None = None
) -> torch.Tensor:
    """The logits whose softmax over image tokens a processor's image branch uses, ``(B, H, Q, K)`` from queries
    ``(B, H, Q, D)`` and keys ``(B, H, K, D)``: diffusers' IP-Adapter processors (SD/SDXL, Flux, SD3) use ``q k^T /
    sqrt(d)`` on what :mod:`ipa_probe.capture.taps` reads; a processor may define its own ``image_branch_logits(query,
    key, other)`` (ipa_probe's NW heads do), ``other`` the further keys its softmax runs over (SD3's latent keys)."""
    custom = getattr(processor, "image_branch_logits", None)
    if custom is not None:
        return custom(query, key, other)
    return dot_logits(query, key, 1.0 / math.sqrt(query.shape[-1]))


def observer(fn: Callable) -> Callable:
    """A hook that runs eagerly even inside a compiled denoiser: ``torch.compile`` breaks the graph around it, so the
    hook sees the real tensors and its side effects (stores, counters) happen once per call."""
    return torch.compiler.disable(fn)


@dataclass(frozen=True)
class Attachment:
    """What one ipa_probe feature has attached to a denoiser (see :func:`list_hooks`).

    Attributes:
        feature: ``"probe"`` or ``"nw_head"``.
        layers: the layer ids it touches.
        what: how, in words (e.g. read-only forward hooks, or swapped processors and the bandwidth).
    """

    feature: str
    layers: tuple[str, ...] = ()
    what: str = ""

    def __repr__(self) -> str:
        return f"Attachment({self.feature!r}, {_count_layers(self.layers)}, {self.what!r})"


def _count_layers(layers: Sequence[str]) -> str:
    return f"{len(layers)} layer{'s' if len(layers) != 1 else ''}"


class Attachments(list):
    """The records :func:`list_hooks` returns: a plain ``list`` of :class:`Attachment`, shown as a table."""

    def to_dataframe(self):
        """One row per feature: ``feature``, ``layers`` (how many), ``what``, ``layer_ids`` (the full ids)."""
        import pandas as pd

        columns = ["feature", "layers", "what", "layer_ids"]
        return pd.DataFrame([(a.feature, len(a.layers), a.what, list(a.layers)) for a in self], columns=columns)

    def __repr__(self) -> str:
        if not self:
            return "[]"
        rows = [("feature", "layers", "what")] + [(a.feature, _count_layers(a.layers), a.what) for a in self]
        widths = [max(len(row[i]) for row in rows) for i in range(2)]
        return "\n".join(f"{f:<{widths[0]}}  {n:<{widths[1]}}  {w}".rstrip() for f, n, w in rows)

    def _repr_html_(self) -> str:  # notebooks
        return self.to_dataframe().drop(columns="layer_ids").to_html(index=False)


def list_hooks(pipe) -> Attachments:
    """What ipa_probe has attached to a pipeline right now, one record per active feature, in order of attachment.

    Empty when nothing is attached (every feature removes its record with its hooks). The result is a ``list`` of
    :class:`Attachment` that prints as a table (``to_dataframe()`` gives a pandas one, with the layer ids).

    Example:
        ```py
        >>> with ipa_probe.nw_head(pipe), ipa_probe.probe(pipe):
        ...     print(ipa_probe.list_hooks(pipe))
        feature  layers     what
        nw_head  10 layers  NW processors swapped in, bandwidth=matched, frame=stored
        probe    10 layers  read-only forward hooks (image branch), bandwidth=matched
        ```
    """
    return Attachments(kept(denoiser_of(pipe), "claims", ()))


def claim(pipe, feature: str, layers: Iterable[str] = (), what: str = "", *, exclusive: bool = True) -> Attachment:
    """Mark a pipeline's denoiser as being modified by ``feature`` (e.g. ``"probe"``) in ``layers`` (ids), ``what``
    saying how for :func:`list_hooks`; raise if it already is, unless ``exclusive=False`` (features that nest, like
    ``intervene``). Returns this claim's record, for :func:`release` (nested claims each release their own).
    """
    denoiser = denoiser_of(pipe)
    claims = kept(denoiser, "claims", ())
    if exclusive and any(c.feature == feature for c in claims):
        raise RuntimeError(
            f"{feature!r} is already active on this pipeline (ipa_probe.list_hooks(pipe) lists it); leave its "
            "block (or remove it) before attaching it again"
        )
    own = Attachment(feature, tuple(layers), what)
    keep(denoiser, "claims", (*claims, own))
    return own


def release(pipe, feature: str, attachment: Attachment | None = None) -> None:
    """Undo :func:`claim` (every claim of ``feature``, or only ``attachment``, one of :func:`list_hooks`); the
    denoiser is left without any ipa_probe attribute once nothing claims it."""
    denoiser = denoiser_of(pipe)
    claims = kept(denoiser, "claims", ())
    left = tuple(c for c in claims if (c is not attachment if attachment is not None else c.feature != feature))
    keep(denoiser, "claims", left)
