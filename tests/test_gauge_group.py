"""The whole q/k gauge group (ipa_probe.gauge): per-head basis changes, row shifts, random and adversarial generators,
on the trained ``ip-adapter`` organism, tiny SD 1.5 and SDXL, and the per-channel subgroup on Flux and SD3.

What must hold under every element: the outputs are equal (to float rounding), the weights come back bit for bit
(also after an exception, biases created for a row shift removed again), every attention weight and the query-frame
rho are unchanged (both recomputed here in float64 from the test's own forward hooks, with numpy and scipy), and the
probe's stored-frame rho (its ``spearman`` column) moves, so that the test could fail.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
import torch
from helpers import generate_dit
from scipy import special, stats

from ipa_probe.gauge import (
    AdversarialGauge,
    GaugeConfig,
    RandomGauge,
    RowShift,
    adversarial_gauge,
    gauge_sweep,
    qk_gauge,
)
from ipa_probe.layers import find_ip_layers, list_hooks
from ipa_probe.tiny.digits import digits_pipeline, digits_reference_images
from ipa_probe.tiny.sd import tiny_pipeline

#: Attention-only columns of the probe's summary: made from the attention weights alone, so no gauge may move them.
ATTENTION_ONLY = ("neff_attn",)

#: Attention weights and the query-frame rho: the issue's bound.
INVARIANT_ATOL = 1e-5


# --------------------------------------------------------------------------- the test's own hooks and statistics


def _state(pipe) -> dict[str, tuple]:
    """Every parameter and buffer of the denoiser: values (cloned), dtype, device; the names say which biases exist."""
    denoiser = pipe.unet if hasattr(pipe, "unet") else pipe.transformer
    tensors = {**dict(denoiser.named_parameters()), **dict(denoiser.named_buffers())}
    return {name: (t.detach().clone(), t.dtype, t.device) for name, t in tensors.items()}


def _same_state(pipe, before) -> bool:
    after = _state(pipe)
    return after.keys() == before.keys() and all(
        torch.equal(after[n][0], before[n][0]) and after[n][1:] == before[n][1:] for n in before
    )


class QKRecorder:
    """Forward hooks on the tensors each family's image branch multiplies: per layer and pass the queries
    ``(B, H, Q, d)`` and image keys ``(B, H, K, d)`` of adapter 0, in float64."""

    def __init__(self, pipe) -> None:
        self.layers = find_ip_layers(pipe)
        self.passes: dict[str, list[dict]] = {layer.name: [] for layer in self.layers}
        self.handles = []
        for layer in self.layers:
            store, heads = self.passes[layer.name], layer.heads
            k_ip = layer.processor.to_k_ip[0] if layer.family != "sd3" else None
            norm_ip_k = getattr(layer.processor, "norm_ip_k", None)
            if layer.family == "unet":  # to_q (B, Q, H*d); to_k_ip (B, [R,] T, H*d)
                (q_module, q_layout), (k_module, k_layout) = (layer.attention.to_q, "flat"), (k_ip, "flat")
            elif layer.family == "flux":  # norm_q (B, Q, H, d), before RoPE; to_k_ip (B, T, H*d)
                (q_module, q_layout), (k_module, k_layout) = (layer.attention.norm_q, "bshd"), (k_ip, "flat")
            else:  # SD3: the processor's norm_q (B, H, Q, d) and norm_ip_k (B, H, T, d)
                (q_module, q_layout), (k_module, k_layout) = (layer.processor.norm_q, "bhsd"), (norm_ip_k, "bhsd")
            self.handles.append(q_module.register_forward_hook(self._query(store, heads, q_layout)))
            self.handles.append(k_module.register_forward_hook(self._keys(store, heads, k_layout)))

    @staticmethod
    def _as_heads(out: torch.Tensor, heads: int, layout: str) -> np.ndarray:
        """Any of the three layouts -> ``(B, H, N, d)`` float64."""
        x = out.detach().double()
        if layout == "bhsd":
            return x.numpy().copy()
        d = x.shape[-1] // heads if layout == "flat" else x.shape[-1]
        x = x.reshape(x.shape[0], -1, heads, d)  # (B, N, H, d), references x tokens folded into N
        return x.transpose(1, 2).numpy().copy()

    def _query(self, store, heads, layout):
        return lambda module, args, out: store.append({"q": self._as_heads(out, heads, layout)})

    def _keys(self, store, heads, layout):
        def hook(module, args, out):
            if store and "k" not in store[-1]:
                store[-1]["k"] = self._as_heads(out, heads, layout)

        return hook

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()

    def logits(self, items: slice) -> list[np.ndarray]:
        """Per layer and pass the image-branch logits ``q·k / sqrt(d)``, ``(items, H, Q, K)``."""
        out = []
        for layer in self.layers:
            for record in self.passes[layer.name]:
                if "k" not in record:
                    continue
                q, k = record["q"][items], record["k"][items]
                out.append(q @ k.swapaxes(-1, -2) / math.sqrt(q.shape[-1]))
        return out


def _record(pipe, call) -> QKRecorder:
    recorder = QKRecorder(pipe)
    try:
        call()
    finally:
        recorder.remove()
    return recorder


def query_frame_rho(logits: list[np.ndarray]) -> float:
    """Mean per-row Spearman between attention and query-frame Gaussian NW (exact form), in float64 with scipy:
    ``L`` row-centred, ``b_i = log mean_q exp(L_qi)`` over the layer's query positions of one item and head,
    ``w_NW(i|q) ∝ exp(L_qi - b_i)``; rows whose NW or attention ranks are constant are left out."""
    rhos = []
    for block in logits:  # (items, H, Q, K)
        centred = block - block.mean(-1, keepdims=True)
        b = special.logsumexp(centred, axis=-2, keepdims=True) - math.log(block.shape[-2])  # (items, H, 1, K)
        attention = stats.rankdata(centred, axis=-1).reshape(-1, block.shape[-1])
        nw = stats.rankdata(centred - b, axis=-1).reshape(-1, block.shape[-1])
        keep = (attention.std(-1) > 0) & (nw.std(-1) > 0)
        a, n = attention[keep], nw[keep]
        a = (a - a.mean(-1, keepdims=True)) / a.std(-1, keepdims=True)
        n = (n - n.mean(-1, keepdims=True)) / n.std(-1, keepdims=True)
        rhos.append((a * n).mean(-1))
    return float(np.concatenate(rhos).mean())


def _attention(logits: list[np.ndarray]) -> np.ndarray:
    return np.concatenate([special.softmax(block, axis=-1).ravel() for block in logits])


# --------------------------------------------------------------------------- the checks every pipeline gets


def _check_group(pipe, call, gauges: dict, items: slice, tolerance: float, moved: float) -> pd.DataFrame:
    """Sweep ``gauges`` (name -> spec; the first is the identity) and record each with the test's hooks."""
    before = _state(pipe)
    table = gauge_sweep(pipe, call, list(gauges.values()), tolerance=tolerance)
    assert _same_state(pipe, before) and list_hooks(pipe) == []
    reference = _record(pipe, call).logits(items)
    for name, spec in gauges.items():
        with qk_gauge(pipe, spec):
            assert not _same_state(pipe, before) or name == "identity"
            gauged = _record(pipe, call).logits(items)
        assert _same_state(pipe, before) and list_hooks(pipe) == []
        np.testing.assert_allclose(_attention(gauged), _attention(reference), atol=INVARIANT_ATOL, err_msg=name)
        assert abs(query_frame_rho(gauged) - query_frame_rho(reference)) <= INVARIANT_ATOL, name
    image = table[table["kind"] == "image"]
    labels = list(dict.fromkeys(image["gauge"]))
    assert len(labels) == len(gauges)
    assert (table["output_max_abs_diff"] <= tolerance).all()
    by_gauge = {label: image[image["gauge"] == label].sort_values(["step", "branch"]) for label in labels}
    first = by_gauge[labels[0]]
    qf_columns = [c for c in table.columns if c.startswith("qf_")]  # the probe's query-frame columns, once merged
    ref_mass = [c for c in table.columns if c.startswith("ref_mass_")]
    for label in labels[1:]:
        rows = by_gauge[label]
        for column in (*ATTENTION_ONLY, *ref_mass, *qf_columns):
            # the 1e-5, relative as well for n_eff (~8 on the organism): float32 sums of weights that agree
            # to rounding differ by ~1e-6 relative (measured up to 8.7e-6 absolute at n_eff 7.9)
            np.testing.assert_allclose(
                rows[column], first[column], atol=INVARIANT_ATOL, rtol=INVARIANT_ATOL, err_msg=f"{label} {column}"
            )
        shift = float(np.abs(rows["spearman"].to_numpy() - first["spearman"].to_numpy()).mean())
        assert shift > moved, (label, shift)  # the stored-frame rho is no invariant of the group
    return table


