"""Where each reference goes: per-reference spatial attribution maps, attention beside NW.

With ``probe(pipe, maps=True)`` the probe also keeps, for every recorded (call, step, layer, adapter, CFG branch),
the share of the image branch's weight that each image token receives at each query position, averaged over heads:

    share_a(p, t) = mean_h softmax_t(l_a[h, p, :])[t],    l_attn = q·k / sqrt(d),   l_nw = -|q - k|^2 / (2 h^2)

for the attention (``a = "attention"``) and for the Gaussian NW weights (``a = "nw"``, the table's bandwidth). A
reference image's share is the sum over its tokens. With ``ip_adapter_masks`` diffusers runs one softmax per
reference image and multiplies its output by the reference's mask (downsampled to the layer's grid by
:meth:`IPAdapterMaskProcessor.downsample`); the share is then ``mask_r(p) softmax_r(p, t)`` normalised over the
adapter's references, so a reference gets nothing outside its region (negative bicubic overshoot is clamped to 0;
a position no mask reaches gets 0 for every reference).

What is kept: per recorded step, layer, adapter and denoiser pass, one float32 ``(2, groups, items, Q, K)`` tensor
(attention and NW, with the groups' branch labels) and each reference's contribution to the output (norm and
projection, :meth:`MapAccumulator.end_pass`) on the pipeline's device (no host synchronisation), moved to the host
once when the ``with`` block ends; with :meth:`MapAccumulator.keep_heads` both per head too. ``check_budget`` refuses
above ``max_map_bytes`` before step 0; the figures are in :mod:`~.mapplots`.
"""

from __future__ import annotations

import logging
import math
import warnings
from collections.abc import Iterable, Sequence
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from diffusers.image_processor import IPAdapterMaskProcessor

from ..layers import IPLayer, LayerSelection, compile_selection, model_of
from ..statistics.kernels import contribution_sums, reference_sums, softmax_keys
from .spine import Spine, expand_references
from .taps import Tap
from .taps.base import layer_module

__all__ = ["MAP_KINDS", "MAP_TABLE_COLUMNS", "REFERENCE_MASS_COLUMNS", "MapAccumulator"]

logger = logging.getLogger(__name__)

#: The two attributions kept, in buffer order.
MAP_KINDS: tuple[str, ...] = ("attention", "nw")

#: The columns that say where a map was recorded, first in both tables below.
_WHERE: tuple[str, ...] = ("call", "step", "timestep", "layer", "adapter", "branch")

#: Columns of :meth:`ipa_probe.ProbeRun.map_table`: per (call, step, layer, adapter, branch, item), the fraction of
#: query positions whose dominant reference is the same under attention and NW (``dominant_agree``) and the mean
#: total-variation distance between the two reference-share vectors (``tv``), over ``positions`` query positions.
MAP_TABLE_COLUMNS: tuple[str, ...] = (*_WHERE, "item", "references", "positions", "dominant_agree", "tv")

#: Columns of :meth:`ipa_probe.ProbeRun.reference_mass`: per (call, step, layer, adapter, branch) and reference
#: image, its mean share of the attention (``attention``) and of the NW weights (``nw``) over query positions and
#: batch items; and its contribution to the layer's output (see :meth:`MapAccumulator._contribute`), averaged the same
#: way: the norm ``|c_j|`` (``contribution_norm``), the norm's share ``|c_j| / sum_k |c_k|`` of the position
#: (``contribution_share``) and the projection ``c_j . c / |c|`` onto the branch's total ``c``
#: (``contribution_projection``; the projections of a position sum to ``|c|``). NaN where no contribution was
#: recorded (``ip_adapter_masks``, SD3, a ``heads=`` selection) and after an edit of the layer's output hook point.
REFERENCE_MASS_COLUMNS: tuple[str, ...] = (
    *_WHERE,
    *("reference", "attention", "nw", "contribution_norm", "contribution_share", "contribution_projection"),
)

_BYTES = 4  # float32 shares


