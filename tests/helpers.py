"""Helpers shared by the test modules (pytest puts this folder on sys.path)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from diffusers import FluxPipeline
from diffusers.image_processor import IPAdapterMaskProcessor
from PIL import Image
from torch.utils._python_dispatch import TorchDispatchMode

from ipa_probe.sweep import RowDefaults, SweepRunner

#: (kind, IP-Adapter variant, adapters, guidance scale, masks): the pipeline settings parity tests run over.
PIPELINE_CASES = [
    ("sd15", "base", 1, 5.0, False),
    ("sd15", "base", 1, 1.0, False),
    ("sd15", "base", 2, 5.0, False),
    ("sd15", "plus", 1, 5.0, False),
    ("sd15", "base", 1, 5.0, True),
    ("sdxl", "base", 1, 5.0, False),
    ("sdxl", "base", 2, 1.0, False),
    ("sdxl", "plus", 1, 5.0, True),
]


class CountScalarReads(TorchDispatchMode):
    """Counts device-to-host scalar reads (``.item()``, ``bool(tensor)``), the syncs that stall a GPU."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.count += 1
        return func(*args, **(kwargs or {}))


def masks_for(n_images: int, size: int = 64) -> list[torch.Tensor]:
    """One adapter's ``ip_adapter_masks`` entry: image ``i`` on the left or right half, alternating."""
    half = size // 2
    masks = [Image.new("L", (size, size), 0) for _ in range(n_images)]
    for i, mask in enumerate(masks):
        mask.paste(255, (half * (i % 2), 0, half * (i % 2) + half, size))
    return [IPAdapterMaskProcessor().preprocess(masks, height=size, width=size).reshape(1, n_images, size, size)]


def case_call(case: tuple, n_refs: int) -> tuple:
    """A :data:`PIPELINE_CASES` row as ``(pipe, kwargs)``: the tiny pipeline and the call's guidance and masks."""
    from ipa_probe.tiny.sd import tiny_pipeline

    kind, variant, adapters, guidance, masks = case
    kwargs = {"guidance_scale": guidance}
    if masks:
        kwargs["cross_attention_kwargs"] = {"ip_adapter_masks": masks_for(n_refs) * adapters}
    return tiny_pipeline(kind, ip_adapter=variant, num_adapters=adapters), kwargs


def generate_dit(pipe, refs, adapters=1, cfg=False, steps=2, **kwargs):
    """A tiny Flux or SD3 pipeline call, 2 steps, latents out. Flux: one entry of ``refs`` per adapter, true CFG on
    request; SD3: one image."""
    kwargs.setdefault("num_inference_steps", steps)
    kwargs.setdefault("output_type", "latent")
    kwargs.setdefault("max_sequence_length", 16)
    kwargs.setdefault("generator", torch.Generator().manual_seed(0))
    prompt = "a photo of a flower"
    if isinstance(pipe, FluxPipeline):
        if cfg:
            kwargs.update(negative_prompt="blurry", true_cfg_scale=4.0)
        return pipe(prompt, ip_adapter_image=[refs] * adapters, **kwargs).images
    kwargs.setdefault("guidance_scale", 5.0 if cfg else 1.0)
    return pipe(prompt, ip_adapter_image=refs[0], **kwargs).images


#: denoising steps of the sweep tests' rows
SWEEP_STEPS = 2


def write_jsonl(path: Path, rows: list) -> Path:
    """A JSON Lines manifest: dicts as JSON objects, strings as raw lines."""
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return path


def runner_for(pipe, cls: type[SweepRunner] = SweepRunner, seed: int = 0, **kwargs) -> SweepRunner:
    """A sweep runner of the tests' settings: 2 steps, 64 x 64."""
    defaults = RowDefaults(steps=SWEEP_STEPS, seed=seed)
    return cls(pipe, defaults, call_kwargs={"height": 64, "width": 64}, settings={"model": "tiny"}, **kwargs)


class Counting(SweepRunner):
    """Test double: records which rows it ran."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.ran: list[int] = []

    def run_row(self, row):
        self.ran.append(row.row)
        return super().run_row(row)


#: a tiny open_clip model config (random weights) for the CLIP-I scores of compare
TINY_CLIP = {
    "model_cfg": {
        "embed_dim": 16,
        "vision_cfg": {"image_size": 32, "layers": 1, "width": 32, "head_width": 16, "patch_size": 8},
        "text_cfg": {"context_length": 8, "vocab_size": 64, "width": 16, "heads": 2, "layers": 1},
    },
    "preprocess_cfg": {"mean": [0.5, 0.5, 0.5], "std": [0.25, 0.25, 0.25]},
}


def write_tiny_clip(folder: Path) -> str:
    """Write :data:`TINY_CLIP` into ``folder`` (created) and return its open_clip ``local-dir:`` name."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "open_clip_config.json").write_text(json.dumps(TINY_CLIP))
    return f"local-dir:{folder}"


# --------------------------------------------------------------------------- float32 rank near-ties

#: Two distinct keys whose logits in a row lie closer than this (relative to the row's largest |logit|) are a near-tie:
#: ~100 float32 ulps, far above the rounding of a float32 dot product in any summation order (sqrt(D) ulps for
#: D <= 256), so keys farther apart have the same order on every CPU and thread count, and keys this close may not.
NEAR_TIE = 1e-5


