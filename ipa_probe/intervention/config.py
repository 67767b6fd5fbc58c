"""The settings of an intervention on one reference image's tokens: :class:`InterventionConfig`."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from .._checks import _given, parse_step_selection, step_selected
from ..layers import LayerSelection, _compile_selection

__all__ = ["INTERVENE", "MODES", "InterventionConfig"]

#: The feature's name: its claim on the denoiser (:func:`ipa_probe.list_hooks`) and the key of its state there.
INTERVENE = "intervene"

#: What happens to the chosen reference's image tokens: ``"ablate"`` removes them from the image branch's softmax,
#: ``"swap"`` replaces them by another image's tokens.
MODES: tuple[str, ...] = ("ablate", "swap")


@dataclass(frozen=True)
class InterventionConfig:
    """Which reference image, where and when, and what to do with its tokens. Validated on construction (nothing
    about a pipeline is touched here).

    Args:
        reference: the reference image's index in the adapter's image list (``ip_adapter_image=[[img0, img1, ...]]``),
            or, for ``mode="ablate"``, a sequence of indices removed together.
        layers: a regex (``re.search`` on the layer id), a list of them, or ``None`` for every IP-Adapter layer.
        steps: denoising loop indices (an iterable of ints or a ``slice``); ``None`` for every step.
        mode: ``"ablate"`` (the reference's tokens leave the image branch's softmax: the other references'
            weights are renormalised, as if the reference had not been given to that layer at that step) or
            ``"swap"`` (its tokens are replaced by those of ``other``; base IP-Adapters only).
        other: the image swapped in (a PIL image, an ``(H, W, C)`` array or a ``(C, H, W)`` tensor, as the pipeline's
            ``ip_adapter_image`` takes); required for ``"swap"``, refused for ``"ablate"``.
        adapter: which loaded IP-Adapter (0 for the first).
    """

    reference: int | Sequence[int]
    layers: LayerSelection = None
    steps: Iterable[int] | slice | None = None
    mode: str = "ablate"
    other: Any = None
    adapter: int = 0

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f'mode: expected "ablate" or "swap", got {self.mode!r}')
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
                f"{_given(self.other)}"
            )
        if self.mode == "ablate" and self.other is not None:
            raise ValueError('other= is the image swapped in with mode="swap"; mode="ablate" takes none: drop other=')
        if not _is_index(self.adapter):
            raise ValueError(f"adapter: expected the index (int >= 0) of a loaded IP-Adapter, got {self.adapter!r}")
        _compile_selection(self.layers)  # a bad regex fails here, before anything is attached
        object.__setattr__(self, "steps", parse_step_selection(self.steps))

    @property
    def references(self) -> tuple[int, ...]:
        """The intervened reference indices, sorted."""
        return tuple(sorted((self.reference,) if isinstance(self.reference, int) else self.reference))

    def acts_at(self, step: int) -> bool:
        """Whether the intervention acts at denoising loop index ``step``."""
        return step_selected(self.steps, step)

    def describe(self) -> dict[str, Any]:
        """JSON-friendly settings."""
        layers = self.layers
        steps = self.steps
        return {
            "reference": list(self.references) if not isinstance(self.reference, int) else self.reference,
            "layers": layers if isinstance(layers, str | None) else [getattr(p, "pattern", p) for p in layers],
            "steps": None if steps is None else (repr(steps) if isinstance(steps, slice) else sorted(steps)),
            "mode": self.mode,
            "other": None if self.other is None else type(self.other).__name__,
            "adapter": self.adapter,
        }


def _is_index(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _is_image(value: Any) -> bool:
    """A PIL image, or an array or tensor with three dimensions (what the pipeline's ``ip_adapter_image`` takes)."""
    from PIL import Image

    return isinstance(value, Image.Image) or (getattr(value, "ndim", None) == 3 and hasattr(value, "shape"))