# --------------------------------------------------------------------------- UNet: the organism, SD 1.5, SDXL


@pytest.fixture(scope="module")
def ip_organism():
    pipe = digits_pipeline(recipe="ip-adapter")
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _unet_call(pipe, refs, prompt, steps, guidance):
    def call():
        generator = torch.Generator().manual_seed(0)
        return pipe(
            prompt,
            ip_adapter_image=[refs],
            num_inference_steps=steps,
            guidance_scale=guidance,
            generator=generator,
            output_type="np",
        )

    return call


def _unet_gauges(pipe, call) -> dict:
    return {
        "identity": 1.0,
        "random": RandomGauge(seed=0, spread=1.0),
        "adversarial down": adversarial_gauge(pipe, call, AdversarialGauge("down", max_cond=10.0, iterations=60)),
        "adversarial up": adversarial_gauge(pipe, call, AdversarialGauge("up", max_cond=10.0, iterations=60)),
        "shift": RowShift(seed=0, scale=1.0),
    }


def test_on_the_ip_adapter_organism_the_group_keeps_outputs_and_invariants_and_moves_rho(ip_organism):
    refs = digits_reference_images(3, 3)
    call = _unet_call(ip_organism, refs, "a handwritten digit", steps=3, guidance=3.0)
    gauges = _unet_gauges(ip_organism, call)
    # outputs in [0, 1]: float32 rounding of A W (cond <= ~100) moves logits by ~1e-6 relative, the images by less
    # than 1e-4 over 3 steps; the cond half of the batch (items 8..) has no tied image keys
    table = _check_group(ip_organism, call, gauges, slice(1, 2), tolerance=1e-4, moved=0.05)
    cond = table[(table["kind"] == "image") & (table["branch"] == "cond")]
    rho = cond.groupby("gauge", sort=False)["spearman"].mean().to_numpy()
    assert rho[2] < rho[0] - 0.2 and rho[3] > rho[0] + 0.2  # the search pushes rho the way it was asked
    assert table.groupby("gauge", sort=False)["max_cond"].first().iloc[2:4].le(10.0 + 1e-9).all()


