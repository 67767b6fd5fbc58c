"""The intervention's lifecycle: :func:`intervene` (and :func:`apply_intervention` / :func:`remove_intervention`).

A client of the pipeline's attachment core (:mod:`ipa_probe.capture.spine`: the step clock, its per-layer hooks, and
where an ablation says which references the keys kept, so that a probe inside reads them), it edits the adapter's image
tokens in the pre-hooks of ``to_k_ip`` / ``to_v_ip`` (SD3: of the joint attention), or for ``"scale"`` the weights at
the hook points (SD3: the logits; :func:`~.custom.scale_hooks`; factor 0 and an ablation differ); nothing is replaced,
so removing the callbacks gives the pipeline back bit for bit. What each mode does, and where: docs/attribution.md,
"The causal comparison: interventions". ``hooks=`` attaches callbacks to named hook points instead (:mod:`.custom`).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import torch
from diffusers.models.embeddings import ImageProjection

from .._checks import check_steps_ran
from ..capture import spine
from ..capture.spine import EDIT, Spine
from ..capture.taps.base import layer_module
from ..layers import IPLayer, LayerSelection, claim, denoiser_of, find_ip_layers, model_of, release
from .config import INTERVENE, InterventionConfig
from .custom import HookIntervention, apply_hooks

__all__ = ["Intervention", "apply_intervention", "intervene", "remove_intervention"]

logger = logging.getLogger(__name__)


@dataclass
class Intervention:
    """An applied intervention: its settings, what it hooks, and what it has done.

    Attributes:
        config, layers: the settings and the intervened layer ids.
        acted: ``(step, layer id)`` pairs where the reference's tokens were changed, in order (read it after the
            pipeline call to check that the selection did what was meant).
        step: the current denoising loop index (``-1`` before the first denoiser call).
    """

    config: InterventionConfig
    layers: list[str]
    acted: list[tuple[int, str]] = field(default_factory=list)
    step: int = -1
    _denoiser: torch.nn.Module | None = field(default=None, repr=False)
    _handles: list[Any] = field(default_factory=list, repr=False)
    _pipe: Any = field(default=None, repr=False)
    _spine: Spine | None = field(default=None, repr=False)
    _claim: Any = field(default=None, repr=False)
    _acting: bool = field(default=False, repr=False)
    _conditioned: torch.Tensor | None = field(default=None, repr=False)
    _other_tokens: torch.Tensor | None = field(default=None, repr=False)
    _other_embeds: torch.Tensor | None = field(default=None, repr=False)  # SD3: the resampler runs per timestep
    _watching: bool = field(default=False, repr=False)
    _emptied: bool = field(default=False, repr=False)
    #: the most denoising steps a pipeline call has run while attached (to check ``steps`` against on exit)
    steps_run: int = 0
    #: the passes its step selection selected
    selected: int = 0

    @property
    def active(self) -> bool:
        return self._denoiser is not None

    def remove(self) -> None:
        """Remove every hook and the claim; idempotent. The one place where the intervention is undone."""
        denoiser = self._denoiser
        if denoiser is None:
            return
        try:
            handles, self._handles = self._handles, []
            for handle in handles:  # the token edits' callbacks, or the scale's points
                handle.remove()
        finally:
            release(denoiser, INTERVENE, self._claim)
            if self._spine is not None:
                if self._watching:
                    self._spine.watch_prompts(False)
                spine.detach(self._pipe, self)
            self._spine = None
            self._denoiser = None
            self._conditioned = None
            self._other_tokens = self._other_embeds = None

    # ------------------------------------------------------------------ hooks
    def on_pass(self, spine: Spine, args: tuple, kwargs: dict) -> None:
        """Read the loop index from the spine's clock, check the call's masks, and find the conditioned rows (and,
        on SD3, the other image's tokens at this timestep) for a swap."""
        self.step = spine.now.step
        if self.config.mode == "scale":  # its hook points' user acts (:func:`_attach_scale`)
            return
        when = holds_references if self._watching else None  # Flux
        self._acting = spine.selects(self, self.config.steps, when, self.describe(), args, kwargs)
        if not self._acting:
            return
        adapter = self.config.adapter
        masks = spine.now.masks
        if masks is not None and adapter < len(masks) and masks[adapter] is not None:
            self._acting = False
            raise ValueError(
                "ipa_probe.intervene does not support ip_adapter_masks (diffusers then runs one softmax per reference "
                "image and masks its output); call the pipeline without masks, or mask the reference out yourself"
            )
        embeds = spine.tap.image_embeds(kwargs)
        if self.config.mode != "swap" or embeds is None:
            return
        embeds = embeds[adapter] if isinstance(embeds, list | tuple) else embeds[:, None]  # (B, images, ..., D)
        self._conditioned = embeds.ne(0).flatten(2).any(-1)  # (B, images): False in the unconditional branch
        if self._other_embeds is not None:  # SD3: the resampler's tokens depend on the timestep
            timestep = spine.tap.argument("timestep", args, kwargs).reshape(-1)[:1]
            self._other_tokens = denoiser_of(self._pipe).image_proj(self._other_embeds, timestep)[0]  # (1, K, C)

    def describe(self) -> str:
        """The edit in words, as the probe's table records it (``edits`` column)."""
        config = self.config
        refs = ",".join(map(str, config.references))
        if config.mode == "scale":
            return f"scale:{config.adapter}:{refs}:" + ",".join(f"{f:g}" for f in config.factors)
        return f"{config.mode}:{config.adapter}:{refs}"

    def _edit_tokens(self, layer: str, keys: bool):
        """Forward pre-hook on ``to_k_ip`` (``keys``) or ``to_v_ip`` of the adapter: remove or replace the
        reference's tokens in the input ``(B, images, tokens, C)``."""
        config = self.config

        def hook(module, args, kwargs):
            if not self._acting:
                return None
            tokens = args[0]
            if tokens.ndim != 4:
                raise ValueError(
                    f"ipa_probe.intervene: layer {layer!r} got image tokens of shape {tuple(tokens.shape)}; expected "
                    "(batch, images, tokens, channels) as diffusers' IP-Adapter processor passes them without masks"
                )
            # the references these tokens hold, as the call indexed them (an outer ablation may have removed some)
            kept, images = self._spine.kept_references(layer, config.adapter, keys, tokens.shape[1])
            if config.references[-1] >= images:
                raise ValueError(
                    f"reference={config.reference}: adapter {config.adapter} has {images} reference image(s) in this "
                    f"call; pass indices below {images}"
                )
            if keys:
                self.acted.append((self.step, layer))
            if config.mode == "swap":
                if config.reference not in kept:  # an ablation removed it: nothing to swap
                    return None
                edited = tokens.clone()
                at = kept.index(config.reference)
                edited[:, at] = self._swap_in(tokens[:, at])
                return (edited, *args[1:]), kwargs
            keep = [i for i, r in enumerate(kept) if r not in config.references]
            if not keep:  # an empty softmax: zero the values instead (the branch adds nothing, as scale 0 does)
                self._emptied = True
                return None
            self._emptied = False
            # the readers of this layer's keys (the probe's maps) and the edits after this one index by reference
            self._spine.keep_references(layer, config.adapter, tuple(kept[i] for i in keep), images, keys)
            return (tokens[:, keep], *args[1:]), kwargs  # (B, kept - removed, T, C)

        return hook

    def _edit_sd3(self, layer: str):
        """SD3: forward pre-hook on the joint attention, whose image tokens ``(B, K, C)`` are its one reference's:
        ``"ablate"`` passes none (the image branch is then skipped, as with no image), ``"swap"`` the other's."""

        def hook(module, args, kwargs):
            tokens = kwargs.get("ip_hidden_states")
            if not self._acting or tokens is None:
                return None
            self.acted.append((self.step, layer))
            if self.config.mode == "ablate":
                return args, {**kwargs, "ip_hidden_states": None}
            return args, {**kwargs, "ip_hidden_states": self._swap_in(tokens)}

        return hook

    def _swap_in(self, tokens: torch.Tensor) -> torch.Tensor:
        """The reference's tokens ``(B, T, C)`` with the other image's in the conditioned rows."""
        other = self._other_tokens.to(device=tokens.device, dtype=tokens.dtype)  # (1, T, C)
        rows = self._conditioned[:, self.config.reference].reshape(-1, 1, 1)  # (B, 1, 1)
        return torch.where(rows, other.expand_as(tokens), tokens)

    def _zero_values(self, module, args, output):
        """Forward hook on ``to_v_ip``: when every reference is removed, the branch's values are zero."""
        if self._acting and self.config.mode == "ablate" and self._emptied:
            return torch.zeros_like(output)
        return None


def holds_references(spine: Spine, args: tuple, kwargs: dict) -> bool:
    """Whether a Flux pass holds the call's references: not true CFG's negative pass (every item labelled ``"uncond"``
    by the one labeller), which holds ``negative_ip_adapter_image``; edits of references leave it, as leaving one out
    of the call does."""
    labels = spine.branch_labels(args, kwargs)
    return not (labels and all(label == "uncond" for label in labels))


def _layers(pipe, config: InterventionConfig) -> list[IPLayer]:
    found = find_ip_layers(pipe, config.layers)
    families = {layer.family for layer in found}
    if "sd3" in families and config.references != (0,):
        raise ValueError(
            f"reference={config.reference}: SD3 pipelines take one reference image per prompt "
            "(ip_adapter_image=image), whose tokens are all the image tokens; pass reference=0"
        )
    fewest = min(layer.num_adapters for layer in found)
    if config.adapter >= fewest:
        raise ValueError(
            f"adapter={config.adapter}: the selected layers hold {fewest} IP-Adapter(s); pass a lower index"
        )
    return found


@torch.no_grad()
def _other_tokens(pipe, config: InterventionConfig, family: str) -> torch.Tensor:
    """The swapped-in image: its tokens ``(1, T, C)`` (the pipeline's image encoder, then the adapter's projection),
    or on SD3 its encoder states ``(1, N, D)`` (the resampler runs per timestep, in :meth:`Intervention.on_pass`)."""
    encode = getattr(pipe, "encode_image", None)
    if encode is None or getattr(pipe, "image_encoder", None) is None:
        raise ValueError(
            'mode="swap" encodes other= with the pipeline\'s image encoder: pass the pipeline (with its '
            "image_encoder), not the bare denoiser"
        )
    model = model_of(pipe)
    if family == "sd3":
        resampler = next(model.image_proj.parameters())
        return encode(config.other, resampler.device).to(resampler.dtype)  # (1, N, D)
    projection = model.encoder_hid_proj.image_projection_layers[config.adapter]  # found with the layers
    if not isinstance(projection, ImageProjection):
        raise ValueError(
            f'mode="swap" supports base IP-Adapters (ImageProjection); adapter {config.adapter} projects with '
            f'{type(projection).__name__}, whose unconditional tokens are not zero embeddings; use mode="ablate"'
        )
    device = next(projection.parameters()).device
    embeds = encode(config.other, device, 1)  # (1, D); SD / SDXL return (embeds, unconditional embeds)
    embeds = embeds[0] if isinstance(embeds, tuple) else embeds
    return projection(embeds.to(next(projection.parameters()).dtype))  # (1, T, C)


def apply_intervention(
    pipe,
    reference: int | Sequence[int],
    *,
    layers: LayerSelection = None,
    steps=None,
    mode: str = "ablate",
    other: Any = None,
    adapter: int = 0,
    factor: float | Sequence[float] | None = None,
) -> Intervention:
    """Attach an intervention on one reference image's tokens (until :func:`remove_intervention`); returns the
    :class:`Intervention`.

    Prefer the context manager :func:`intervene` in scripts; this pair is for notebooks. Arguments as in
    :class:`~.config.InterventionConfig`.

    Raises:
        ValueError / TypeError: bad settings, a pipeline without IP-Adapter layers, a mode or reference its family
            lacks, a layer selection matching nothing: raised before anything is attached.
        RuntimeError: an intervention is already applied to this pipeline.
    """
    config = InterventionConfig(
        reference=reference, layers=layers, steps=steps, mode=mode, other=other, adapter=adapter, factor=factor
    )
    found = _layers(pipe, config)
    family = found[0].family
    other = _other_tokens(pipe, config, family) if config.mode == "swap" else None
    names = [layer.name for layer in found]
    hooked = "the joint attention" if family == "sd3" else "to_k_ip/to_v_ip"
    what = f"pre-hooks on {hooked}: {config.mode} reference(s) {list(config.references)}"
    if config.mode == "scale":
        what = f"hook points (weights): scale reference(s) {list(config.references)} by {list(config.factors)}"
    denoiser = denoiser_of(pipe)
    state = Intervention(config, names, _denoiser=denoiser, _pipe=pipe)
    state._other_tokens, state._other_embeds = (None, other) if family == "sd3" else (other, None)
    state._claim = claim(pipe, INTERVENE, names, what, exclusive=False)
    try:
        state._spine = spine.attach(pipe, state)  # a client like every feature (remove_intervention finds it there)
        if config.mode == "scale":
            state._handles.append(SimpleNamespace(remove=_attach_scale(pipe, state, names, family)))
        else:
            state._watching = family == "flux"
            if state._watching:
                state._spine.watch_prompts()
            _edit_tokens(state, found)
    except BaseException:
        state.remove()
        raise
    logger.info("intervene: %s on %d layer(s)", what, len(names))
    return state


def _edit_tokens(state: Intervention, layers: list[IPLayer]) -> None:
    """``"ablate"`` and ``"swap"``: edits of the adapter's image tokens on the spine's per-layer hooks, before any
    reader there (SD3: of the joint attention's keyword ``ip_hidden_states``), kept in ``state._handles``."""
    hooks, adapter, handles = state._spine.hooks, state.config.adapter, state._handles
    for layer in layers:
        if layer.family == "sd3":
            handles.append(hooks.add(layer.attention, state._edit_sd3(layer.name), pre=True, order=EDIT))
            continue
        to_k_ip, to_v_ip = (layer_module(layer, site, adapter) for site in ("k", "v"))
        handles.append(hooks.add(to_k_ip, state._edit_tokens(layer.name, True), pre=True, order=EDIT))
        handles.append(hooks.add(to_v_ip, state._edit_tokens(layer.name, False), pre=True, order=EDIT))
        handles.append(hooks.add(to_v_ip, state._zero_values, order=EDIT))


def _attach_scale(pipe, state: Intervention, names: list[str], family: str):
    """``mode="scale"``: weights callbacks (SD3: logits) on the hook points of the selected layers at the selected
    steps (on Flux in the passes that :func:`holds_references`)."""
    from .custom import scale_hooks
    from .points import PointUser, attach_points

    rescale = scale_hooks(state.config, names, family == "sd3")

    def logged(weights, ctx):
        state.step = ctx.step
        state.acted.append((ctx.step, ctx.layer))
        return rescale[ctx.name](weights, ctx)

    callbacks = {name: [logged] for name in rescale}
    when = holds_references if family == "flux" else None
    user = PointUser(callbacks, state.config.steps, label=state.describe(), when=when, pure=family != "sd3")
    return attach_points(pipe, user)


def remove_intervention(pipe) -> None:
    """Undo :func:`apply_intervention` (see :meth:`Intervention.remove`); ``ValueError`` if none is applied."""
    own = spine.spine_of(pipe)
    stack = [client for client in own.clients if isinstance(client, Intervention)] if own is not None else []
    if not stack:
        raise ValueError("no intervention is applied to this pipeline; call apply_intervention(pipe, ...) first")
    stack[-1].remove()  # the innermost, as leaving nested blocks does


@contextlib.contextmanager
def intervene(
    pipe,
    reference: int | Sequence[int] | None = None,
    *,
    layers: LayerSelection = None,
    steps=None,
    mode: str = "ablate",
    other: Any = None,
    adapter: int = 0,
    factor: float | Sequence[float] | None = None,
    hooks: Any = None,
) -> Iterator[Intervention | HookIntervention]:
    """Run a pipeline with one reference image's tokens removed (or swapped, or scaled) in the chosen layers and
    steps, or with callbacks on named hook points (``hooks=``).

    Every hook comes off on exit (normal, exception or KeyboardInterrupt), leaving the pipeline as it was. On a normal
    exit after a pipeline call, ``steps`` naming loop indices no call had (``steps=[999]`` on a 20-step call) raise a
    ``ValueError``: the intervention acted on nothing.

    Blocks nest: token edits (ablate, swap) act on the keys, edits of the hook points in the order attached, and a
    probe inside reads what the layer used (docs/api.md, "Features together").

    Args:
        pipe: an SD 1.5 / SDXL, Flux or SD3 pipeline with an IP-Adapter loaded.
        reference, layers, steps, mode, other, adapter, factor: as in :class:`~.config.InterventionConfig`.
        hooks: instead of ``reference``: ``{name: fn(tensor, ctx)}`` or ``[(name, fn), ...]`` (names, regexes or
            filters: :func:`~.points.normalise_hooks`), run at ``steps``; the other arguments do not apply.

    Yields:
        the :class:`Intervention` (its ``acted`` lists the (step, layer) pairs it changed), or with ``hooks=`` the
        :class:`~.custom.HookIntervention` (its ``calls`` lists the (step, name) pairs where a callback ran).

    Example:
        ```py
        >>> with ipa_probe.intervene(pipe, reference=1, steps=range(10)):
        ...     image = pipe("a handwritten digit", ip_adapter_image=[refs], num_inference_steps=20).images[0]
        ```
    """
    if hooks is not None:
        given = {"reference": reference, "layers": layers, "other": other, "factor": factor}
        extra = [name for name, value in given.items() if value is not None] + ["mode"] * (mode != "ablate")
        extra += ["adapter"] * (adapter != 0)
        if extra:
            raise ValueError(
                f"intervene(hooks=...) takes the hook point names as the selection; drop {extra} (or use two "
                "nested intervene blocks)"
            )
        state = apply_hooks(pipe, hooks, steps=steps)
    elif reference is None:
        raise TypeError("intervene: pass reference= (ablate, swap or scale a reference image) or hooks={name: fn}")
    else:
        state = apply_intervention(
            pipe, reference, layers=layers, steps=steps, mode=mode, other=other, adapter=adapter, factor=factor
        )
    try:
        yield state
        # steps the calls never had: an error, not no effect
        steps = state.config.steps if isinstance(state, Intervention) else state.steps
        check_steps_ran(steps, state.steps_run, selected=state.selected)
    finally:
        state.remove()
