"""Named hook points on the branches of every IP-Adapter layer, ``<layer id>.<ip|ip1|text>.<point>`` with the points
of :data:`POINTS`, TransformerLens-style; what each holds and how callbacks read and edit it: docs/api.md, "Hook
points: callbacks, caching, patching".

The points are formed from what the layer's own modules compute, as the spine's per-layer hooks keep it (the query, the
branch's keys and values: :func:`~ipa_probe.capture.taps.base.layer_module`; nothing replaced), in :data:`POINTS`'
order, an edit at one flowing into the next; the layer then adds the change of the branch's output to what
``attn.to_out[0]`` returns (Flux, whose branch has no output projection: to the attention's third output, before the
readers there). With no edit the pipeline computes bit for bit what it computes without ipa_probe; with one, the
unedited part of the layer (bias, other branches) is still the processor's own. A layer's points fire when its branch
runs (not at adapter scale 0); ``ip_adapter_masks`` are refused at the first selected step. SD3's branch is one softmax
over its image and latent keys: ``k``, ``logits``, ``weights`` hold the image columns (an edit of the weights leaves
the latent columns as computed, one of q or the logits renormalises them), ``contribution`` the image tokens' part of
``output``, which also holds the latent tokens' part.

Several users may hold points on one pipeline at once (an intervention's callbacks, then a cache's readers): each is a
client of the pipeline's spine, the points' hooks are the spine's (:attr:`~ipa_probe.capture.spine.Spine.points`,
added once), edits of one point run in order of attachment, then its readers (a cache: what the layer used there,
whichever block was entered first), and the hooks come off when the last user leaves.
"""

from __future__ import annotations

import difflib
import math
import re
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ..capture import spine
from ..capture.layer_order import network_key
from ..capture.maps import image_projections, tokens_per_image
from ..capture.spine import EDIT, PassInfo, Spine, expand_references
from ..capture.taps.base import layer_module
from ..capture.taps.unet import unet_resolution_factor
from ..layers import IPLayer, claim, find_ip_layers, image_branch_logits, release
from ..statistics.kernels import dot_logits, mix_tokens, projected_tokens, reference_contributions, split_heads
from .context import HookContext

__all__ = [
    "POINTS",
    "HookContext",
    "HookFn",
    "PointUser",
    "attach_points",
    "choose_points",
    "hook_point_layers",
    "list_hook_points",
    "normalise_hooks",
    "point_name",
    "select_points",
]

#: The points of each branch (an adapter's image branch, or the UNet's text branch), in the order they are computed.
POINTS: tuple[str, ...] = ("q", "k", "logits", "weights", "contribution", "output")

#: The branch label of the text cross-attention (UNets): ``<layer id>.text.<point>``.
TEXT = "text"

#: A hook point callback: ``fn(tensor, ctx)`` returns ``None`` (keep) or a replacement tensor.
HookFn = Callable[[torch.Tensor, "HookContext"], torch.Tensor | None]


def _branch(adapter: int | str) -> str:
    return TEXT if adapter == TEXT else "ip" if adapter == 0 else f"ip{adapter}"


def point_name(layer: str, point: str, adapter: int | str = 0) -> str:
    """The dotted name of a hook point, e.g. ``point_name("mid_block...attn2", "weights")`` ->
    ``"mid_block...attn2.ip.weights"`` (adapter 1: ``...attn2.ip1.weights``; ``adapter="text"``: the text branch,
    ``...attn2.text.weights``)."""
    return f"{layer}.{_branch(adapter)}.{point}"


def hook_point_layers(pipe) -> list[IPLayer]:
    """The IP-Adapter layers, whose branches have hook points, in the order the denoiser runs them."""
    return sorted(find_ip_layers(pipe), key=lambda layer: network_key(layer.name))