def near_ties(logits: torch.Tensor, keys: torch.Tensor, tol: float = NEAR_TIE) -> tuple[torch.Tensor, torch.Tensor]:
    """Which rows have a rank order that float32 rounding may decide, from a float64 recomputation.

    Copies of one token (keys equal up to 1e-6 of the largest key norm, e.g. the unconditional tokens of several
    reference images) are one key: they tie in exact arithmetic and the probe ranks them as one.

    Args:
        logits: float64 attention logits, shape ``(..., R, K)``.
        keys: the keys they were computed from, shape ``(..., K, D)``.
        tol: the near-tie tolerance, relative to each row's largest ``|logit|``.

    Returns:
        ``(any_tie, top_tie)``, bool, shape ``(..., R)``: the row has two distinct keys within ``tol`` of each other
        (its Spearman rho may differ from the exact one); its two largest distinct keys are within ``tol`` (its
        arg-max may differ).
    """
    copies = torch.cdist(keys, keys) <= 1e-6 * keys.norm(dim=-1).amax(-1)[..., None, None]  # (..., K, K)
    first = copies.to(torch.uint8).argmax(-1)  # (..., K) index of each key's first copy
    distinct = first == torch.arange(keys.shape[-2])  # (..., K): one key per token
    ordered = logits.masked_fill(~distinct.unsqueeze(-2), -math.inf).sort(-1, descending=True).values  # (..., R, K)
    gaps = ordered[..., :-1] - ordered[..., 1:]  # (..., R, K - 1): inf or NaN where a left-out copy takes part
    close = gaps <= tol * logits.abs().amax(-1, keepdim=True)  # False for inf and NaN
    return close.any(-1), close[..., 0]


class CaptureQK:
    """Record, per IP-Adapter layer and denoiser pass, the image branch's query and keys (adapter 0) with our own
    forward hooks: ``captured[layer] = {"q": [(B, Q, H*D), ...], "k": [(B, K, H*D), ...]}``, one entry per pass.

    ``key_hook`` (optional) is registered on ``to_k_ip[0]`` before the recording hook, so it may change the keys the
    processor uses and the recorded keys are the changed ones. With ``ip_adapter_masks`` the processor calls
    ``to_k_ip[0]`` once per reference image, so ``"k"`` holds that many entries per pass. ``text=True`` also records
    the text keys (``attn.to_k``) under ``"t"``. All hooks are removed on exit.
    """

    def __init__(self, pipe, key_hook=None, text: bool = False) -> None:
        from ipa_probe.layers import find_ip_layers

        self.layers = find_ip_layers(pipe)
        self.key_hook = key_hook
        self.text = text
        self.captured: dict[str, dict[str, list[torch.Tensor]]] = {}
        self._handles: list = []

    def __enter__(self) -> CaptureQK:
        for layer in self.layers:
            record = self.captured.setdefault(layer.name, {"q": [], "k": [], "t": []})
            to_k = layer.attention.processor.to_k_ip[0]
            if self.key_hook is not None:
                self._handles.append(to_k.register_forward_hook(self.key_hook))
            modules = [(layer.attention.to_q, "q"), (to_k, "k")] + [(layer.attention.to_k, "t")] * self.text
            for module, key in modules:
                hook = lambda m, a, o, r=record[key]: r.append(o.detach().clone())
                self._handles.append(module.register_forward_hook(hook))
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()

    def ties(self, layer: str, step: int, heads: int) -> tuple[torch.Tensor, torch.Tensor]:
        """:func:`near_ties` of one layer and pass in float64: ``(any_tie, top_tie)``, each ``(B, H, Q)``."""
        q, k = self.captured[layer]["q"][step].double(), self.captured[layer]["k"][step].double()
        batch, d = q.shape[0], q.shape[-1] // heads
        q = q.reshape(batch, -1, heads, d).transpose(1, 2)  # (B, H, Q, D)
        k = k.reshape(batch, -1, heads, d).transpose(1, 2)  # (B, H, K, D)
        return near_ties(q @ k.transpose(-1, -2) / math.sqrt(d), k)


def pinned_threads(threads: int):
    """Run at ``threads`` torch threads until the generator resumes, then restore the caller's (a fixture body)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    yield
    torch.set_num_threads(before)


def sign_flip_p(values, centre: float = 0.0) -> float:
    """The exact one-sided sign-flip p of "centre <= ``centre``" (up to 16 values): the share of all ``2**n`` sign
    patterns of the centred values whose mean reaches the observed mean (1e-12: a tie up to rounding)."""
    import itertools

    import numpy as np

    x = np.asarray(values, dtype=np.float64) - centre
    flips = np.array(list(itertools.product([1.0, -1.0], repeat=len(x))))
    return float(np.mean((flips * x).mean(1) >= x.mean() - 1e-12))


def inverted_bound(values, level: float) -> float:
    """The lower confidence bound of the test above at ``level``: the smallest centre whose :func:`sign_flip_p` is at
    least ``level``, by bisection over the centres where that p can change (the means of the values' non-empty
    subsets: a pattern's flipped mean crosses the observed one there), the p rising with the centre."""
    import itertools

    import numpy as np

    x = np.asarray(values, dtype=np.float64)
    subsets = itertools.chain.from_iterable(itertools.combinations(x, k) for k in range(1, len(x) + 1))
    candidates = np.unique([np.mean(s) for s in subsets])
    if sign_flip_p(x, candidates[0]) >= level:
        return -math.inf if sign_flip_p(x, candidates[0] - 1.0) >= level else float(candidates[0])
    low, high = 0, len(candidates) - 1  # p(candidates[low]) < level <= p(candidates[high])
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (low, mid) if sign_flip_p(x, candidates[mid]) >= level else (mid, high)
    return float(candidates[high])
