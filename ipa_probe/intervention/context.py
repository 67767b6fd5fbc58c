"""What a hook point's callback is told about the tensor it gets: :class:`HookContext` (see :mod:`.points`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["HookContext"]


@dataclass(frozen=True)
class HookContext:
    """What a callback knows about the tensor it is given.

    Attributes:
        name, layer, point: the hook point's name, its layer id and one of :data:`POINTS`.
        adapter: the IP-Adapter's index, or ``"text"`` for the text branch.
        step: the denoising loop index.
        call: the pipeline call's index since the pipeline's first feature was attached.
        timestep: the scheduler's timestep of this pass (as the denoiser got it: a tensor, or a number).
        heads: the layer's attention heads ``H``.
        references: the reference images ``R`` the branch saw in this call: at the ``k`` and ``logits`` points those in
            the keys (an ablation removes some there), at the others those the call passed; ``reference_tokens(j)``
            gives reference ``j``'s key positions.
        tokens: image tokens per reference ``T`` (``K = R * T``).
        grid: ``(height, width)`` of the layer's query positions (``Q = height * width``).
        scale: the adapter scale ``s`` the branch is multiplied by.
        device: where the tensors live.
        pass_index: the denoiser pass within the step (0 for the first; Flux's true-CFG negative pass is 1).
        cfg: each batch item's branch label, as the probe's table labels it: ``"cond"`` or ``"uncond"`` where the
            item's prompt embeddings equal the prompt's or the negative prompt's the pipeline encoded (Flux's true-CFG
            negative pass is ``"uncond"``), ``"batch"`` where no evidence matched (:mod:`ipa_probe.capture.branches`).
    """

    name: str
    layer: str
    point: str
    adapter: int | str
    step: int
    timestep: Any
    heads: int
    references: int
    tokens: int
    grid: tuple[int, int] | None
    scale: float
    device: torch.device = field(repr=False, default=torch.device("cpu"))
    pass_index: int = 0
    cfg: tuple[str, ...] = ()
    call: int = 0

    @property
    def queries(self) -> int:
        """Query positions ``Q``."""
        return self.grid[0] * self.grid[1] if self.grid is not None else -1

    def reference_tokens(self, reference: int) -> slice:
        """The key positions (last axis of ``weights``) of reference ``reference``'s image tokens."""
        if not 0 <= reference < self.references:
            raise ValueError(f"reference={reference}: this call has {self.references} reference image(s)")
        return slice(reference * self.tokens, (reference + 1) * self.tokens)

    def select(
        self,
        *,
        heads: Sequence[int] | int | None = None,
        positions: Any = None,
        references: Sequence[int] | int | None = None,
    ) -> torch.Tensor:
        """A bool mask on the device, broadcastable to this point's tensor, ``True`` where all given selections hold.

        Args:
            heads: head indices (``weights`` only: ``to_out`` sums heads into the contribution and output).
            positions: query positions: indices, a ``slice``, a bool ``(Q,)`` mask or a bool ``(height, width)`` mask
                over :attr:`grid`.
            references: reference indices (``weights``: their tokens; ``contribution``: their slots; not ``output``).

        Returns:
            ``(1, H, Q, K)`` for logits and weights, ``(1, H, Q, 1)`` for q, ``(1, H, K, 1)`` for k, ``(1, R, Q, 1)``
            for contributions, ``(1, Q, 1)`` for the output.
        """
        if heads is not None and self.point in ("contribution", "output"):
            raise ValueError(
                f"{self.name}: heads= selects heads of the q, k, logits and weights points only (to_out sums the "
                "heads into the contribution); hook '<layer id>.ip.weights' for per-head edits"
            )
        if references is not None and self.point in ("output", "q"):
            raise ValueError(f"{self.name}: this point has no reference axis; hook '.ip.contribution' to select them")
        if positions is not None and self.point == "k":
            raise ValueError(f"{self.name}: the keys have no query positions; select references= or heads=")
        head_mask = self._indices(heads, self.heads, "heads")  # (H,)
        if self.point == "k":
            keys = self._indices(references, self.references, "references").repeat_interleave(self.tokens)  # (K,)
            return (head_mask[:, None] & keys[None, :])[None, ..., None]  # (1, H, K, 1)
        queries = self._positions(positions)  # (Q,)
        if self.point == "output":
            return queries[None, :, None]  # (1, Q, 1)
        if self.point == "q":
            return (head_mask[:, None] & queries[None, :])[None, ..., None]  # (1, H, Q, 1)
        refs = self._indices(references, self.references, "references")  # (R,)
        if self.point == "contribution":
            return (refs[:, None] & queries[None, :])[None, ..., None]  # (1, R, Q, 1)
        keys = refs.repeat_interleave(self.tokens)  # (K,)
        return (head_mask[:, None, None] & queries[None, :, None] & keys[None, None, :])[None]  # (1, H, Q, K)

    def where(self, tensor: torch.Tensor, value: float | torch.Tensor, **selection: Any) -> torch.Tensor:
        """``tensor`` with ``value`` where :meth:`select` (``heads``, ``positions``, ``references``) holds: a new
        tensor, e.g. ``lambda w, ctx: ctx.where(w, 0.0, heads=[1], references=[0])``."""
        value = torch.as_tensor(value, dtype=tensor.dtype, device=tensor.device)
        return torch.where(self.select(**selection), value, tensor)

    def _indices(self, chosen: Sequence[int] | int | None, size: int, argument: str) -> torch.Tensor:
        mask = torch.zeros(size, dtype=torch.bool, device=self.device)
        if chosen is None:
            return mask.fill_(True)
        chosen = [chosen] if isinstance(chosen, int) else list(chosen)
        bad = [c for c in chosen if not isinstance(c, int) or isinstance(c, bool) or not 0 <= c < size]
        if bad:
            raise ValueError(f"{self.name}: {argument}={bad} out of range; this point has {size} {argument}")
        mask[chosen] = True
        return mask

    def _positions(self, positions: Any) -> torch.Tensor:
        queries = self.queries
        if positions is None:
            return torch.ones(queries, dtype=torch.bool, device=self.device)
        if isinstance(positions, torch.Tensor) and positions.dtype == torch.bool:
            if positions.ndim == 2 and self.grid is not None and tuple(positions.shape) == self.grid:
                positions = positions.reshape(-1)
            if positions.shape != (queries,):
                raise ValueError(
                    f"{self.name}: positions= mask of shape {tuple(positions.shape)}; expected ({queries},) or the "
                    f"grid {self.grid}"
                )
            return positions.to(self.device)
        mask = torch.zeros(queries, dtype=torch.bool, device=self.device)
        if isinstance(positions, slice):
            mask[positions] = True
            return mask
        return self._indices(positions, queries, "positions")
