"""Which CFG branch each batch item of a denoiser pass belongs to, decided from evidence, never assumed.

A pipeline encodes its prompts before the loop; the probe keeps what the encoder returned (the prompt's and the
negative prompt's embeddings) and, at every denoiser pass, compares each contiguous chunk of the
``encoder_hidden_states`` the denoiser receives with them, on the device (no host synchronisation). A chunk equal to
the prompt embeddings is ``"cond"``, one equal to the negative prompt embeddings ``"uncond"``; PAG's last half of the
prompt's chunks are ``"perturbed"``, InstructPix2Pix's first half of the negative ones ``"uncond_text"``, the safety
concept's chunk of ``StableDiffusionPipelineSafe`` ``"safety"``, a guidance pass of its own
(:class:`~.taps.DenoiserPass`) gets its tap's label (``"sag"``), and a chunk matching none or several, or a pass with
no prompt embeddings seen or a batch that does not divide by the prompt's, is ``"batch"``. Each pipeline's layout is
tabled in docs/compatibility.md ("What the labels, steps and calls mean on the long tail"); each pass is matched on its
own, so a CFG switched off mid-run gives ``"cond"`` rows from then on. ``probe(pipe, branches=("uncond", "cond"))``
declares the layout instead: every pass cut into that many equal chunks, in order.

What the encoders return (:data:`ENCODERS`; only the outermost encoding counts, as in AnimateDiff's FreeNoise): the
tuples of :data:`_TUPLE_POSITIONS`; LEdits++'s 5-tuple ``(negative, edit concepts, ...)``; a dict's
``"prompt_embeds"`` and ``"negative_prompt_embeds"``; ``_encode_prompt``'s concatenated batch (InstructPix2Pix
``[prompt, negative, negative]``, Safe ``[negative, prompt(, safety)]``); ``_encode_prompt_free_noise``'s
``([negative; prompt] or prompt, negative or None)`` per frame. They are compared as the denoiser receives them
(Kolors' UNet projects its ChatGLM embeddings inside its own forward).
"""

from __future__ import annotations

import inspect
import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..statistics.schema import BRANCH_LABELS

__all__ = ["Layout", "PromptEvidence", "label_vocabulary"]

#: Pipeline methods whose results are the prompt embeddings, outermost first: AnimateDiff's FreeNoise encodes through
#: ``_encode_prompt_free_noise``, which calls ``encode_prompt`` twice (the prompt, then the negative prompt beside an
#: empty one) and interpolates per frame; InstructPix2Pix and ``StableDiffusionPipelineSafe`` have only
#: ``_encode_prompt``, which returns the batch already concatenated.
ENCODERS: tuple[str, ...] = ("_encode_prompt_free_noise", "encode_prompt", "_encode_prompt")

#: For each ``encode_prompt`` tuple length diffusers uses, the positions of the prompt's and the negative prompt's
#: embeddings (``None``: the tuple holds one prompt, see :meth:`PromptEvidence._keep`).
_TUPLE_POSITIONS: dict[int, tuple[int, int] | None] = {
    2: (0, 1),  # SD 1.5 family, AnimateDiff, PAG, LCM: (prompt, negative)
    3: None,  # Flux: (prompt, pooled, text_ids); the negative prompt is a second encoding
    4: (0, 1),  # SDXL, SD3, Kolors: (prompt, negative, pooled, negative pooled)
    6: (0, 3),  # Chroma: (prompt, text_ids, mask, negative, negative text_ids, negative mask)
}