@pytest.mark.parametrize("kind", ["sd15", "sdxl"])
def test_on_tiny_sd15_and_sdxl_the_group_keeps_outputs_and_invariants_and_moves_rho(kind, refs):
    pipe = tiny_pipeline(kind)
    call = _unet_call(pipe, refs, "a photo", steps=2, guidance=5.0)
    gauges = _unet_gauges(pipe, call)
    # CFG doubles the batch: [uncond, cond]; the cond item is index 1
    _check_group(pipe, call, gauges, slice(1, 2), tolerance=1e-4, moved=0.05)


# --------------------------------------------------------------------------- Flux and SD3: the per-channel subgroup


@pytest.mark.parametrize("family", ["flux", "sd3"])
def test_flux_and_sd3_take_the_per_channel_subgroup_and_refuse_basis_changes(family, request, refs):
    pipe = request.getfixturevalue(family)
    call = lambda: generate_dit(pipe, refs, output_type="np")  # noqa: E731
    gauges = {"identity": 1.0, "scalar": 0.5, "random diagonal": RandomGauge(seed=0, spread=1.0)}
    if family == "flux":
        gauges["shift"] = RowShift(seed=0, scale=1.0)
    _check_group(pipe, call, gauges, slice(0, 1), tolerance=1e-4, moved=0.05)
    before = _state(pipe)
    layer = find_ip_layers(pipe)[0]
    d = layer.processor.norm_ip_k.weight.shape[0] if family == "sd3" else layer.attention.norm_q.weight.shape[0]
    rotation = torch.linalg.qr(torch.randn(layer.heads, d, d, dtype=torch.float64))[0]
    with pytest.raises(ValueError, match="only a per-channel scaling shared by all heads survives"):
        with qk_gauge(pipe, GaugeConfig(matrices={layer.name: rotation})):
            pass
    with pytest.raises(ValueError, match="adversarial search changes bases"):
        adversarial_gauge(pipe, call)
    if family == "sd3":
        with pytest.raises(ValueError, match="per-row shift of the image logits is no symmetry"):
            with qk_gauge(pipe, RowShift()):
                pass
    else:
        unpaired = torch.diag(torch.arange(1, d + 1, dtype=torch.float64)).expand(layer.heads, d, d)
        with pytest.raises(ValueError, match="RoPE"):
            with qk_gauge(pipe, GaugeConfig(matrices={layer.name: unpaired})):
                pass
    assert _same_state(pipe, before) and list_hooks(pipe) == []


