"""User callbacks on the hook points (:func:`apply_hooks`, used by ``intervene(pipe, hooks=...)``) and the
``mode="scale"`` intervention built on them (:func:`scale_hooks`)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .._checks import parse_step_selection
from .config import InterventionConfig
from .points import HookContext, HookFn, PointUser, attach_points, normalise_hooks, point_name

__all__ = ["HOOKS", "HookIntervention", "apply_hooks", "scale_hooks"]

logger = logging.getLogger(__name__)

#: The feature's claim on the denoiser (:func:`ipa_probe.list_hooks`): callbacks on hook points.
HOOKS = "hook_points"


@dataclass
class HookIntervention:
    """Callbacks attached to hook points (until :meth:`remove`).

    Attributes:
        names: the hook point names that carry callbacks.
        calls: ``(step, name)`` pairs where a callback ran, in order.
    """

    names: list[str]
    calls: list[tuple[int, str]] = field(default_factory=list)
    _detach: Callable[[], None] | None = field(default=None, repr=False)
    _user: PointUser | None = field(default=None, repr=False)

    @property
    def steps(self) -> Any:
        """The step selection (from :func:`~ipa_probe._checks.parse_step_selection`; ``None`` for all)."""
        return None if self._user is None else self._user.steps

    @property
    def steps_run(self) -> int:
        """The most denoising steps a pipeline call ran while the callbacks were attached (0 before any call)."""
        return 0 if self._user is None else self._user.steps_run

    @property
    def selected(self) -> int:
        """The passes the step selection selected."""
        return 0 if self._user is None else self._user.selected

    @property
    def active(self) -> bool:
        return self._detach is not None

    def remove(self) -> None:
        """Take the callbacks off (and the hooks, when no other user holds points); idempotent."""
        detach, self._detach = self._detach, None
        if detach is not None:
            detach()


def apply_hooks(pipe, hooks: Mapping[str, HookFn | Sequence[HookFn]], *, steps=None) -> HookIntervention:
    """Attach callbacks ``{hook point name: fn(tensor, ctx)}`` (see :mod:`.points`) at the selected steps.

    Raises:
        ValueError / TypeError: an unknown name, a callback that is not callable, a bad step selection, a pipeline
            without hook points; raised before anything is attached.
    """
    callbacks = normalise_hooks(pipe, hooks)
    steps = parse_step_selection(steps)
    state = HookIntervention(sorted(callbacks))

    def logged(name: str, fn: HookFn) -> HookFn:
        def run(tensor: torch.Tensor, ctx: HookContext) -> torch.Tensor | None:
            state.calls.append((ctx.step, name))
            return fn(tensor, ctx)

        return run

    user = PointUser(
        {name: [logged(name, fn) for fn in fns] for name, fns in callbacks.items()},
        steps,
        label=f"hooks:{len(callbacks)}",
    )
    state._user = user
    state._detach = attach_points(pipe, user, HOOKS, f"callbacks on {len(callbacks)} hook point(s)")
    logger.info("intervene: callbacks on %d hook point(s)", len(callbacks))
    return state


def scale_hooks(config: InterventionConfig, layers: Sequence[str], joint: bool = False) -> dict[str, HookFn]:
    """The weights callbacks of ``mode="scale"``: reference ``j``'s unnormalised weights (``exp`` of its logits) are
    multiplied by its factor ``f_j`` and the softmax renormalised, ``w'_i = f_j w_i / sum_k f_k w_k``: ``f = 0``
    removes the reference from the softmax exactly as ``"ablate"`` does, ``f = 1`` changes nothing. Where every
    token's factor is 0 (or the weights are NaN) the weights are 0 (the branch adds nothing, as ablating every
    reference does). SD3 (``joint``), whose softmax also runs over the latent tokens: the same, as ``log f`` added
    to the image columns' logits."""
    factors = dict(zip(config.references, config.factors, strict=True))
    per_token: dict[tuple, torch.Tensor] = {}  # each token's factor (SD3: its log), made once per shape and device

    def rescale(x: torch.Tensor, ctx: HookContext) -> torch.Tensor | None:  # the weights (SD3: the logits)
        if ctx.references <= max(factors):
            raise ValueError(
                f"reference={config.reference}: adapter {ctx.adapter} has {ctx.references} reference image(s) in "
                f"this call; pass indices below {ctx.references}"
            )
        if all(f == 1 for f in factors.values()):
            return None  # the identity, exactly
        key = (ctx.references, ctx.tokens, x.dtype, x.device)  # made on the device once, not at every layer and pass
        if key not in per_token:
            f = torch.tensor([factors.get(r, 1.0) for r in range(ctx.references)], dtype=x.dtype, device=x.device)
            per_token[key] = f.repeat_interleave(ctx.tokens).log() if joint else f.repeat_interleave(ctx.tokens)
        if joint:
            return x + per_token[key]  # (B, H, Q, K); log 0 = -inf
        scaled = x * per_token[key]  # (B, H, Q, K)
        total = scaled.sum(-1, keepdim=True)  # (B, H, Q, 1): 0 where every factor is (0 / tiny = 0), or NaN
        return (scaled / total.clamp_min(torch.finfo(x.dtype).tiny)).nan_to_num_(0.0)

    return {point_name(layer, "logits" if joint else "weights", config.adapter): rescale for layer in layers}
