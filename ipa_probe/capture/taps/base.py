"""The tap interface: what a model family tells the family-agnostic probe (see the package docstring)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from ...layers import IPLayer
from ...statistics.kernels import split_heads

__all__ = ["Capture", "DenoiserPass", "Tap", "heads_first", "layer_module", "normalise_masks"]

RecordFn = Callable[[int, int, torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None], None]


def normalise_masks(masks: Any) -> list[torch.Tensor | None] | None:
    """diffusers' ``ip_adapter_masks`` as one entry per adapter, each ``(1 or B, images, height, width)`` or ``None``.

    Args:
        masks: what the pipeline passes in ``cross_attention_kwargs`` (or ``joint_attention_kwargs``): a list with
            one entry per adapter, the legacy tensor form ``(adapters, 1, height, width)``, or ``None``.

    Returns:
        the list (``None`` when no masks); its entries as given (a reader checks they are tensors).
    """
    if isinstance(masks, torch.Tensor):  # diffusers' legacy form: (adapters, 1, height, width)
        return list(masks.unsqueeze(1))
    return None if masks is None else list(masks)


def layer_module(layer: IPLayer, site: str, branch: int | str = 0) -> torch.nn.Module:
    """The module of ``layer`` whose forward hook sees ``site`` of ``branch``, the one place that knows them (per
    family: :mod:`~ipa_probe.capture.taps`): ``"q"`` the query the image branch uses; ``"k"``, ``"v"`` the key and
    value projections of an adapter (``branch``: its index; their pre-hooks see the image tokens; SD3's keys:
    ``norm_ip_k``, its latent tokens' (``"latent"``) ``norm_k``, their values ``to_v``) or of the text (``"text"``);
    ``"out"`` where the branch's output joins the layer's (UNet and SD3 ``to_out[0]``, Flux the attention's third
    output)."""
    attn, processor, family = layer.attention, layer.processor, layer.family
    if site == "out":
        return attn if family == "flux" else attn.to_out[0]
    if site == "q":
        return attn.to_q if family == "unet" else attn.norm_q if family == "flux" else processor.norm_q
    if branch == "text":
        return attn.to_k if site == "k" else attn.to_v
    if family == "sd3":  # image (``branch`` 0) or latent tokens'
        return {"k": (processor.norm_ip_k, processor.norm_k), "v": (processor.to_v_ip, attn.to_v)}[site][branch != 0]
    return (processor.to_k_ip if site == "k" else processor.to_v_ip)[branch]


def heads_first(layer: IPLayer, query: torch.Tensor) -> torch.Tensor:
    """What ``layer``'s ``"q"`` module returns (:func:`layer_module`) as ``(B, H, Q, D)``."""
    if layer.family == "unet":
        return split_heads(query, layer.heads)  # (B, Q, H*D) -> (B, H, Q, D)
    return query.transpose(1, 2) if layer.family == "flux" else query  # Flux (B, N, H, D); SD3 heads first already


@dataclass
class Capture:
    """What a tap's hooks talk to.

    Attributes:
        record: ``record(layer_index, slot, query, keys, other_keys, rows)`` with ``query`` ``(B, H, Q, D)``,
            ``keys`` ``(B, H, K, D)`` (the image tokens of adapter ``slot``, or the text tokens in the text slot),
            ``other_keys`` ``(B, H, N, D)``, the further keys the same softmax runs over (SD3's latent keys), or
            ``None``, and ``rows`` ``(B, Q)`` bool, the queries the branch's output reaches (an IP-Adapter mask), or
            ``None`` for all.
        recording: whether the current denoiser pass is recorded (set by the probe's step clock).
        spine: the pipeline's :class:`~ipa_probe.capture.spine.Spine`: its per-layer hooks keep what a layer computed
            (:attr:`~ipa_probe.capture.spine.LayerHooks.seen`, the query the keys pair with), and an edit of a
            layer's weights point publishes the weights the layer used there; a record of such a layer waits for them
            (:meth:`Tap._record`).
    """

    record: RecordFn
    recording: bool = False
    spine: Any = None


@dataclass(frozen=True)
class DenoiserPass:
    """How one denoiser call fits the denoising loop.

    Attributes:
        new_step: whether it starts a new denoising step (the first pass of a step). Further passes of a step (Flux's
            true-CFG negative pass, a panorama's views, SAG's degraded pass) are recorded at the same step.
        record: ``False`` for passes the probe must not record (e.g. SD3's skip-layer-guidance pass).
        label: for a guidance pass that is not a branch of the loop, the label all its batch items get (``"sag"``);
            ``None`` to label its items from evidence (:mod:`~ipa_probe.capture.branches`).
    """

    new_step: bool
    record: bool = True
    label: str | None = None


class Tap:
    """The per-family knowledge the probe needs. One instance per probe run (it may keep per-call state).

    Args:
        pipe: the pipeline (read for its CFG setting, scheduler and components).
        layers: the IP-Adapter layers to read, all of this tap's family.
    """

    family: ClassVar[str] = ""
    #: Positions of the denoiser's ``forward`` arguments the probe (and the NW head) read, by name. This is the one
    #: place that knows them: everything else asks :meth:`argument`.
    ARGUMENTS: ClassVar[dict[str, int]] = {}
    #: The name of the latent input among :data:`ARGUMENTS`.
    SAMPLE: ClassVar[str] = "hidden_states"
    #: Whether :meth:`install` can read the text cross-attention (``kind="text"``).
    supports_text: ClassVar[bool] = False

    def __init__(self, pipe, layers: list[IPLayer]) -> None:
        self.pipe = pipe
        self.layers = layers
        #: the pipeline whose call is running now: the probed one, or a ``from_pipe`` sibling sharing its denoiser
        #: (set by the probe before each pass)
        self.running = pipe

    @classmethod
    def argument(cls, name: str, args: tuple, kwargs: dict) -> Any:
        """The denoiser-call argument ``name`` (e.g. ``"timestep"``), passed by position or keyword; ``None`` when
        absent.

        Args:
            name: a key of :data:`ARGUMENTS`.
            args, kwargs: the denoiser call's arguments, as a forward pre-hook registered ``with_kwargs`` sees them.
        """
        position = cls.ARGUMENTS[name]
        return args[position] if len(args) > position else kwargs.get(name)

    # ------------------------------------------------------------------ the step clock
    def begin_call(self, args: tuple, kwargs: dict) -> None:
        """A new pipeline call starts with this denoiser call."""

    def on_encode(self) -> None:
        """The pipeline is about to encode its prompts (a new call's evidence starts)."""

    def text_mask(self, layout, context: torch.Tensor | None) -> torch.Tensor | None:
        """The text keys' mask ``(B, tokens)`` of a pass (bool, ``True`` for real prompt tokens) when the tap reads
        the text branch, else ``None``.

        Args:
            layout: the pass's :class:`~ipa_probe.capture.branches.Layout`.
            context: the pass's ``encoder_hidden_states``.
        """
        return None

    def reset(self) -> None:
        """Forget per-call state (called when the probe ends, so that no tensor outlives the run)."""

    def begin_pass(self, args: tuple, kwargs: dict) -> DenoiserPass:
        """Place a denoiser call in the loop (default: every call is a step holding every branch)."""
        return DenoiserPass(new_step=True)

    def sample(self, args: tuple, kwargs: dict) -> torch.Tensor:
        """The latent input of a denoiser call (its device and batch size are used)."""
        return self.argument(self.SAMPLE, args, kwargs)

    def timestep(self, args: tuple, kwargs: dict) -> torch.Tensor | float | None:
        """The scheduler timestep of a denoiser call, on the scheduler's scale (0-1000 for all families here)."""
        return self.argument("timestep", args, kwargs)

    @staticmethod
    def image_embeds(kwargs: dict) -> Any:
        """A call's image embeddings: per adapter ``(B, images, D)`` (SD3: one ``(B, tokens, D)``), or None."""
        extra = kwargs.get("added_cond_kwargs") or kwargs.get("joint_attention_kwargs") or {}
        return extra.get("image_embeds", extra.get("ip_adapter_image_embeds"))

    # ------------------------------------------------------------------ taps
    def install(self, capture: Capture, images: bool, text_slot: int | None) -> list[Any]:
        """Add the callbacks that deliver ``(q, k)`` pairs to ``capture.record`` to the spine's per-layer hooks (the
        query kept there, the keys read as their module returns them); return them (each has ``remove()``)."""
        hooks, handles = capture.spine.hooks, []
        for index, layer in enumerate(self.layers):
            sd3 = layer.family == "sd3"  # whose joint softmax also runs over its latent keys
            handles += hooks.keep(layer, ("q", 0), *[("k", "latent")] * sd3)
            handles.append(hooks.add(layer.attention, self._deferred(capture, index)))
            slots = [(branch, branch) for branch in range(layer.num_adapters)] if images else []
            for branch, slot in slots + [("text", text_slot)] * (text_slot is not None):
                handles.append(hooks.add(layer_module(layer, "k", branch), self._keys(capture, index, slot)))
        return handles

    def _keys(self, capture: Capture, index: int, adapter: int) -> Callable:
        """Forward hook on the keys of an adapter or the text (slot ``adapter``): record them against the kept query
        (:meth:`_record`), with SD3's latent keys and the rows a mask leaves (:meth:`_rows`)."""
        layer = self.layers[index]

        def hook(module, args, output):
            query = self._query(capture, index)  # (B, H, Q, D)
            if query is None:
                return
            # the processor views the keys with the query's batch size, as here (after a callback turns CFG off
            # mid-run, the unconditional and conditional image tokens become one item's keys); SD3's: (B, H, K, D)
            if layer.family != "sd3":
                output = split_heads(output.reshape(query.shape[0], -1, output.shape[-1]), layer.heads)
            latent = self._query(capture, index, "k", "latent")
            self._record(capture, index, adapter, query, output, latent, self._rows(capture, index, adapter, query))

        return hook

    def _rows(self, capture: Capture, index: int, adapter: int, query: torch.Tensor) -> torch.Tensor | None:
        """The queries ``(B, Q)`` an adapter's keys reach in this call of layer ``index`` (``None``: all)."""
        return None

    def _query(self, capture: Capture, index: int, site: str = "q", branch: int | str = 0) -> torch.Tensor | None:
        """What layer ``index`` computed at ``site`` in this call (the query heads first), while recording."""
        return capture.spine.hooks.seen.get((self.layers[index].name, site, branch)) if capture.recording else None

    def map_elements(self, layer: IPLayer, args: tuple, kwargs: dict) -> int:
        """Elements per head of the image-branch weights of ``layer`` in one recorded step (all adapters)."""
        raise NotImplementedError

    def _record(self, capture: Capture, index: int, adapter: int, *record) -> None:
        """``capture.record(index, adapter, *record)`` now, or, when a client edits a point of this layer's image
        branch in this pass, when the layer returns (:meth:`_deferred`), with the weights the layer used."""
        if (self.layers[index].name, adapter) in capture.spine.weight_edits:
            capture.spine.hooks.seen.setdefault(self._held(capture, index, "deferred"), []).append((adapter, record))
            return
        capture.record(index, adapter, *record)

    def _deferred(self, capture: Capture, index: int) -> Callable:
        """Forward hook on the attention module: record what waited for the layer's edited weights."""

        def hook(module, args, output):
            name = self.layers[index].name
            for adapter, record in capture.spine.hooks.seen.pop(self._held(capture, index, "deferred"), []):
                capture.record(index, adapter, *record, capture.spine.used.get((name, adapter, "weights")))

        return hook

    def _held(self, capture: Capture, index: int, what: str) -> tuple[str, str, int]:
        """Where this tap's ``capture`` holds ``what`` for the running call of layer ``index`` among what the layer
        keeps (another probe on the same pipeline holds its own)."""
        return (self.layers[index].name, what, id(capture))