def list_hook_points(pipe) -> list[str]:
    """Every hook point name, in the order the denoiser computes them: layers as the network runs them (down, mid,
    up), in each the text branch (UNets) then each adapter's image branch, in each :data:`POINTS`.

    Example:
        ```py
        >>> ipa_probe.list_hook_points(pipe)[:2]
        ['down_blocks.0.attentions.0.transformer_blocks.0.attn2.text.q',
         'down_blocks.0.attentions.0.transformer_blocks.0.attn2.text.k']
        ```
    """
    return [
        point_name(layer.name, point, branch)
        for layer in hook_point_layers(pipe)
        for branch in _branches(layer)
        for point in POINTS
    ]


def _branches(layer: IPLayer) -> list[int | str]:
    """The branches of a layer with hook points: the text branch (UNets), then each adapter."""
    return ([TEXT] if layer.family == "unet" else []) + list(range(layer.num_adapters))


def _parse_name(name: str) -> tuple[str, int | str, str]:
    layer, branch, point = name.rsplit(".", 2)
    return layer, (TEXT if branch == TEXT else 0 if branch == "ip" else int(branch[2:])), point


@dataclass(eq=False)
class PointUser:
    """One user of the hook points: callbacks by name, the steps they run at, and what it wants to hear of a new
    pipeline call (``on_call(step_count, sizes)``, e.g. a cache's budget check; ``sizes(name)`` gives a point's
    ``(shape, dtype)`` for one pass, or ``None`` when unknown). ``steps_run`` is the most denoising steps a call
    it saw ran (to tell a step selection the calls never reached from one that acted on nothing)."""

    callbacks: dict[str, list[HookFn]]
    steps: Any = None
    on_call: Callable[[int | None, Callable[[str], Any]], None] | None = None
    steps_run: int = 0
    #: the passes its step selection selected
    selected: int = 0
    #: which passes of a selected step it runs in, ``when(spine, args, kwargs) -> bool`` (``None``: every pass)
    when: Callable[[Spine, tuple, dict], bool] | None = None
    #: whether the callbacks may edit (``False`` for a cache's readers): readers of the layer then wait for them
    edits: bool = True
    #: the edit in words, for the probe's ``edits`` column
    label: str = ""
    #: the callbacks return new tensors without NaN and leave what they get as it is (the scale's weights callbacks)
    pure: bool = False

    def on_pass(self, spine: Spine, args: tuple, kwargs: dict) -> None:
        spine.points.select(self, spine, args, kwargs)