# --------------------------------------------------------------------------- lifecycle and bounds


def test_every_element_is_restored_bit_for_bit_after_an_exception(sd15):
    before = _state(sd15)
    to_k_ip = find_ip_layers(sd15)[0].processor.to_k_ip[0]
    assert to_k_ip.bias is None
    for spec in (RandomGauge(3, 2.0), RowShift(1, 5.0), "random:1:0.5", 3.0):
        with pytest.raises(KeyboardInterrupt), qk_gauge(sd15, spec):
            assert not _same_state(sd15, before)
            raise KeyboardInterrupt
        assert _same_state(sd15, before) and list_hooks(sd15) == []
    with qk_gauge(sd15, RowShift()):
        assert to_k_ip.bias is not None and to_k_ip.bias.dtype == to_k_ip.weight.dtype
    assert to_k_ip.bias is None and "bias" in to_k_ip._parameters


def test_out_of_range_gauges_are_refused_before_anything_changes(sd15, refs):
    before = _state(sd15)
    layer = find_ip_layers(sd15)[0]
    d = layer.attention.to_q.out_features // layer.heads
    singular = torch.zeros(layer.heads, d, d, dtype=torch.float64)
    ill = torch.diag(torch.logspace(0, 8, d, dtype=torch.float64)).expand(layer.heads, d, d)
    cases = [
        (1e-300, "round nonzero weights"),  # issue 31: silently NaN images before
        (1e300, "gauge: expected a finite number|beyond the range"),
        (-1.0, "gauge: expected a finite number > 0"),
        (GaugeConfig(matrices={layer.name: ill}), r"cond\(A\) = 1e\+08 exceeds"),
        (GaugeConfig(matrices={"no.such.layer": ill}), "not among the selected"),
        ("random:0:9", "SPREAD"),
        ("adversarial:down:10", "needs a pipeline call"),
    ]
    for spec, message in cases:
        with pytest.raises(ValueError, match=message):
            with qk_gauge(sd15, spec):
                pass
        assert _same_state(sd15, before) and list_hooks(sd15) == []
    with pytest.raises(ValueError, match="singular"):
        GaugeConfig(matrices={layer.name: singular})
    with pytest.raises(TypeError, match="matrices"):
        GaugeConfig(matrices=[singular])
    with pytest.raises(TypeError, match="call: .*pipeline's output"):
        gauge_sweep(sd15, lambda: None)
    calls = []
    for gauges in ([1e-300], [2.0, GaugeConfig(matrices={layer.name: ill})]):
        with pytest.raises(ValueError, match="round nonzero|exceeds"):
            gauge_sweep(sd15, lambda: calls.append(1), gauges)
    assert calls == [] and _same_state(sd15, before)  # refused before the first call
    with pytest.raises(TypeError, match="gauge: expected a number"):
        with qk_gauge(sd15, object()):
            pass
    for bad in (dict(direction="sideways"), dict(max_cond=1.0), dict(iterations=0), dict(statistic="pearson")):
        with pytest.raises(ValueError, match=next(iter(bad))):
            AdversarialGauge(**bad)


def test_two_adapters_each_get_the_basis_change_and_the_shift(refs):
    pipe = tiny_pipeline("sd15", num_adapters=2)
    before = _state(pipe)

    def call():
        generator = torch.Generator().manual_seed(0)
        return pipe(
            "a photo", ip_adapter_image=[refs, refs[:1]], num_inference_steps=1, generator=generator, output_type="np"
        )

    reference = call().images
    for spec in (RandomGauge(seed=2, spread=1.0), RowShift(seed=2, scale=1.0)):
        with qk_gauge(pipe, spec) as layers:
            changed = [not torch.equal(k.weight, before[_name(pipe, k)][0]) for k in layers[0].processor.to_k_ip]
            biased = [k.bias is not None for k in layers[0].processor.to_k_ip]
            gauged = call().images
        # one softmax per adapter: a change to either adapter's keys alone would move the output by far more
        assert np.abs(gauged - reference).max() < 1e-4
        assert all(biased) if isinstance(spec, RowShift) else all(changed)
        assert _same_state(pipe, before)


def _name(pipe, module) -> str:
    return next(f"{n}.weight" for n, m in pipe.unet.named_modules() if m is module)
