"""Which CFG branch each batch item of a denoiser pass belongs to, decided from evidence, never assumed.

A pipeline encodes its prompts before the loop; the probe keeps what ``encode_prompt`` returned (the prompt's and the
negative prompt's embeddings) and, at every denoiser pass, compares each contiguous chunk of the
``encoder_hidden_states`` the denoiser receives with them, on the device (no host synchronisation):

- a chunk equal to the prompt embeddings is ``"cond"``, one equal to the negative prompt embeddings ``"uncond"``;
- with perturbed-attention guidance active (diffusers' PAG pipelines), the last chunk repeats the prompt and is
  ``"perturbed"``;
- InstructPix2Pix orders its batch ``[prompt, negative, negative]`` (the middle chunk sees the image, the last one
  neither image nor text): the middle chunk is ``"uncond_text"``, the last ``"uncond"``;
- a chunk matching neither (or both: a negative prompt equal to the prompt) is ``"batch"``, and so is a whole pass
  when no prompt embeddings were seen (a hand-written loop calling ``pipe.unet``, or a ``from_pipe`` sibling
  running another prompt) or its batch does not divide into chunks of the prompt's size.

``probe(pipe, branches=("uncond", "cond"))`` declares the layout instead: every pass is cut into that many equal
chunks, labelled in that order.

Because each pass is matched on its own, a pipeline whose CFG is switched off mid-run (a ``callback_on_step_end``
setting ``pipe._guidance_scale = 0`` and keeping only the conditional embeddings) gets ``"cond"`` rows from then on.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..schema import BRANCH_LABELS

__all__ = ["Layout", "PromptEvidence", "label_vocabulary"]

#: Pipeline methods whose results are the prompt embeddings (``_encode_prompt``: InstructPix2Pix, which has no
#: ``encode_prompt`` and returns its batch already concatenated).
_ENCODERS = ("encode_prompt", "_encode_prompt")


def label_vocabulary(declared: tuple[str, ...] | None) -> tuple[str, ...]:
    """The branch labels a run can give, in buffer order: :data:`~ipa_probe.schema.BRANCH_LABELS`, then any
    user-declared label not among them."""
    extra = tuple(dict.fromkeys(b for b in declared or () if b not in BRANCH_LABELS))
    return (*BRANCH_LABELS, *extra)


@dataclass
class Layout:
    """How the batch of one denoiser pass splits into branches.

    Attributes:
        chunks: how many equal, contiguous chunks the batch holds (host integer: it only depends on shapes).
        labels: ``(chunks,)`` int64 on the device: each chunk's index into the run's label vocabulary.
        items: ``(B,)`` int64 on the device: each batch item's label (its chunk's); statistics are computed per
            item and averaged over the items of a label.
        is_cond: per chunk, a 0-d bool on the device: the chunk holds the prompt's embeddings (or ``None`` when
            no evidence was compared); used to pick each chunk's text-token mask.
        is_uncond: the same for the negative prompt's embeddings.
    """

    chunks: int
    labels: torch.Tensor
    items: torch.Tensor
    is_cond: list[torch.Tensor] | None = None
    is_uncond: list[torch.Tensor] | None = None


class PromptEvidence:
    """Keeps the prompt embeddings a pipeline computed and turns them into each pass's :class:`Layout`.

    It wraps the pipeline's own ``encode_prompt`` (or InstructPix2Pix's ``_encode_prompt``) on the instance while the
    probe runs (the class is untouched; :meth:`remove` restores the instance exactly).

    Args:
        pipe: the pipeline.
        vocabulary: the run's labels (:func:`label_vocabulary`).
        declared: the layout the user declared (``probe(..., branches=...)``), or ``None``.
        on_encode: called before each prompt encoding (the UNet tap restarts its text-token masks there).
    """

    def __init__(
        self,
        pipe,
        vocabulary: tuple[str, ...],
        declared: tuple[str, ...] | None = None,
        on_encode: Callable[[], None] | None = None,
    ) -> None:
        self.pipe = pipe
        self.vocabulary = vocabulary
        self.declared = declared
        self.on_encode = on_encode
        self.cond: torch.Tensor | None = None
        self.uncond: torch.Tensor | None = None
        self.instruct_pix2pix = False
        self._fresh = True  # the next encoding starts a new pipeline call's evidence
        self._wrapped: list[tuple[str, bool, Any]] = []
        self._index: dict[torch.device, torch.Tensor] = {}
        self._declared_labels: dict[torch.device, torch.Tensor] = {}

    # ------------------------------------------------------------------ lifecycle
    def install(self) -> None:
        for name in _ENCODERS:
            original = getattr(self.pipe, name, None)
            if callable(original) and not (name == "_encode_prompt" and hasattr(self.pipe, "encode_prompt")):
                self._wrapped.append((name, name in vars(self.pipe), vars(self.pipe).get(name)))
                setattr(self.pipe, name, self._wrap(name, original))

    def remove(self) -> None:
        for name, had_own, own in reversed(self._wrapped):
            if had_own:
                setattr(self.pipe, name, own)
            else:
                vars(self.pipe).pop(name, None)
        self._wrapped.clear()
        self.cond = self.uncond = None
        self._index.clear()
        self._declared_labels.clear()

    def pass_seen(self) -> None:
        """A denoiser pass ran: the next prompt encoding belongs to a new pipeline call."""
        self._fresh = True

    def _wrap(self, name: str, original: Callable) -> Callable:
        signature = inspect.signature(original)

        def encode(*args, **kwargs):
            if self._fresh:
                self.cond = self.uncond = None
                self.instruct_pix2pix = False
                self._fresh = False
                if self.on_encode is not None:
                    self.on_encode()
            result = original(*args, **kwargs)
            self._keep(name, result, signature, args, kwargs)
            return result

        encode.__wrapped__ = original
        return encode

    def _keep(self, name: str, result: Any, signature: inspect.Signature, args: tuple, kwargs: dict) -> None:
        if isinstance(result, torch.Tensor) and name == "_encode_prompt":
            # InstructPix2Pix: [prompt, negative, negative] with CFG, the prompt alone without
            try:
                cfg = signature.bind(*args, **kwargs).arguments.get("do_classifier_free_guidance", False)
            except TypeError:
                return
            n = result.shape[0] // 3 if cfg else result.shape[0]
            self.cond, self.uncond = result[:n], (result[n : 2 * n] if cfg else None)
            self.instruct_pix2pix = bool(cfg)
            return
        if not isinstance(result, tuple | list) or not result or not isinstance(result[0], torch.Tensor):
            return
        first = result[0]
        second = result[1] if len(result) > 1 else None
        if isinstance(second, torch.Tensor) and second.shape == first.shape:
            # SD, SDXL, SD3, PAG: (prompt, negative, ...)
            self.cond, self.uncond = first, second
        elif second is None:
            # (prompt, None, ...): no negative prompt was asked for
            self.cond = first
        elif self.cond is None:
            self.cond = first  # Flux: one prompt per call, the prompt first ...
        else:
            self.uncond = first  # ... then the negative prompt (true CFG)

    # ------------------------------------------------------------------ per pass
    def _constants(self, device: torch.device) -> torch.Tensor:
        """The label indices ``0..len(vocabulary)-1`` on ``device``, made once per run (no host-to-device copy)."""
        if device not in self._index:
            self._index[device] = torch.arange(len(self.vocabulary), device=device)
        return self._index[device]

    def layout(self, context: torch.Tensor | None, device: torch.device) -> Layout:
        """The :class:`Layout` of a pass whose ``encoder_hidden_states`` is ``context`` (``(B, T, C)``)."""
        index = self._constants(device)
        size = context.shape[0] if isinstance(context, torch.Tensor) else 1
        batch = self.vocabulary.index("batch")
        unlabelled = Layout(1, index[batch : batch + 1], index[batch : batch + 1].expand(size))
        if self.declared is not None:
            chunks = len(self.declared)
            if size % chunks:
                return unlabelled
            if device not in self._declared_labels:
                picked = [index[self.vocabulary.index(b)] for b in self.declared]
                self._declared_labels[device] = torch.stack(picked)
            labels = self._declared_labels[device]
            return Layout(chunks, labels, labels.repeat_interleave(size // chunks))
        cond = self.cond
        if not isinstance(context, torch.Tensor) or cond is None or context.shape[1:] != cond.shape[1:]:
            return unlabelled
        n = cond.shape[0]
        if n == 0 or size % n:
            return unlabelled
        chunks = context.shape[0] // n
        uncond = self.uncond if self.uncond is not None and self.uncond.shape == cond.shape else None
        pag = bool(getattr(self.pipe, "do_perturbed_attention_guidance", False))
        labels, is_cond, is_uncond = [], [], []
        for c in range(chunks):
            part = context[c * n : (c + 1) * n]
            match_cond = (part == cond.to(part.device)).all()
            match_uncond = (
                (part == uncond.to(part.device)).all() if uncond is not None else torch.zeros_like(match_cond)
            )
            cond_label = "perturbed" if pag and chunks > 1 and c == chunks - 1 else "cond"
            uncond_label = "uncond_text" if self.instruct_pix2pix and chunks == 3 and c == 1 else "uncond"
            only_cond, only_uncond = match_cond & ~match_uncond, match_uncond & ~match_cond
            label = torch.where(
                only_cond,
                index[self.vocabulary.index(cond_label)],
                torch.where(only_uncond, index[self.vocabulary.index(uncond_label)], index[batch]),
            )
            labels.append(label)
            is_cond.append(only_cond)
            is_uncond.append(only_uncond)
        labels = torch.stack(labels)
        return Layout(chunks, labels, labels.repeat_interleave(n), is_cond, is_uncond)
