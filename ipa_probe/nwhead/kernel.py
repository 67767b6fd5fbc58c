"""What the NW head of every model family shares: the timestep clock, the bandwidth and the NW kernel.

The kernel (paper §C.3): Gaussian NW weights over keys ``k_i`` are scaled dot-product attention with temperature
``h^2`` and a per-key *key-norm bias*,

    softmax_i(-|q - k_i|^2 / (2 h^2)) = softmax_i(q·k_i / h^2 - |k_i|^2 / (2 h^2)),

so :meth:`NWKernel.nw_attention` runs ``F.scaled_dot_product_attention`` with that bias as a float mask of shape
``(B, H, 1, K)``, and no weight matrix is materialised. That is the *stored frame*: ``|k_i|^2`` depends on the basis
the weights happen to be stored in, so two models related by a per-head basis change (``q -> A q``,
``k -> A^-T k``: every output equal) get different NW heads.

The *query frame* (``frame="query"``) takes the key term from the logits instead: with ``L`` the model's own logits
``q·k_i / sqrt(d)``, row-centred, ``b_i = log mean_q exp(L_qi)`` over the queries of the current call (one batch item,
one head, the rows inside an IP-Adapter mask), or its Gaussian form ``mean + var / 2``
(:func:`ipa_probe.statistics.kernels.query_frame_bias`), and the head's weights are ``softmax_i(q·k_i / sqrt(d) -
b_i)``: Gaussian NW in the frame where the model's own queries are isotropic, a function of the logits alone and so the
same for every basis in which the weights are stored. :class:`NWKernel` is mixed into each family's processor
(:mod:`.unet`, :mod:`.flux`, :mod:`.sd3`); :class:`ProcessorView` is how the Flux and SD3 heads stand in for the
diffusers processor they replace (its very modules and settings, no copies).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from .._checks import check_nw_frame
from ..statistics import bandwidth as bw
from ..statistics.bandwidth import BandwidthSpec
from ..statistics.kernels import dot_logits, key_norm_bias, nw_logits, query_frame_bias

__all__ = ["NWKernel", "ProcessorView", "TimestepClock", "check_head_bandwidth"]


def check_head_bandwidth(spec: Any) -> BandwidthSpec:
    """Validate the NW head's bandwidth (:func:`ipa_probe.statistics.bandwidth.check`, where ``"fit"`` gets its own
    remedy).

    Returns:
        the spec, with an int made a float.
    """
    if spec == "fit":
        raise ValueError(
            'bandwidth="fit" is a probe setting, not a head: run `ipa_probe.probe(pipe, bandwidth="fit")`, read '
            "the fitted h from its `bandwidth` column and pass that float (or a callable of the timestep) here"
        )
    return bw.check(spec)


class TimestepClock:
    """Holds the denoiser's current timestep for processors whose bandwidth is a function of it.

    A client of the pipeline's :class:`~ipa_probe.capture.spine.Spine` (:meth:`on_pass`): each denoiser pass it
    stores the pass's timestep on the scheduler's 0-1000 scale (a reference, no copy and no host synchronisation);
    the processors read it during the same forward.
    """

    def __init__(self) -> None:
        self.timestep: torch.Tensor | None = None

    def on_pass(self, spine, args: tuple, kwargs: dict) -> None:
        timestep = spine.now.timestep
        if timestep is None:
            self.timestep = None
        elif isinstance(timestep, torch.Tensor):
            self.timestep = timestep.reshape(-1)[0]  # 0-d view: the pipelines pass one timestep per call
        else:
            sample = spine.tap.sample(args, kwargs)
            device = sample.device if isinstance(sample, torch.Tensor) else None
            self.timestep = torch.tensor(float(timestep), device=device)


class NWKernel:
    """The NW head's frame, bandwidth and kernel, mixed into each family's processor (before the diffusers class).

    Attributes:
        bandwidth: ``"matched"``, a positive float or a callable of the timestep (see
        :mod:`ipa_probe.statistics.bandwidth`);
            ``"matched"`` only for the query frame (its logits carry the model's own temperature).
        clock: where a callable bandwidth reads the timestep.
        frame: ``"stored"`` (key term ``|k|^2 / (2 h^2)``: gauge dependent) or ``"query"`` (key term ``b_i`` from the
            current call's queries: gauge invariant).
        form: for the query frame, ``"exact"`` or ``"gaussian"`` (how ``b`` is estimated); ``None`` for the stored one.
    """

    bandwidth: BandwidthSpec
    clock: TimestepClock | None
    frame: str = "stored"
    form: str | None = None

    def _set_bandwidth(
        self, spec: BandwidthSpec, clock: TimestepClock | None, frame: str = "stored", form: str | None = None
    ) -> None:
        spec = check_head_bandwidth(spec)
        self.frame, self.form = check_nw_frame(frame, form, spec)
        if callable(spec) and clock is None:
            raise ValueError(
                "a callable bandwidth needs a TimestepClock to read the timestep from; use ipa_probe.nw_head / "
                "apply_nw_head, which install one on the denoiser, or pass clock=TimestepClock()"
            )
        self.bandwidth = spec
        self.clock = clock

    def extra_repr(self) -> str:
        if self.frame == "query":
            return f"frame=query, form={self.form}"
        return f"bandwidth={bw.describe(self.bandwidth)}"

    def bandwidth_for(self, head_dim: int, device: torch.device | None = None) -> float | torch.Tensor:
        """The bandwidth ``h`` used now: a float, or a 0-d float32 tensor for a callable of the timestep."""
        timestep = self.clock.timestep if self.clock is not None else None
        return bw.resolve(self.bandwidth, head_dim, timestep, device)

    def image_branch_logits(
        self, query: torch.Tensor, key: torch.Tensor, other: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The logits whose softmax this processor applies to the image tokens: Gaussian NW logits.

        Args:
            query: ``(B, H, Q, D)``.
            key: image-token keys ``(B, H, K, D)``.
            other: the further keys the softmax runs over (SD3's latent keys ``(B, H, N, D)``), or ``None``.

        Returns:
            ``(B, H, Q, K)``: stored frame ``(q·k_i - |k_i|^2/2) / h^2`` (``-|q - k_i|^2 / (2 h^2)`` up to a per-row
            constant); query frame ``q·k_i / sqrt(d) - b_i``, ``b`` over the ``Q`` rows given per batch item and head,
            rows centred over ``[key; other]``: the head's own logits on the call's queries and keys (without masks).
        """
        if self.frame == "query":
            joint = key if other is None else torch.cat([key, other], dim=2)  # (B, H, K + N, D)
            logits = dot_logits(query, joint)  # (B, H, Q, K + N), the model's q·k / sqrt(d)
            return (logits - query_frame_bias(logits, form=self.form))[..., : key.shape[2]]
        return nw_logits(query, key, self.bandwidth_for(query.shape[-1], query.device))

    def query_frame_mask(
        self, query: torch.Tensor, key: torch.Tensor, rows: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The query-frame head's float mask ``-b``, shifted so that its largest entry is 0 (a per-row constant).

        ``b`` is estimated on the device, per batch item and head, from the logits ``q·k / sqrt(d)`` in at least
        float32 (:func:`ipa_probe.statistics.kernels.query_frame_bias`); nothing is read back to the host.

        Args:
            query: ``(B, H, Q, D)``.
            key: ``(B, H, K, D)``.
            rows: optional boolean ``(B, 1, Q)``: the queries that form the frame (an IP-Adapter mask's rows); an
                item with no such row falls back to all its rows.

        Returns:
            ``(B, H, 1, K)`` in the query's dtype, to pass as SDPA's ``attn_mask``.
        """
        work = torch.promote_types(query.dtype, torch.float32)
        logits = dot_logits(query.to(work), key.to(work))  # (B, H, Q, K)
        if rows is not None:
            rows = rows | ~rows.any(-1, keepdim=True)  # an empty mask would leave no query to average over
        b = query_frame_bias(logits, row_mask=rows, form=self.form)  # (B, H, 1, K)
        # Shift the smallest b to 0 (a per-row constant: the softmax is unchanged) so the mask stays in range in half
        # precision and at least one key keeps a finite logit.
        return (b.amin(-1, keepdim=True) - b).to(query.dtype)

    def nw_attention(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, rows: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Gaussian NW smoothing of ``value`` over ``key`` for each query, without materialising the weights.

        Args:
            query: ``(B, H, Q, D)``.
            key: ``(B, H, K, D)``.
            value: ``(B, H, K, Dv)``.
            rows: query frame only: optional boolean ``(B, 1, Q)``, the queries whose logits estimate ``b`` (see
                :meth:`query_frame_mask`); ignored by the stored frame, whose key term does not look at queries.

        Returns:
            ``sum_i w_i(q) v_i``, shape ``(B, H, Q, Dv)``, with ``w = softmax_i(-|q - k_i|^2 / (2 h^2))`` (stored
            frame) or ``w = softmax_i(q·k_i / sqrt(d) - b_i)`` (query frame).
        """
        if self.frame == "query":
            mask = self.query_frame_mask(query, key, rows)  # (B, H, 1, K)
            return F.scaled_dot_product_attention(query, key, value, attn_mask=mask)  # scale 1/sqrt(d): the model's
        h = self.bandwidth_for(query.shape[-1], query.device)
        bias = key_norm_bias(key.to(torch.promote_types(key.dtype, torch.float32)), h)  # (B, H, 1, K), >= float32
        # A per-row constant does not change a softmax: shift the largest bias to 0 so that the mask stays in range
        # in half precision and at least one key keeps a finite logit.
        bias = (bias - bias.amax(-1, keepdim=True)).to(query.dtype)
        if isinstance(h, torch.Tensor):
            # SDPA's `scale` must be a Python float; fold a tensor temperature into the query instead (no sync).
            query = query * (1.0 / (h * h)).to(query.dtype)
            return F.scaled_dot_product_attention(query, key, value, attn_mask=bias, scale=1.0)
        return F.scaled_dot_product_attention(query, key, value, attn_mask=bias, scale=1.0 / (h * h))


class ProcessorView(NWKernel):
    """An NW head that stands in for a diffusers processor as a *view* of it (Flux and SD3).

    The head holds the original's submodules (weights, norms) and settings, the very same objects, and forwards
    ``scale`` to the original, so ``set_ip_adapter_scale`` (which *assigns* ``processor.scale``) persists after the
    original is restored, and probe hooks on the shared modules still fire.

    Args:
        original: the diffusers processor to stand in for (an instance of the subclass's ``_mirrored``).
        bandwidth, clock, frame, form: as :class:`NWKernel`'s attributes (``"matched"``: ``h^2 = sqrt(d_head)``; a
            callable bandwidth, of the timestep 0-1000, needs ``clock``; ``form`` defaults to ``"exact"``).
    """

    #: diffusers' processor class this head mirrors.
    _mirrored: type = torch.nn.Module

    def __init__(
        self,
        original: torch.nn.Module,
        bandwidth: BandwidthSpec = "matched",
        clock: TimestepClock | None = None,
        *,
        frame: str = "stored",
        form: str | None = None,
    ) -> None:
        if not isinstance(original, self._mirrored):
            raise TypeError(
                f"expected a {self._mirrored.__name__} (loaded by `pipe.load_ip_adapter(...)`), got "
                f"{type(original).__name__}; use ipa_probe.nw_head(pipe), which picks the NW head for each layer"
            )
        torch.nn.Module.__init__(self)
        self.__dict__["_original"] = original  # kept out of the module tree (its weights are already shared)
        for name, module in original.named_children():
            setattr(self, name, module)
        for name, value in vars(original).items():
            if not name.startswith("_") and name not in ("training", "scale"):
                setattr(self, name, value)
        for name in ("_attention_backend", "_parallel_config"):
            if name in vars(original):
                setattr(self, name, vars(original)[name])
        self.training = original.training
        self._set_bandwidth(bandwidth, clock, frame, form)

    @property
    def original(self) -> torch.nn.Module:
        """The diffusers processor this head stands in for (restored on removal)."""
        return self.__dict__["_original"]

    @property
    def scale(self):
        """The original's ``scale``: read and assigned through, so ``set_ip_adapter_scale`` persists after removal."""
        return self.original.scale

    @scale.setter
    def scale(self, value) -> None:
        self.original.scale = value