class _Registry:
    """The hooks that compute the points on one denoiser (:attr:`Spine.points`, while some :class:`PointUser`, a
    client of the spine like any feature, holds points there): shared by every user."""

    def __init__(self, spine: Spine, layers: list[IPLayer]) -> None:
        self.spine = spine
        self.denoiser = spine.denoiser
        self.layers = layers
        self.handles: list[Any] = []
        #: hook point name -> NaN returned there by callbacks (a 0-d device tensor, read when the hooks come off)
        self.nan: dict[str, torch.Tensor] = {}
        self.sample_shape: tuple[int, ...] = ()
        self.batch = 0
        #: this pass's (callback, its user) by point: edits in order of attachment, then readers
        self.active: dict[str, list[tuple[HookFn, PointUser]]] = {}
        self.cfg: tuple[str, ...] = ()  # each batch item's CFG label in this pass
        self._now: PassInfo | None = None  # the pass the callbacks were gathered for
        self._text_tokens: int | None = None
        self._image_embeds: Any = None

    # ------------------------------------------------------------------ lifecycle
    def install(self) -> None:
        self.spine.watch_prompts()
        hooks = self.spine.hooks
        for layer in self.layers:
            sites = [("q", 0)] + [(site, branch) for branch in _branches(layer) for site in ("k", "v")]
            sites += [("k", "latent"), ("v", "latent")] * (layer.family == "sd3")  # its softmax's latent columns
            self.handles += hooks.keep(layer, *sites)
            self.handles.append(hooks.add(layer.attention, self._on_layer(layer), pre=True))
            # an edit: before the readers of the same module (Flux: the probe's record of the edited weights)
            self.handles.append(hooks.add(layer_module(layer, "out"), self._on_out(layer), order=EDIT))

    def uninstall(self) -> None:
        try:
            for handle in self.handles:
                handle.remove()
        finally:
            self.handles.clear()
            self.active = {}
            self.spine.watch_prompts(False)
            self.spine.points = None

    # ------------------------------------------------------------------ the clock
    def select(self, user: PointUser, spine: Spine, args: tuple, kwargs: dict) -> None:
        """A denoiser pass starts (``user``'s turn among the spine's clients): the pass's shapes (with its first
        user), then ``user``'s callbacks when its selection takes the pass."""
        now = spine.now
        if self._now is not now:
            self._now, self.active, self.cfg = now, {}, ()
            sample = spine.tap.sample(args, kwargs)
            self.sample_shape, self.batch = tuple(sample.shape), sample.shape[0]
            context = spine.tap.argument("encoder_hidden_states", args, kwargs) if spine.tap.family == "unet" else None
            self._text_tokens = context.shape[1] if isinstance(context, torch.Tensor) and context.ndim == 3 else None
            self._image_embeds = spine.tap.image_embeds(kwargs)
        if now.new_call and user.on_call is not None:
            user.on_call(spine.planned_steps(), self._sizes)
        if not spine.selects(user, user.steps, user.when, user.label if user.edits else "", args, kwargs):
            return
        for name, fns in user.callbacks.items():  # a reader (a cache) keeps what every edit left, whatever the nesting
            merged = [*self.active.get(name, []), *((fn, user) for fn in fns)]
            self.active[name] = sorted(merged, key=lambda pair: not pair[1].edits)  # stable: edits first, then readers
            layer, adapter, _ = _parse_name(name)
            if user.edits and adapter != TEXT:  # readers of the layer wait for what its image branch used
                spine.weight_edits.add((layer, adapter))
        if user.callbacks and now.masks is not None and any(m is not None for m in now.masks):
            raise ValueError(
                "ipa_probe hook points do not support ip_adapter_masks (diffusers then runs one softmax per "
                "reference image); call the pipeline without masks"
            )
        if not self.cfg:  # read back only when a callback runs
            self.cfg = spine.branch_labels(args, kwargs)

    def _sizes(self, name: str) -> tuple[tuple[int, ...], torch.dtype] | None:
        """A point's shape and dtype in one pass of this call, from the call's arguments (before step 0 runs)."""
        layer_name, adapter, point = _parse_name(name)
        layer = next(layer for layer in self.layers if layer.name == layer_name)
        sd3 = layer.family == "sd3"  # one reference; its resampler's ``latents`` are its tokens
        if adapter == TEXT or sd3:
            references, tokens = 1, self.denoiser.image_proj.latents.shape[1] if sd3 else self._text_tokens
        else:
            embeds = self._image_embeds
            if not isinstance(embeds, list | tuple) or adapter >= len(embeds) or embeds[adapter].ndim != 3:
                return None
            references = embeds[adapter].shape[1]
            tokens = tokens_per_image(layer.processor, image_projections(self.denoiser), adapter)
        if tokens is None:
            return None
        queries = math.prod(self._grid(layer))
        out = layer.attention.to_out[0] if layer.family != "flux" else layer.processor.to_v_ip[adapter]
        channels, dtype = out.out_features, out.weight.dtype
        key = layer.processor.to_k_ip if sd3 else layer_module(layer, "k", adapter)
        keys, head_dim = references * tokens, key.out_features // layer.heads
        shape = {
            "q": (self.batch, layer.heads, queries, head_dim),
            "k": (self.batch, layer.heads, keys, head_dim),
            "logits": (self.batch, layer.heads, queries, keys),
            "weights": (self.batch, layer.heads, queries, keys),
            "contribution": (self.batch, references, queries, channels),
            "output": (self.batch, queries, channels),
        }[point]
        return shape, dtype

    # ------------------------------------------------------------------ per layer
    def _wanted(self, layer: str) -> bool:
        return any(name.startswith(layer + ".") for name in self.active)

    def _on_layer(self, layer: IPLayer) -> Callable:
        def hook(module, args, kwargs):
            if not self._wanted(layer.name):
                return
            if kwargs.get("attention_mask") is not None and any(".text." in name for name in self.active):
                raise ValueError(
                    "ipa_probe's text-branch hook points do not support an encoder attention mask (the text softmax "
                    "is then masked); call the pipeline without one, or hook the image branch ('.ip.') only"
                )

        return hook

    def _grid(self, layer: IPLayer) -> tuple[int, int]:
        """``(height, width)`` of a layer's query positions in this pass (Flux's packed tokens: ``(1, N)``; SD3's
        patches)."""
        if layer.family == "flux":
            return (1, self.sample_shape[1])
        sd3 = layer.family == "sd3"
        factor = self.denoiser.config.patch_size if sd3 else unet_resolution_factor(self.denoiser, layer.name)
        return (math.ceil(self.sample_shape[-2] / factor), math.ceil(self.sample_shape[-1] / factor))

    def _on_out(self, layer: IPLayer) -> Callable:
        """Forward hook on ``to_out[0]`` (UNet) or on the attention module (Flux, whose third output is the image
        branch's): add the change of the branch's output."""

        def hook(module, args, output):
            if not self._wanted(layer.name):
                return None
            delta = None
            for branch in _branches(layer):
                change = self._branch(layer, branch)
                if change is not None:
                    delta = change if delta is None else delta + change
            if delta is None:
                return None
            if layer.family != "flux":
                return output + delta.reshape(output.shape)
            hidden, context, branch = output
            return hidden, context, branch + delta.reshape(branch.shape)

        return hook

    def _branch(self, layer: IPLayer, adapter: int | str) -> torch.Tensor | None:
        """Compute one branch's points (an adapter's image branch, or ``adapter="text"``), run their callbacks in
        order, and return the change of the layer's output (or ``None`` when nothing was edited)."""
        names = dict(zip(POINTS, (point_name(layer.name, point, adapter) for point in POINTS), strict=True))
        if not any(name in self.active for name in names.values()):
            return None
        seen = self.spine.hooks.seen
        q0 = seen.get((layer.name, "q", 0))  # (B, H, Q, D)
        keys, values = (seen.get((layer.name, site, adapter)) for site in ("k", "v"))
        if q0 is None or keys is None or values is None:
            return None  # the branch did not run (adapter scale 0, SD3 without image tokens)
        text, joint = adapter == TEXT, layer.family == "sd3"  # SD3: one softmax over [image keys; latent keys]
        heads, batch = layer.heads, q0.shape[0]
        tokens = keys.shape[-2] if keys.ndim == 4 or text else keys.shape[1]
        k0 = keys if joint else split_heads(keys.reshape(batch, -1, keys.shape[-1]), heads)  # (B, H, K, D)
        v = split_heads(values.reshape(batch, -1, values.shape[-1]), heads)  # (B, H, K, D)
        latent_k, latent_v = (seen.get((layer.name, site, "latent")) for site in ("k", "v"))  # SD3: (B, H, N, D)
        references = k0.shape[2] // tokens
        processor = layer.attention.processor  # the one running now (an NW head swapped in after the points)
        scale = 1.0 if text else float(processor.scale if joint else processor.scale[adapter])
        grid = self._grid(layer)
        grid = grid if grid[0] * grid[1] == q0.shape[2] else (1, q0.shape[2])
        keyed = references  # references among the keys (fewer than the call's when an ablation removed some)
        kept = None if text else self.spine.kept.get((layer.name, adapter))
        if kept is not None:  # an ablation removed references from the keys: they are back here at weight 0
            v = expand_references(v, *kept, -2, 0.0)
            references = kept[1]

        now = self.spine.now

        def context(point: str) -> HookContext:
            return HookContext(
                name=names[point],
                layer=layer.name,
                point=point,
                adapter=adapter,
                step=now.step,
                call=now.call,
                timestep=now.timestep,
                heads=heads,
                references=keyed if point in ("k", "logits") else references,
                tokens=tokens,
                grid=grid,
                scale=scale,
                device=q0.device,
                pass_index=now.pass_index,
                cfg=self.cfg,
            )

        def logits_of(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:  # (B, H, Q, K); SD3 (B, H, Q, K + N)
            if joint:  # the latent columns follow an edited query
                return image_branch_logits(processor, q, torch.cat([k, latent_k], 2))
            return dot_logits(q, k) if text else image_branch_logits(processor, q, k)

        def weights_of(logits: torch.Tensor) -> torch.Tensor:  # (B, H, Q, K) with the removed references at 0
            w = logits.softmax(-1).to(v.dtype)
            return w if kept is None else expand_references(w, *kept, -1, 0.0)

        upstream = any(names[point] in self.active for point in ("q", "k", "logits"))
        edited = False
        if upstream:  # copies: an edit in place must not reach the tensors the layer (and the probe) computed with
            q, changed_q = self._run(names["q"], q0.clone(), context("q"))
            k, changed_k = self._run(names["k"], k0.clone(), context("k"))
            logits, changed_logits = self._run(names["logits"], logits_of(q, k), context("logits"), tokens * joint)
            edited = changed_q or changed_k or changed_logits
            start = weights_of(logits)
        else:
            start = weights_of(logits_of(q0, k0))
        weights, changed = self._run(names["weights"], start, context("weights"), tokens * joint)
        # the weights the processor computed, for the change of the output: formed again when edits may have reached
        # them (not when only the scale's callbacks ran after none upstream: they leave what they get as it is)
        pure = not edited and all(user.pure for _, user in self.active.get(names["weights"], ()))
        edited = edited or changed
        computed = weights_of(logits_of(q0, k0)) if edited and not pure else start
        if edited and not text:  # what the layer uses from here on: the probe reads these (SD3: the image columns)
            self.spine.use(layer.name, adapter, "weights", weights[..., : tokens * references])
        if not edited and names["contribution"] not in self.active and names["output"] not in self.active:
            return None  # nothing edited, and nothing downstream wanted

        w_o = layer.attention.to_out[0].weight if layer.family != "flux" else None  # Flux: the branch has no W_o
        projected = None if w_o is None else projected_tokens([v], tokens, scale, w_o)  # once for both weights

        def contributions(w: torch.Tensor) -> torch.Tensor:  # (B, H, Q, K) -> (B, R, Q, C)
            w = w[..., : tokens * references]
            return (reference_contributions(w, v, tokens, scale, None) if w_o is None else mix_tokens(w, projected))[0]

        if joint:  # SD3: the latent tokens' part of the output too, as one more reference (of all of them)
            latent = projected_tokens([split_heads(latent_v, heads)], latent_v.shape[1], scale, w_o)

        def output_of(c: torch.Tensor, w: torch.Tensor) -> torch.Tensor:  # (B, R, Q, C) -> (B, Q, C)
            return c.sum(1) + mix_tokens(w[..., tokens:], latent)[0][:, 0] if joint else c.sum(1)

        original = contributions(computed)
        original_output = output_of(original, computed)  # before a callback may edit ``original``
        contribution = contributions(weights) if edited else original
        contribution, changed = self._run(names["contribution"], contribution, context("contribution"))
        edited = edited or changed
        output = output_of(contribution, weights)
        output, changed_output = self._run(names["output"], output, context("output"))
        if not (edited or changed_output):
            return None
        if (changed or changed_output) and not (text or joint):  # the split the probe reads (SD3: none at all)
            used = torch.full_like(contribution, math.nan) if changed_output else contribution  # once the output moved
            self.spine.use(layer.name, adapter, "contribution", used)
        return output - original_output

    def _run(self, name: str, tensor: torch.Tensor, ctx: HookContext, image: int = 0) -> tuple[torch.Tensor, bool]:
        """Run a point's callbacks in order; return the final tensor and whether any callback may have changed it: one
        that returned a tensor, or one of an editing user that returned None (an edit in place is an edit, honoured,
        never lost) (``image``: the callbacks get the first ``image`` columns only, SD3's image columns of its joint
        logits or weights)."""
        fns = self.active.get(name)
        if not fns:
            return tensor, False
        if image:
            columns, edited = self._run(name, tensor[..., :image], ctx)  # a view: an edit in place reaches ``tensor``
            return torch.cat([columns, tensor[..., image:]], -1) if edited else tensor, edited
        edited = False
        for fn, user in fns:
            result = fn(tensor, ctx)
            if result is None or result is tensor:
                edited = edited or user.edits
                if user.edits:
                    self._count_nan(name, tensor)
                continue
            if not isinstance(result, torch.Tensor):
                raise TypeError(f"hook {name!r} returned {type(result).__name__}; expected a tensor or None")
            if result.shape != tensor.shape or result.dtype != tensor.dtype or result.device != tensor.device:
                raise ValueError(
                    f"hook {name!r} returned a tensor of shape {tuple(result.shape)}, {result.dtype} on "
                    f"{result.device}; expected shape {tuple(tensor.shape)}, {tensor.dtype} on {tensor.device} "
                    "(or None to keep it)"
                )
            tensor, edited = result, True
            if not user.pure:
                self._count_nan(name, tensor)
        return tensor, edited

    def _count_nan(self, name: str, tensor: torch.Tensor) -> None:
        """Count the NaN a callback returned, on the device (read once, when the hooks come off: :meth:`warn_nan`)."""
        if tensor.is_floating_point():
            count = torch.isnan(tensor).sum()
            self.nan[name] = count if name not in self.nan else self.nan[name] + count

    def warn_nan(self) -> None:
        """Warn once (then forget) when callbacks returned NaN since the last warning."""
        counts, self.nan = {name: int(count) for name, count in self.nan.items()}, {}
        bad = {name: count for name, count in counts.items() if count}
        if bad:
            first = next(iter(bad))
            warnings.warn(
                f"hook points: callbacks returned {sum(bad.values())} NaN value(s) at {len(bad)} point(s) (first: "
                f"{first!r}); the layer used them. Return finite tensors (e.g. torch.nan_to_num)",
                RuntimeWarning,
                stacklevel=3,
            )


def attach_points(pipe, user: PointUser, feature: str = "", what: str = "") -> Callable[[], None]:
    """Add a user of the hook points to ``pipe``'s spine (installing the points' hooks, :attr:`Spine.points`, for the
    first), claimed as ``feature`` (doing ``what``, for :func:`~ipa_probe.layers.list_hooks`) when given; returns the
    function that removes it (and the hooks with the last user). The caller checks names (:func:`select_points`)."""
    layers, own = hook_point_layers(pipe), None
    layer_ids = sorted({name.rsplit(".", 2)[0] for name in user.callbacks})
    mark = claim(pipe, feature, layer_ids, what, exclusive=False) if feature else None

    def detach() -> None:
        registry = None if own is None else own.points
        try:
            if registry is not None:
                registry.warn_nan()
        finally:
            try:
                if registry is not None and not any(isinstance(c, PointUser) and c is not user for c in own.clients):
                    registry.uninstall()
            finally:
                spine.detach(pipe, user)
                if mark is not None:
                    release(pipe, feature, mark)

    try:
        own = spine.attach(pipe, user)
        if own.points is None:
            own.points = _Registry(own, layers)
            own.points.install()
    except BaseException:
        detach()
        raise
    return detach


def normalise_hooks(pipe, hooks: Any) -> dict[str, list[HookFn]]:
    """Check hooks against ``pipe``'s hook points (one-line errors) and return ``{name: [fn, ...]}``.

    Args:
        hooks: ``{name: fn or [fn, ...]}`` or, as TransformerLens takes them, a list of ``(name, fn)`` pairs; a name
            is a hook point's name, a regex as a string or compiled (``r"\\.ip\\.weights$"``: every point it
            searches) or a callable filter ``name -> bool`` (:func:`select_points`). Callbacks of one point run in
            the order given.
    """
    if isinstance(hooks, Mapping):
        pairs = list(hooks.items())
    elif isinstance(hooks, list | tuple) and all(isinstance(p, tuple) and len(p) == 2 for p in hooks):
        pairs = list(hooks)
    else:
        raise TypeError(
            "hooks: expected a dict {hook point name: fn(tensor, ctx)} or a list of (name, fn) pairs, got "
            f"{type(hooks).__name__}"
        )
    known = list_hook_points(pipe)
    callbacks: dict[str, list[HookFn]] = {}
    for name, fns in pairs:
        fns = list(fns) if isinstance(fns, list | tuple) else [fns]
        for fn in fns:
            if not callable(fn):
                raise TypeError(f"hooks[{name!r}]: expected a callable fn(tensor, ctx), got {fn!r}")
        for point in select_points(known, name, "hooks"):
            callbacks.setdefault(point, []).extend(fns)
    if not callbacks:
        raise ValueError("hooks: expected at least one hook point name (see ipa_probe.list_hook_points(pipe))")
    return callbacks


def choose_points(known: list[str], names: Any, argument: str = "names") -> list[str]:
    """The points of ``known`` that ``names`` selects, in ``known``'s order: ``None`` every one, else a name, a regex
    (a string or compiled), a callable filter ``name -> bool``, or a list of them (:func:`select_points`)."""
    if names is None:
        return known
    items = [names] if isinstance(names, str | re.Pattern) or callable(names) else list(names)
    if not items:
        raise ValueError(f"{argument}: expected at least one hook point name (see ipa_probe.list_hook_points(pipe))")
    chosen = {point for item in items for point in select_points(known, item, argument)}
    return [point for point in known if point in chosen]


def select_points(known: list[str], name: Any, argument: str) -> list[str]:
    """The hook points of ``known`` that ``name`` selects: a point's own name; else every point a string or compiled
    regex searches (``r"\\.ip\\.weights$"``) or a callable filter accepts. A string that selects nothing, or a plain
    dotted string a character or two off a name (a typo), is refused with the closest names."""
    if isinstance(name, str):
        if name in known:
            return [name]
        typo = re.fullmatch(r"[\w.]+", name) and difflib.get_close_matches(name, known, 1, 0.95)
        try:
            pattern = None if typo else re.compile(name)
        except re.error:
            pattern = None
        chosen = [point for point in known if pattern.search(point)] if pattern else []
        if chosen:
            return chosen
        close = difflib.get_close_matches(name, known, n=2, cutoff=0.6)
        raise ValueError(
            f"{argument}: unknown hook point {name!r}; {f'did you mean {close}? ' if close else ''}names are "
            f"'<layer id>.<ip|ip1|text>.<point>' with point in {list(POINTS)}: see ipa_probe.list_hook_points(pipe)"
        )
    if not (isinstance(name, re.Pattern) or callable(name)):
        raise TypeError(f"{argument}: expected hook point names (str), regexes or filters, got {name!r}")
    test = name.search if isinstance(name, re.Pattern) else name
    chosen = [point for point in known if test(point)]
    if not chosen:
        shown = name.pattern if isinstance(name, re.Pattern) else getattr(name, "__name__", repr(name))
        raise ValueError(f"{argument}: {shown!r} selects no hook point; see ipa_probe.list_hook_points(pipe)")
    return chosen
