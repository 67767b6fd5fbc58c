"""The settings of an intervention on one reference image's tokens: :class:`InterventionConfig`."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from .._checks import describe_value, parse_step_selection, step_selected
from ..layers import LayerSelection, compile_selection

__all__ = ["INTERVENE", "MODES", "InterventionConfig"]

#: The feature's name: its claim on the denoiser (:func:`ipa_probe.list_hooks`) and the key of its state there.
INTERVENE = "intervene"

#: What happens to the chosen reference's image tokens: ``"ablate"`` removes them from the image branch's softmax (the
#: others' weights renormalised, as if the reference had not been given to that layer at that step; SD3: the branch
#: then has no image tokens and is skipped), ``"swap"`` replaces them by another image's tokens, ``"scale"`` multiplies
#: their weight in the softmax by a factor ``>= 0`` (0 is ``"ablate"``, 1 changes nothing, above 1 amplifies).
MODES: tuple[str, ...] = ("ablate", "swap", "scale")


@dataclass(frozen=True)
class InterventionConfig:
    """Which reference image, where and when, and what to do with its tokens. Validated on construction (nothing
    about a pipeline is touched here).

    Args:
        reference: the reference image's index in the adapter's image list (``ip_adapter_image=[[img0, img1, ...]]``),
            or, for ``mode="ablate"``, a sequence of indices removed together.
        layers: a regex (``re.search`` on the layer id), a list of them, or ``None`` for every IP-Adapter layer.
        steps: denoising loop indices (an iterable of ints or a ``slice``), a
            :class:`~ipa_probe._checks.Timesteps` (scheduler timesteps: values or bounds) or a predicate
            ``fn(step, timestep) -> bool``; ``None`` for every step.
        mode: one of :data:`MODES` (``"swap"``: base IP-Adapters only; ``"scale"``: :func:`~.custom.scale_hooks`).
        other: the image swapped in (a PIL image, an ``(H, W, C)`` array or a ``(C, H, W)`` tensor, as the pipeline's
            ``ip_adapter_image`` takes); required for ``"swap"``, refused for ``"ablate"``.
        adapter: which loaded IP-Adapter (0 for the first).
        factor: for ``mode="scale"``, a number ``>= 0`` for every chosen reference or one per reference (in the
            order of ``reference``); refused for the other modes.
    """

    reference: int | Sequence[int]
    layers: LayerSelection = None
    steps: Any = None
    mode: str = "ablate"
    other: Any = None
    adapter: int = 0
    factor: float | Sequence[float] | None = None

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f'mode: expected "ablate", "swap" or "scale", got {self.mode!r}')
        single = isinstance(self.reference, int) and not isinstance(self.reference, bool)
        references = (self.reference,) if single else self.reference
        if isinstance(references, bool | str | bytes) or not isinstance(references, Iterable):
            raise TypeError(f"reference: expected an image index (int >= 0) or a list of them, got {self.reference!r}")
        references = tuple(references)
        if not references or not all(_is_index(r) for r in references) or len(set(references)) != len(references):
            raise ValueError(
                f"reference: expected an image index (int >= 0) or a list of distinct ones, got {self.reference!r}"
            )
        if self.mode == "swap" and len(references) != 1:
            raise ValueError(f'mode="swap" replaces one reference; got reference={self.reference!r}: pass one index')
        object.__setattr__(self, "reference", references[0] if single else references)
        if self.mode == "swap" and self.other is None:
            raise ValueError('mode="swap" needs other=: the image whose tokens replace the reference\'s')
        if self.mode == "swap" and not _is_image(self.other):
            raise TypeError(
                "other: expected the image swapped in: a PIL image, an (H, W, C) array or a (C, H, W) tensor, got "
                f"{describe_value(self.other)}"
            )
        if self.mode == "ablate" and self.other is not None:
            raise ValueError('other= is the image swapped in with mode="swap"; mode="ablate" takes none: drop other=')
        if not _is_index(self.adapter):
            raise ValueError(f"adapter: expected the index (int >= 0) of a loaded IP-Adapter, got {self.adapter!r}")
        self._check_factor(references)
        compile_selection(self.layers)  # a bad regex fails here, before anything is attached
        object.__setattr__(self, "steps", parse_step_selection(self.steps))

    def _check_factor(self, references: tuple[int, ...]) -> None:
        if self.mode != "scale":
            if self.factor is not None:
                raise ValueError(f'factor= is the weight multiplier of mode="scale"; mode="{self.mode}" takes none')
            return
        if self.factor is None:
            raise ValueError('mode="scale" needs factor=: a number >= 0 (0 ablates, 1 changes nothing, 2 doubles)')
        factors = [self.factor] * len(references) if _is_number(self.factor) else self.factor
        if isinstance(factors, str | bytes) or not isinstance(factors, Iterable):
            raise TypeError(f"factor: expected a number >= 0 or one per reference, got {self.factor!r}")
        factors = tuple(factors)
        if len(factors) != len(references) or not all(_is_number(f) and 0 <= f < math.inf for f in factors):
            raise ValueError(
                f"factor: expected a finite number >= 0 or {len(references)} of them (one per reference), "
                f"got {self.factor!r}"
            )
        object.__setattr__(self, "factor", factors[0] if _is_number(self.factor) else factors)

    @property
    def factors(self) -> tuple[float, ...]:
        """``mode="scale"``: the factor of each of :attr:`references` (in that sorted order)."""
        if self.factor is None:
            return ()
        given = (self.reference,) if isinstance(self.reference, int) else tuple(self.reference)
        values = (self.factor,) * len(given) if _is_number(self.factor) else tuple(self.factor)
        by_reference = dict(zip(given, values, strict=True))
        return tuple(float(by_reference[r]) for r in self.references)

    @property
    def references(self) -> tuple[int, ...]:
        """The intervened reference indices, sorted."""
        return tuple(sorted((self.reference,) if isinstance(self.reference, int) else self.reference))

    def acts_at(self, step: int, timestep: Any = None) -> bool:
        """Whether the intervention acts at denoising loop index ``step`` (scheduler ``timestep``)."""
        return step_selected(self.steps, step, timestep)

    def describe(self) -> dict[str, Any]:
        """JSON-friendly settings."""
        layers = self.layers
        steps = self.steps
        return {
            "reference": list(self.references) if not isinstance(self.reference, int) else self.reference,
            "layers": layers if isinstance(layers, str | None) else [getattr(p, "pattern", p) for p in layers],
            "steps": sorted(steps) if isinstance(steps, frozenset) else steps if steps is None else repr(steps),
            "mode": self.mode,
            "other": None if self.other is None else type(self.other).__name__,
            "adapter": self.adapter,
            "factor": list(self.factor) if isinstance(self.factor, tuple) else self.factor,
        }


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _is_index(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _is_image(value: Any) -> bool:
    """A PIL image, or an array or tensor with three dimensions (what the pipeline's ``ip_adapter_image`` takes)."""
    from PIL import Image

    return isinstance(value, Image.Image) or (getattr(value, "ndim", None) == 3 and hasattr(value, "shape"))