def label_vocabulary(declared: tuple[str, ...] | None) -> tuple[str, ...]:
    """The branch labels a run can give, in buffer order: :data:`~ipa_probe.statistics.schema.BRANCH_LABELS`, then any
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


def _tensor(value: Any) -> torch.Tensor | None:
    return value if isinstance(value, torch.Tensor) else None


class PromptEvidence:
    """Keeps the prompt embeddings a pipeline computed and turns them into each pass's :class:`Layout`.

    It wraps the pipeline's own encoders (:data:`ENCODERS`) on the instance while the probe runs (the class is
    untouched; :meth:`remove` restores the instance exactly).

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
        #: label -> the embeddings a chunk of that label equals: ``"cond"``, ``"uncond"``, ``"safety"``
        self.known: dict[str, torch.Tensor] = {}
        self.instruct_pix2pix = False
        #: the pipeline whose call is running (a ``from_pipe`` sibling runs with the probed pipeline's denoiser);
        #: read for its PAG setting
        self.running = pipe
        self._fresh = True  # the next encoding starts a new pipeline call's evidence
        self._last: tuple = ()  # (what the last evidence layout read, as objects; its layout): kept across steps
        self._depth = 0  # encoders running now (only the outermost one's result is kept)
        self._wrapped: list[tuple[str, bool, Any]] = []
        self._index: dict[torch.device, torch.Tensor] = {}
        self._declared_labels: dict[torch.device, torch.Tensor] = {}

    @property
    def cond(self) -> torch.Tensor | None:
        """The prompt's embeddings ``(n, T, C)`` of the current call, or ``None``."""
        return self.known.get("cond")

    @property
    def uncond(self) -> torch.Tensor | None:
        """The negative prompt's embeddings of the current call, or ``None``."""
        return self.known.get("uncond")

    # ------------------------------------------------------------------ lifecycle
    def install(self) -> None:
        for name in ENCODERS:
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
        self.known = {}
        self.running = self.pipe
        self._depth = 0
        self._index.clear()
        self._declared_labels.clear()

    def pass_seen(self) -> None:
        """A denoiser pass ran: the next prompt encoding belongs to a new pipeline call."""
        self._fresh = True

    def _wrap(self, name: str, original: Callable) -> Callable:
        signature = inspect.signature(original)

        def encode(*args, **kwargs):
            if self._depth == 0 and self._fresh:
                self.known = {}
                self.instruct_pix2pix = False
                self._fresh = False
                if self.on_encode is not None:
                    self.on_encode()
            self._depth += 1
            try:
                result = original(*args, **kwargs)
            finally:
                self._depth -= 1
            if self._depth == 0:
                self._keep(name, result, signature, args, kwargs)
            return result

        encode.__wrapped__ = original
        return encode

    def _keep(self, name: str, result: Any, signature: inspect.Signature, args: tuple, kwargs: dict) -> None:
        """Read one outermost encoding's result (the table in the module docstring)."""
        if name == "_encode_prompt_free_noise" and isinstance(result, tuple | list) and len(result) == 2:
            embeds, negative = _tensor(result[0]), _tensor(result[1])
            if embeds is not None and negative is not None and embeds.shape[0] == 2 * negative.shape[0]:
                self.known.update(cond=embeds[negative.shape[0] :], uncond=negative)  # [negative; prompt]
            elif embeds is not None:
                self.known["cond"] = embeds
            return
        if isinstance(result, torch.Tensor):
            if name == "_encode_prompt":
                self._keep_concatenated(result, signature, args, kwargs)
            return
        if isinstance(result, dict):
            prompt, negative = _tensor(result.get("prompt_embeds")), _tensor(result.get("negative_prompt_embeds"))
        elif isinstance(result, tuple | list) and len(result) == 5 and isinstance(result[4], int):
            # LEdits++: (negative, edit concepts, negative pooled, edit pooled, edit tokens); no prompt of its own
            prompt, negative = None, _tensor(result[0])
        elif isinstance(result, tuple | list) and len(result) in _TUPLE_POSITIONS:
            positions = _TUPLE_POSITIONS[len(result)]
            if positions is None:  # one prompt per encoding: the prompt first, then the negative prompt
                first = _tensor(result[0])
                prompt, negative = (first, None) if "cond" not in self.known else (None, first)
            else:
                prompt, negative = _tensor(result[positions[0]]), _tensor(result[positions[1]])
        else:
            return
        if prompt is not None:
            self.known["cond"] = prompt
        if negative is not None and (prompt is None or negative.shape == prompt.shape):
            self.known["uncond"] = negative

    def _keep_concatenated(self, result: torch.Tensor, signature: inspect.Signature, args: tuple, kwargs: dict):
        """``_encode_prompt`` returning the batch already concatenated: InstructPix2Pix ``[prompt, negative,
        negative]`` (CFG) or the prompt; ``StableDiffusionPipelineSafe`` ``[negative, prompt, safety]`` (CFG and
        safety guidance), ``[negative, prompt]`` (CFG) or the prompt."""
        try:
            bound = signature.bind(*args, **kwargs).arguments
        except TypeError:
            return
        cfg = bool(bound.get("do_classifier_free_guidance", False))
        if "enable_safety_guidance" in signature.parameters:
            safety = cfg and bool(bound.get("enable_safety_guidance", False))
            parts = result.chunk(3 if safety else 2) if cfg else (result,)
            if cfg:
                self.known.update(uncond=parts[0], cond=parts[1])
                if safety:
                    self.known["safety"] = parts[2]
            else:
                self.known["cond"] = result
            return
        n = result.shape[0] // 3 if cfg else result.shape[0]
        self.known["cond"] = result[:n]
        if cfg:
            self.known["uncond"] = result[n : 2 * n]
        self.instruct_pix2pix = cfg

    # ------------------------------------------------------------------ per pass
    def _constants(self, device: torch.device) -> torch.Tensor:
        """The label indices ``0..len(vocabulary)-1`` on ``device``, made once per run (no host-to-device copy)."""
        if device not in self._index:
            self._index[device] = torch.arange(len(self.vocabulary), device=device)
        return self._index[device]

    def _uniform(self, label: str, size: int, device: torch.device) -> Layout:
        index = self._constants(device)
        at = self.vocabulary.index(label)
        return Layout(1, index[at : at + 1], index[at : at + 1].expand(size))

    def layout(self, context: torch.Tensor | None, device: torch.device, label: str | None = None) -> Layout:
        """The :class:`Layout` of a pass whose ``encoder_hidden_states`` is ``context`` (``(B, T, C)``).

        Args:
            context: the pass's ``encoder_hidden_states``, or ``None``.
            device: where the labels live (the latents' device).
            label: a label for every item of a guidance pass that is not a branch of the loop (``"sag"``), else
                ``None``.
        """
        index = self._constants(device)
        size = context.shape[0] if isinstance(context, torch.Tensor) else 1
        if label is not None:
            return self._uniform(label, size, device)
        unlabelled = self._uniform("batch", size, device)
        if self.declared is not None:
            chunks = len(self.declared)
            if size % chunks and not isinstance(context, torch.Tensor):  # no batch seen: one unlabelled group
                return unlabelled
            if size % chunks:  # merging the chunks into "batch" would hide the mistake in the table
                raise ValueError(
                    f"branches: {len(self.declared)} labels {self.declared!r} do not divide this pass's batch of "
                    f"{size}; declare one label per equal chunk of the batch (e.g. ('uncond', 'cond') under CFG), "
                    "or branches=None to label them from the prompt embeddings"
                )
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
        # the same embeddings, evidence and device as the last pass (a pipeline call's steps): the same layout (the
        # same tensor objects: pipelines pass new tensors, never their embeddings edited in place, from step to step)
        pag = bool(getattr(self.running, "do_perturbed_attention_guidance", False))
        read = (context, *self.known.values()), (device, pag, self.instruct_pix2pix, *self.known)
        if self._last and self._last[0][1] == read[1] and all(map(operator.is_, self._last[0][0], read[0])):
            return self._last[1]
        chunks = size // n
        parts = context.reshape(chunks, n, -1)  # (chunks, n, T * C)
        matches = {}  # label -> (chunks,) bool: the chunk equals that evidence
        for name, embeds in self.known.items():
            if embeds.shape == cond.shape:
                matches[name] = (parts == embeds.to(parts.device).reshape(1, n, -1)).flatten(1).all(-1)
        hits = torch.stack(list(matches.values())).sum(0)  # (chunks,) how many evidences each chunk equals
        only = {name: match & (hits == 1) for name, match in matches.items()}
        labels = index[self.vocabulary.index("batch")].expand(chunks)
        for name, match in only.items():
            labels = torch.where(match, index[self.vocabulary.index(name)], labels)
        if pag:
            labels = self._second_half(labels, only["cond"], index[self.vocabulary.index("perturbed")])
        if self.instruct_pix2pix and "uncond" in only:
            first_half = only["uncond"] & ~self._second_half_mask(only["uncond"])
            labels = torch.where(first_half, index[self.vocabulary.index("uncond_text")], labels)
        is_uncond = only.get("uncond", torch.zeros_like(only["cond"]))
        self._last = read, Layout(chunks, labels, labels.repeat_interleave(n), list(only["cond"]), list(is_uncond))
        return self._last[1]

    @staticmethod
    def _second_half_mask(match: torch.Tensor) -> torch.Tensor:
        """``(chunks,)`` bool: the matching chunks in the last half of those that match (device ops, no sync)."""
        rank = match.long().cumsum(0)  # 1-based rank among the matching chunks
        return match & (2 * rank > match.long().sum())

    def _second_half(self, labels: torch.Tensor, match: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
        return torch.where(self._second_half_mask(match), label, labels)