class MapAccumulator:
    """Per-token shares of the image branch's weight, kept per (call, step, layer, adapter) on the device.

    Args:
        pipe: the probed pipeline (read for ``vae_scale_factor``).
        layers: the probe's layers, in its order.
        tap: the probe's tap (its :meth:`~.taps.Tap.map_elements` sizes the buffers).
        labels: the run's branch labels (what the label indices of :meth:`add` name).
    """

    def __init__(self, pipe, layers: list[IPLayer], tap: Tap, labels: Sequence[str]) -> None:
        self.pipe = pipe
        self.labels = list(labels)
        self.layers = layers
        self.tap = tap
        #: (call, step, layer index, adapter) -> one ``(labels, shares)`` pair per denoiser pass: ``labels``
        #: ``(groups,)`` indices into the run's branch labels, ``shares`` ``(2, groups, items, Q, K)`` float32.
        self.store: dict[tuple[int, int, int, int], list[tuple[torch.Tensor, torch.Tensor]]] = {}
        #: call -> latent grid (H, W) of the denoiser input, or None (packed latents).
        self.latents: dict[int, tuple[int, int] | None] = {}
        #: (call, adapter) pairs that ran with ``ip_adapter_masks``.
        self.masked: set[tuple[int, int]] = set()
        self._masks: list[torch.Tensor | None] = []
        #: the denoiser's per-adapter image projections (``encoder_hid_proj``), read by :meth:`tokens_per_image`
        self._projections: Sequence[torch.nn.Module] | None = None
        #: call -> (img_ids, tokens, side) of packed latents, turned into ``latents`` by :meth:`latent_grid`
        self._packed_ids: dict[int, tuple[torch.Tensor, int]] = {}
        self._mask_cache: dict[tuple[int, int, int, int], torch.Tensor] = {}
        self._images_seen: dict[tuple[int, int], int] = {}
        self._on_host = False
        #: the sum of :meth:`check_budget`'s estimates over the run's calls.
        self.estimated_bytes = 0
        self._batch = 1
        #: (call, step, layer index, adapter) -> one ``(labels, shares)`` pair per denoiser pass with the attention's
        #: per-head shares ``(groups, items, H, Q, K)`` float32; filled only after :meth:`keep_heads`.
        self.head_store: dict[tuple[int, int, int, int], list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self.heads = False
        #: (call, step, layer index, adapter) -> one ``(labels, values)`` pair per denoiser pass with each reference's
        #: contribution to the layer output (see :meth:`_contribute`): ``values`` ``(2, groups, items, Q, R)``
        #: float32, the norm ``|c_j|`` and the projection ``c_j . c / |c|`` onto the total ``c = sum_j c_j``.
        self.contribution_store: dict[tuple[int, int, int, int], list[tuple[torch.Tensor, torch.Tensor]]] = {}
        #: the same per head (``(2, groups, items, H, Q, R)``: ``|c_{j,h}|`` and ``c_{j,h} . c / |c|``), filled only
        #: after :meth:`keep_heads`.
        self.contribution_head_store: dict[tuple[int, int, int, int], list[tuple[torch.Tensor, torch.Tensor]]] = {}
        #: what :meth:`add` left for :meth:`end_pass`: ``(where, labels, weights (L * B, H, Q, K))`` per stack
        self._pending: list[tuple[list, torch.Tensor, torch.Tensor]] = []
        #: (layer index, adapter) -> the value projection's output of this pass
        self._values: dict[tuple[int, int], torch.Tensor] = {}
        #: a stack's (layer index, adapter) pairs -> (what they were made from, its scales, its W_o's, the W_o's)
        self._constants: dict[tuple, tuple] = {}
        #: records whose contributions an edit of the contribution or output point set (:meth:`add`), warned of once
        self.edited_contributions = 0

    def keep_heads(self) -> None:
        """Also keep the attention's shares per head (before the first call starts; unmasked adapters only)."""
        if self.store:
            raise ValueError("keep_heads: call it before the probed pipeline runs (maps are already recorded)")
        self.heads = True

    # ------------------------------------------------------------------ capture
    def install(self, denoiser: torch.nn.Module, spine: Spine) -> list[Any]:
        """Add the value readers to the spine's per-layer hooks (the probe calls :meth:`on_pass` from its place on the
        spine, after its clock)."""
        self.read_projections(denoiser)
        return [
            spine.hooks.add(layer_module(layer, "v", adapter), self._value_hook(spine, index, adapter))
            for index, layer in enumerate(self.layers)
            if layer.family != "sd3"  # one softmax over latent and image tokens: no per-reference split
            for adapter in range(layer.num_adapters)
        ]

    def read_projections(self, denoiser: torch.nn.Module) -> None:
        """Read the denoiser's per-adapter image projections (again, after ``load_ip_adapter`` replaced them)."""
        self._projections = image_projections(denoiser)
        self._constants.clear()  # the processors were replaced: their W_o's are read again

    def on_pass(self, args: tuple, kwargs: dict, masks: list[torch.Tensor | None] | None) -> None:
        """A denoiser pass starts (``masks``: its normalised ``ip_adapter_masks``)."""
        self.end_pass()  # a pass that raised: what its layers left
        self._batch = self.tap.sample(args, kwargs).shape[0]
        self._values.clear()
        self._images_seen.clear()  # per pass: which reference image a masked adapter's next key projection is
        if masks is None or not all(m is None or isinstance(m, torch.Tensor) for m in masks):
            masks = []
        if len(masks) != len(self._masks) or any(a is not b for a, b in zip(masks, self._masks, strict=True)):
            self._mask_cache.clear()
        self._masks = list(masks)

    def begin_call(self, call: int, sample: torch.Tensor, kwargs: dict) -> None:
        """A pipeline call starts: remember its latent grid (``sample`` is the denoiser's latent input; packed Flux
        latents keep their ``img_ids``, read only after the run so that nothing synchronises during it)."""
        self.latents[call] = tuple(sample.shape[-2:]) if sample.ndim == 4 else None
        ids = kwargs.get("img_ids")
        channels = getattr(getattr(getattr(self.pipe, "vae", None), "config", None), "latent_channels", None)
        if sample.ndim == 3 and isinstance(ids, torch.Tensor) and ids.shape[-1] == 3 and channels:
            side = math.isqrt(sample.shape[-1] // channels)  # a token packs side x side latent pixels
            if side > 0 and side * side * channels == sample.shape[-1]:
                self._packed_ids[call] = (ids, sample.shape[1], side)
        self._mask_cache.clear()
        self._constants.clear()

    def latent_grid(self, call: int) -> tuple[int, int] | None:
        """The VAE latent grid ``(H, W)`` of ``call``, or ``None`` when unknown. Flux packs side x side latent pixels
        into one token (side from its channels over the VAE's ``latent_channels``: 2) and numbers the tokens' rows and
        columns in ``img_ids`` (columns 1 and 2)."""
        if call in self._packed_ids:
            ids, tokens, side = self._packed_ids.pop(call)
            ids = ids.reshape(-1, 3)
            rows, cols = int(ids[:, 1].max()) + 1, int(ids[:, 2].max()) + 1
            if rows * cols == tokens:
                self.latents[call] = (side * rows, side * cols)
        return self.latents.get(call)

    def estimate_bytes(self, args: tuple, kwargs: dict, recorded_steps: int) -> int:
        """Bytes the maps of one call will take: 2 kinds x float32 x (B, Q, K) per recorded step and layer, the
        contributions (2 x float32 x (B, Q, R), R = K / T), and with :meth:`keep_heads` float32 x (B, H, Q, K) and
        2 x float32 x (B, H, Q, R) more (shares and contributions per head; H the layer's heads: an upper bound under
        ``heads=``, or where contributions are not recorded)."""
        per_step = 0
        for index, layer in enumerate(self.layers):
            elements = self.tap.map_elements(layer, args, kwargs)  # (B, Q, K) over the adapters
            heads = layer.heads if self.heads else 0
            per_step += (2 + heads) * elements  # the shares, and per head
            if layer.family != "sd3":  # contributions: (B, Q, R) per kept value, R = K / T
                tokens = min(self.tokens_per_image(a, index) or 1 for a in range(layer.num_adapters))
                per_step += 2 * (1 + heads) * elements // tokens
        return _BYTES * recorded_steps * per_step

    def check_budget(self, args: tuple, kwargs: dict, recorded_steps: int, max_bytes: int) -> int:
        """Refuse (``ValueError``) before step 0 when this call's maps would exceed ``max_bytes``; return the size."""
        total = self.estimate_bytes(args, kwargs, recorded_steps)
        if total > max_bytes:
            raise ValueError(
                f"maps=True would keep about {total / 2**30:.2f} GiB of reference maps for this call, above "
                f"max_map_bytes={max_bytes / 2**30:.2f} GiB; select fewer layers or steps, or raise max_map_bytes"
            )
        logger.info("maps: about %.1f MiB of reference maps for this call", total / 2**20)
        self.estimated_bytes += total
        return total

    @torch.no_grad()
    def add(
        self,
        where: list[tuple[int, int, int, int]],
        labels: torch.Tensor,
        attention: torch.Tensor,
        nw: torch.Tensor,
        used: torch.Tensor | None = None,
        contribution: torch.Tensor | None = None,
    ) -> None:
        """Add the shares of ``L`` records stacked along the batch (device work only: no host synchronisation); their
        contributions are formed when the pass ends (:meth:`end_pass`).

        Args:
            where: ``L`` (call index, loop index, layer position, adapter), one per record.
            labels: ``(n,)`` int64 on the device, each group's index into the run's branch labels.
            attention, nw: logits ``(L * n, H, items * Q, K)`` of the ``n`` groups of each record's batch (CFG
                chunks or single items; ``K``: one reference's tokens when the adapter runs with a mask, else all).
            used: one record's weights ``(n, H, items * Q, K)`` when an edit changed them, read as they are (not
                renormalised: a zeroed head stays at 0), else ``None`` (the softmax of ``attention``).
            contribution: one record's contributions ``(B, R, Q, C)`` after an edit of its contribution point (all NaN
                after one of its output point), else ``None`` (formed from the weights and the values).
        """
        records, (stacked, heads, rows, tokens) = len(where), attention.shape
        n_branch, items = stacked // records, self._batch // (stacked // records)
        if used is None:  # both softmaxes in one
            weights = softmax_keys([attention, nw])  # (2, L * n, H, items * Q, K)
            weights_all, shares = weights[0], weights.mean(2)
        else:
            weights_all, shares = used, torch.stack([used.mean(1), softmax_keys(nw).mean(1)])
        shares = shares.reshape(2, records, n_branch, items, rows // items, tokens)  # (2, L, n, items, Q, K)
        queries, layer = shares.shape[-2], self.layers[where[0][2]]
        mask = self._masks[where[0][3]] if where[0][3] < len(self._masks) else None
        if contribution is not None:  # an edit of the contributions: what the layer used, not formed here
            self._keep_contributions([(where, labels, *contribution_sums(contribution.float()), None)])
            self.edited_contributions += 1
        elif mask is None and layer.family != "sd3" and heads == layer.heads:  # formed when the values are in
            # (L * n, H, items * Q, K) -> (L * B, H, Q, K), the batch order the value projection sees
            weights = weights_all.reshape(stacked, heads, items, queries, tokens).transpose(1, 2).flatten(0, 1)
            self._pending.append((where, labels, weights))
        if self.heads:
            if mask is not None:
                raise ValueError("per-head maps (keep_heads) do not support ip_adapter_masks; call without masks")
            per_head = weights_all.reshape(records, n_branch, heads, items, queries, tokens).transpose(2, 3)
            for key, part in zip(where, per_head, strict=True):  # (n, items, H, Q, K) each
                self.head_store.setdefault(key, []).append((labels, part))
        if mask is None:
            for key, part in zip(where, shares.unbind(1), strict=True):
                self.store.setdefault(key, []).append((labels, part))
            return
        # masked (one record): diffusers calls to_k_ip once per reference image, in order; weight each by its region
        (key,), shares = where, shares[:, 0]
        index, adapter, entries = key[2], key[3], self.store.setdefault(key, [])
        image = self._images_seen.get((index, adapter), 0)
        self._images_seen[(index, adapter)] = image + 1
        if image == 0:
            entries.append((labels, shares.new_zeros(2, n_branch, items, queries, mask.shape[1] * tokens)))
        self.masked.add((key[0], adapter))
        region = self._region(mask, adapter, image, n_branch * items, queries, shares.device)  # (n * items, Q)
        region = region.reshape(1, n_branch, items, queries, 1)
        entries[-1][1][..., image * tokens : (image + 1) * tokens] = shares * region

    def _value_hook(self, spine: Spine, index: int, adapter: int):
        """Forward hook on ``to_v_ip[adapter]`` of layer ``index``: its values kept for :meth:`end_pass`, references an
        edit removed from them back at 0 (the spine says which: :meth:`~.spine.Spine.kept_references`)."""

        def hook(module, args, output):
            if not isinstance(output, torch.Tensor):
                return
            kept = spine.kept_values.get((self.layers[index].name, adapter))
            if kept is not None and output.ndim == 4:  # (B, R - removed, T, C)
                output = expand_references(output, *kept, 1, 0.0)
            self._values[(index, adapter)] = output

        return hook

    def masks_adapter(self, adapter: int) -> bool:
        """Whether the running pass gives ``adapter`` an ``ip_adapter_masks`` entry (its images then run one softmax
        each, and their maps are formed in the layer)."""
        return adapter < len(self._masks) and self._masks[adapter] is not None

    @torch.no_grad()
    def end_pass(self) -> None:
        """Each reference's contribution ``c_j`` to the image branch's output as it enters the residual stream
        (:func:`~ipa_probe.statistics.kernels.reference_contributions`; device only), each stack of records :meth:`add`
        left at once, from the values its layers computed (none where a pass raised first); kept by
        :meth:`_keep_contributions`, unchanged by the q/k group (the weights are) and by a per-head basis change of the
        values (``W_v -> B W_v``, ``W_o -> W_o B^-1``: ``W_o[:, h] v_h`` is)."""
        pending, self._pending, stacks = self._pending, [], []
        for where, labels, weights in pending:  # weights (L * B, H, Q, K); values (B, K, H * D) or (B, R, T, H * D)
            values, n = [self._values.get(key[2:]) for key in where], self._batch * weights.shape[-1]
            ok = [
                v is not None and v.numel() == n * v.shape[-1] and isinstance(self._scale(key), int | float)
                for key, v in zip(where, values, strict=True)
            ]
            parts = [
                ([key], w, [v]) for key, w, v, o in zip(where, weights.chunk(len(where)), values, ok, strict=True) if o
            ]
            stacks += [self._contribute(*part, labels) for part in ([(where, weights, values)] if all(ok) else parts)]
        if stacks:
            self._keep_contributions(stacks)

    def _scale(self, key: tuple):
        scale = getattr(self.layers[key[2]].processor, "scale", 1.0)
        return scale[key[3]] if isinstance(scale, list | tuple) else scale

    def _contribute(self, where: list, weights: torch.Tensor, values: list, labels: torch.Tensor) -> tuple:
        layers, (heads, keys), device = [self.layers[key[2]] for key in where], weights.shape[1::2], weights.device
        values = [v.float().reshape(self._batch, keys, heads, -1).transpose(1, 2) for v in values]  # (B, H, K, D)
        # Flux: no W_o; only norms and dot products of the contributions are kept: coordinates of the tokens' span
        out = [layer.attention.to_out[0].weight for layer in layers] if layers[0].family == "unet" else []
        # the stack's scales (L,) and W_o's (L, H, D, C), made once a call (the W_o's held: their ids are not reused)
        seen = [device, *(float(self._scale(key)) for key in where), *((id(w), w.device) for w in out)]
        if self._constants.get(stack := tuple(key[2:] for key in where), (None,))[0] != seen:
            scales = seen[1 : len(where) + 1]
            scale = scales[0] if len(set(scales)) == 1 else torch.tensor(scales, device=device)
            w_o = torch.stack([w.float().unflatten(1, (heads, -1)).permute(1, 2, 0) for w in out]) if out else None
            self._constants[stack] = (seen, scale, w_o, out)
        _, scale, out, _ = self._constants[stack]
        tokens = self.tokens_per_image(where[0][3], where[0][2]) or keys
        return where, labels, *reference_sums(weights.float(), values, tokens, scale, out, self.heads)

    def _keep_contributions(self, stacks: list[tuple]) -> None:
        """Keep the norms ``|c_j|`` and projections ``c_j . c / |c|`` (``c = sum_j c_j``: they sum to ``|c|``; per head
        ``c_{j,h} . c / |c|``) of stacks of ``L`` records ``(where, labels, sums, c, c_{j,h})``: their
        :func:`~ipa_probe.statistics.kernels.contribution_sums` ``(3, L * B, R, Q)``, ``c`` ``(L * B, 1, Q, C)`` and
        ``c_{j,h}`` ``(L * B, H, R, Q, C)`` or ``None`` (Flux: ``D``, head ``h``'s part of ``C``), divided in one."""
        kept = torch.cat([sums.flatten(1) for _, _, sums, _, _ in stacks], 1)  # |c_j|, c_j . c, |c|
        kept[1].div_(kept[2].clamp_(min=1e-30))
        parts = kept.split([sums[0].numel() for _, _, sums, _, _ in stacks], 1)
        for (where, labels, sums, total, per_head), part in zip(stacks, parts, strict=True):
            part, shape = part.view(sums.shape), (len(where), labels.shape[0], -1)  # (L, n, items)
            for key, values in zip(where, part[:2].transpose(-1, -2).unflatten(1, shape).unbind(1), strict=True):
                self.contribution_store.setdefault(key, []).append((labels, values))  # (2, n, items, Q, R)
            if per_head is None:
                continue
            flux = per_head.shape[-1] != total.shape[-1]  # Flux: head h's block of c, (B, H, 1, Q, D)
            total = total.unflatten(-1, (per_head.shape[1], -1)).movedim(-2, 1) if flux else total[:, None]
            per_head = torch.stack([per_head.norm(dim=-1), (per_head * total).sum(-1) / part[2][:, None, :1]])
            by_head = per_head.transpose(-1, -2).unflatten(1, shape)  # (2, L, n, items, H, Q, R)
            for key, values in zip(where, by_head.unbind(1), strict=True):
                self.contribution_head_store.setdefault(key, []).append((labels, values))

    def _region(self, mask: torch.Tensor, adapter: int, image: int, batch: int, queries: int, device) -> torch.Tensor:
        """Reference ``image``'s mask on a ``queries``-position grid, ``(batch, Q)``, as the processor weights it."""
        cache = (adapter, image, batch, queries)
        if cache not in self._mask_cache:
            with warnings.catch_warnings():  # the processor already warned about a mismatched aspect ratio
                warnings.simplefilter("ignore")
                down = IPAdapterMaskProcessor.downsample(mask[:, image], batch, queries, 1)  # (batch, Q, 1)
            self._mask_cache[cache] = down[..., 0].to(device=device, dtype=torch.float32).clamp(min=0)
        return self._mask_cache[cache]

    def finalize(self) -> None:
        """Move the maps to the host once, when the probe ends (``.cpu()`` waits for the device's queued work)."""
        if self.edited_contributions:
            warnings.warn(
                f"maps: an edit of the contribution or output hook point acted at {self.edited_contributions} "
                "record(s): their contribution columns are the edited contributions (NaN after an output edit, which "
                "leaves the per-reference split undefined) and they have no per-head contributions (docs/api.md)",
                RuntimeWarning,
                stacklevel=4,
            )
            self.edited_contributions = 0
        if not self._on_host:
            self.end_pass()  # what a pass that raised left
            for name in ("store", "head_store", "contribution_store", "contribution_head_store"):
                stored = getattr(self, name)  # key -> [(labels, values), ...] per pass
                setattr(self, name, {key: [(a.cpu(), b.cpu()) for a, b in entries] for key, entries in stored.items()})
            self._values.clear()
            self._mask_cache.clear()
            self._constants.clear()
            self._masks = []
            self._on_host = True

    # ------------------------------------------------------------------ reading
    def chunk(self, key: tuple[int, int, int, int], label: int) -> torch.Tensor | None:
        """The ``(2, items, Q, K)`` shares of the batch items labelled ``label`` at ``key`` (host, in batch order, over
        the passes in order), or ``None`` when no item has that label."""
        return _by_label(self.store, key, label, 1)

    def tokens_per_image(self, adapter: int, index: int) -> int:
        """:func:`tokens_per_image` of layer ``index``; 0 (all keys are one image) when unknown."""
        return tokens_per_image(self.layers[index].processor, self._projections, adapter) or 0

    def grid(self, call: int, queries: int) -> tuple[int, int]:
        """The ``(h, w)`` query grid of a layer with ``queries`` positions in ``call``."""
        return query_grid(self.latent_grid(call), queries)

    def image_size(self, call: int) -> tuple[int, int]:
        latent = self.latent_grid(call)
        if latent is None:
            raise ValueError('size="image" needs the latent grid of the call; pass size=(H, W) instead')
        factor = int(getattr(self.pipe, "vae_scale_factor", 8))
        return latent[0] * factor, latent[1] * factor

    def shares(
        self,
        call: int,
        item: int,
        adapter: int,
        kind: str,
        branch: str,
        layers: Iterable[int],
        steps: Iterable[int],
        size: tuple[int, int] | str,
        per_token: bool,
    ) -> torch.Tensor:
        """Average the selected (step, layer) maps on one grid: ``(R, H, W)`` or ``(R, T, H, W)`` float32, CPU."""
        which, label = MAP_KINDS.index(kind), self.labels.index(branch)
        target = self.image_size(call) if size == "image" else None if isinstance(size, str) else size
        total, count = None, 0
        for _, index, buffer in self._chunks(call, item, adapter, label, layers, steps):
            weights = buffer[which, item].double()  # (Q, K)
            queries, keys = weights.shape
            tokens = self.tokens_per_image(adapter, index) or keys
            per_ref = weights.reshape(queries, keys // tokens, tokens)  # (Q, R, T)
            if (call, adapter) in self.masked:
                per_ref, _ = _over_references(per_ref, (1, 2))
            values = per_ref if per_token else per_ref.sum(-1)  # (Q, R, T) or (Q, R)
            h, w = self.grid(call, queries)
            if target is None:  # "latent"
                target = self.latent_grid(call) or (h, w)
            spatial = values.reshape(h, w, -1).permute(2, 0, 1)  # (R[*T], h, w)
            if (h, w) != tuple(target):
                spatial = F.interpolate(spatial[None], size=tuple(target), mode="bilinear", align_corners=False)[0]
            total = spatial if total is None else total + spatial
            count += 1
        if total is None:
            raise ValueError(
                f"no maps recorded for call={call}, adapter={adapter}, branch {branch!r} at the selected layers "
                "and steps; check `branch` (run.to_dataframe()['branch'] lists the recorded ones), `steps` (loop "
                "indices the probe recorded) and `layers`"
            )
        out = (total / count).float()
        return out.unflatten(0, (per_ref.shape[1], -1)) if per_token else out  # (R, T, H, W) or (R, H, W)

    def reference_weights(
        self, call: int, item: int, adapter: int, kind: str, branch: str, layers: Iterable[int], steps: Iterable[int]
    ) -> dict[tuple[int, int], torch.Tensor]:
        """Each selected (step, layer position)'s weights over the references at every query position, at the layer's
        own grid: ``(Q, R)`` float64 CPU tensors (see :func:`_reference_shares`); pairs without maps are left out."""
        which, label = MAP_KINDS.index(kind), self.labels.index(branch)
        return {
            (step, index): _reference_shares(self, (call, step, index, adapter), label)[0][which, item]
            for step, index, _ in self._chunks(call, item, adapter, label, layers, steps)
        }

    def _chunks(self, call, item, adapter, label, layers: Iterable[int], steps: Iterable[int], get=None, axis=1):
        """Each selected (step, layer position) that has maps, with its ``(2, items, Q, K)`` :meth:`chunk` (or what
        ``get(key, label)`` gives, the items along ``axis``)."""
        for step in steps:
            for index in layers:
                buffer = (get or self.chunk)((call, step, index, adapter), label)
                if buffer is None:
                    continue
                if item >= buffer.shape[axis]:
                    raise ValueError(f"item={item}: call {call} generated {buffer.shape[axis]} images per branch")
                yield step, index, buffer

    def head_weights(
        self, call: int, item: int, adapter: int, branch: str, layers: Iterable[int], steps: Iterable[int]
    ) -> dict[tuple[int, int], torch.Tensor]:
        """Each selected (step, layer position)'s attention weights over the references per head and query position:
        ``(H, Q, R)`` float64 CPU tensors (sum 1 over ``R``); needs :meth:`keep_heads`."""
        if not self.heads:
            raise ValueError("per-head weights need MapAccumulator.keep_heads() before the pipeline runs")
        label, out = self.labels.index(branch), {}
        get = partial(_by_label, self.head_store, axis=0)  # (items, H, Q, K)
        for step, index, buffer in self._chunks(call, item, adapter, label, layers, steps, get, 0):
            tokens = self.tokens_per_image(adapter, index) or buffer.shape[-1]
            out[(step, index)] = buffer[item].double().unflatten(-1, (-1, tokens)).sum(-1)  # (H, Q, R)
        return out

    def contribution_chunk(self, key: tuple, label: int, heads: bool = False) -> torch.Tensor | None:
        """The contributions of the batch items labelled ``label`` at ``key`` (host, batch order, passes in order):
        ``(2, items, Q, R)`` (norm, projection onto the total), or per head ``(2, items, H, Q, R)``; ``None`` when
        none were recorded (masked adapters, SD3, a head selection, per-image scales)."""
        values = _by_label(self.contribution_head_store if heads else self.contribution_store, key, label, 1)
        return None if values is None else values.double()  # (2, items, [H,] Q, R)

    def contribution_weights(
        self, call: int, item: int, adapter: int, branch: str, layers: Iterable[int], steps: Iterable[int], heads=False
    ) -> dict[tuple[int, int], torch.Tensor]:
        """Each selected (step, layer position)'s contributions per reference at every query position: ``(3, Q, R)``
        float64 CPU tensors (norm ``|c_j|``, share ``|c_j| / sum_k |c_k|``, projection ``c_j . c / |c|``), or per
        head ``(3, H, Q, R)`` (the share then over the references and heads of the position) with ``heads=True``
        (needs :meth:`keep_heads`); pairs without contributions are left out."""
        if heads and not self.heads:
            raise ValueError("per-head contributions need MapAccumulator.keep_heads() before the pipeline runs")
        get, label = partial(self.contribution_chunk, heads=heads), self.labels.index(branch)
        chunks = self._chunks(call, item, adapter, label, layers, steps, get)
        return {(step, index): with_share(buffer[:, item]) for step, index, buffer in chunks}


def image_projections(denoiser: torch.nn.Module) -> Sequence[torch.nn.Module] | None:
    """The denoiser's per-adapter image projections (``encoder_hid_proj.image_projection_layers``), or ``None``."""
    projection = getattr(model_of(denoiser), "encoder_hid_proj", None)
    return getattr(projection, "image_projection_layers", None)


def tokens_per_image(processor, projections: Sequence[torch.nn.Module] | None, adapter: int) -> int | None:
    """Tokens per reference image of ``adapter``: the processor's ``num_tokens`` (UNet), else what the adapter's
    image projection makes of one image (Flux: ``ImageProjection.num_image_text_embeds``); ``None`` when neither
    says."""
    num_tokens = getattr(processor, "num_tokens", None)
    if isinstance(num_tokens, Sequence) and adapter < len(num_tokens):
        return int(num_tokens[adapter])
    per_image = getattr(projections[adapter], "num_image_text_embeds", None) if adapter < len(projections or ()) else 0
    return per_image if isinstance(per_image, int) and per_image > 0 else None


def _by_label(store: dict, key: tuple, label: int, axis: int) -> torch.Tensor | None:
    """The values of ``store[key]`` (a ``(labels, values)`` pair per pass, the groups along ``axis`` of ``values``) of
    the groups labelled ``label``, joined along ``axis`` (batch order, passes in order); ``None`` when none."""
    parts = [
        values.select(axis, position)
        for labels, values in store.get(key, ())
        for position, value in enumerate(labels.tolist())
        if value == label
    ]
    return torch.cat(parts, axis) if parts else None


def with_share(values: torch.Tensor) -> torch.Tensor:
    """``(2, ..., Q, R)`` norms and projections -> ``(3, ..., Q, R)`` with the norm's share of its position between
    them: ``|c_j| / sum |c|`` over the position's references (and heads, when a head axis is there)."""
    norm = values[0]
    dims = (-1,) if norm.ndim == 2 else (0, -1)  # (Q, R), or (H, Q, R): all heads and references of a position
    total = norm.sum(dims, keepdim=True)
    share = torch.where(total > 0, norm / total.clamp(min=1e-300), norm * 0)  # NaN stays NaN (an edited output)
    return torch.stack([norm, share, values[1]])


def query_grid(latent: tuple[int, int] | None, queries: int) -> tuple[int, int]:
    """The ``(h, w)`` grid of a layer with ``queries`` positions over a ``latent`` grid ``(H, W)``: the latent
    downsampled by 1, 2, 4, ... 64 (rounding up, as strided convolutions do); a square when the latent is unknown."""
    if latent is not None:
        for factor in (1, 2, 4, 8, 16, 32, 64):
            h, w = math.ceil(latent[0] / factor), math.ceil(latent[1] / factor)
            if h * w == queries:
                return h, w
    side = math.isqrt(queries)
    if side * side == queries:
        return side, side
    raise ValueError(
        f"cannot place {queries} query positions on a grid for latent {latent}: reference maps need the latent "
        "grid of the call (an SD-style latent, or Flux's img_ids), or a square number of positions"
    )


def select_layers(names: list[str], layers: LayerSelection) -> list[int]:
    """Positions of the probe's layers a selection (regex or list of them, or None) picks; raises if none."""
    patterns = compile_selection(layers)
    if patterns is None:
        return list(range(len(names)))
    chosen = [i for i, name in enumerate(names) if any(p.search(name) for p in patterns)]
    if not chosen:
        raise ValueError(
            f"layers={[p.pattern for p in patterns]} matched none of the probed layers (e.g. {names[0]!r}); pass a "
            "regex that `re.search` finds in one of run.layers' names, or None for all"
        )
    return chosen


def check_size(size: Any) -> tuple[int, int] | str:
    if size in ("image", "latent"):
        return size
    if (
        isinstance(size, tuple | list)
        and len(size) == 2
        and all(isinstance(s, int) and not isinstance(s, bool) and s > 0 for s in size)
    ):
        return tuple(size)
    raise ValueError(f'size: expected "image", "latent" or (H, W) positive ints, got {size!r}')


def _over_references(weights: torch.Tensor, dims) -> tuple[torch.Tensor, torch.Tensor]:
    """``weights`` normalised to sum 1 over ``dims`` (the references, with their tokens where kept), zero where
    nothing was there to normalise (a position outside every reference's mask): ``(normalised, mass)``."""
    mass = weights.sum(dims, keepdim=True)
    return torch.where(mass > 0, weights / mass.clamp(min=1e-300), torch.zeros_like(weights)), mass


def _reference_shares(
    accumulator: MapAccumulator, key: tuple[int, int, int, int], label: int
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The per-reference shares at ``key`` for the items labelled ``label`` at each query position, normalised over
    the adapter's references where masks weighted them (else as the layer used them: an edit that leaves the weights
    unnormalised leaves the shares so): ``(shares (2, items, Q, R) float64, covered (items, Q) bool, references)``; a
    position is covered when some reference gets weight there under both attributions."""
    buffer = accumulator.chunk(key, label)  # (2, items, Q, K)
    _, items, queries, keys = buffer.shape
    tokens = accumulator.tokens_per_image(key[3], key[2]) or keys
    refs = buffer.double().reshape(2, items, queries, keys // tokens, tokens).sum(-1)  # (2, I, Q, R)
    normalised, mass = _over_references(refs, -1)  # mass: (2, I, Q, 1)
    refs = normalised if (key[0], key[3]) in accumulator.masked else refs
    covered = (mass[0, ..., 0] > 0) & (mass[1, ..., 0] > 0)  # (I, Q)
    return refs, covered, keys // tokens
