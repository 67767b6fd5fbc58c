"""The probe's query-frame columns against a float64 recomputation from the test's own forward hooks.

The reference is written here with numpy and scipy (``scipy.special.logsumexp`` for the key term's exact form,
``scipy.stats.spearmanr`` / ``rankdata`` for the ranks), from the query and keys that ``to_q``, ``to_k_ip`` (and for
the text branch ``to_k``) return to hooks the test registers itself (:class:`helpers.CaptureQK`); it never calls
``query_frame_bias``, ``query_frame_terms`` or ``compare_weights``. The masks it applies (IP-Adapter masks, the
prompt's padding) are rebuilt here from the inputs the test gives the pipeline.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from diffusers.image_processor import IPAdapterMaskProcessor
from helpers import CaptureQK, masks_for, near_ties
from scipy import special, stats
from scipy.spatial import distance
from test_probe_matrix import _null_rho

from ipa_probe.capture.report import query_pool_note
from ipa_probe.capture.run import probe
from ipa_probe.statistics.schema import QUERY_FRAME_COLUMN, QUERY_FRAME_STATS, query_frame_column
from ipa_probe.tiny.sd import tiny_pipeline

FORMS = ("exact", "gaussian")
#: Every query-frame statistic the reference recomputes: all but the permutation null's draw (``spearman_null``, a
#: random shuffle whose reduction is tested for compare_weights itself in tests/test_gauge_stats.py and
#: tests/test_stats.py).
CHECKED = tuple(name for name in QUERY_FRAME_STATS if name != "spearman_null")


# --------------------------------------------------------------------------- the reference, float64


def _moran(r: np.ndarray, k: np.ndarray) -> np.ndarray:
    """Moran (1948): E[rho] of k bivariate-normal pairs of correlation c = r / sqrt(1 + r^2)."""
    with np.errstate(divide="ignore"):
        c = np.sign(r) / np.sqrt(1 + 1 / (r * r))  # r / sqrt(1 + r^2), 1 for r = inf
    return 6 / (np.pi * (k + 1)) * (np.arcsin(c) + (k - 2) * np.arcsin(c / 2))


def _copies_tied(values: np.ndarray, first: np.ndarray) -> np.ndarray:
    """``values`` ``(..., K)`` with each copy of one token (``first``: each key's first copy) set to its first copy's
    value where the two agree to 1e-4 (equal in exact arithmetic: tied ranks), so that copies an edit weighted apart
    rank apart."""
    return np.where(np.abs(values - values[..., first]) <= 1e-4, values[..., first], values)


def _key_term(pool: np.ndarray, keep: np.ndarray, form: str) -> np.ndarray:
    """b over one frame: ``pool`` (rows, K) centred logits of the frame's rows, ``keep`` (rows, K) their kept keys."""
    b = np.zeros(pool.shape[1])
    for i in range(pool.shape[1]):
        column = pool[keep[:, i], i]
        if column.size == 0:
            continue
        if form == "exact":
            b[i] = special.logsumexp(column) - math.log(column.size)
        else:
            b[i] = column.mean() + column.var() / 2  # population variance
    return b


def _centre(logits: np.ndarray, keep: np.ndarray) -> np.ndarray:
    mean = np.array([row[m].mean() for row, m in zip(logits, keep, strict=True)])
    return np.where(keep, logits - mean[:, None], 0.0)


def _item_stats(logits: np.ndarray, keep: np.ndarray, rows: np.ndarray, b: np.ndarray, keys: np.ndarray) -> dict:
    """The query-frame statistics of one item and head: ``logits`` (R, K), ``keep`` (R, K) kept keys, ``rows`` (R,)
    the rows compared, ``b`` (K,) the frame's key term, ``keys`` (K, D) the keys (for near-ties)."""
    nw_logits = _centre(logits, keep) - b
    # rows where float32 may order two keys otherwise than float64 does, on either side (helpers.NEAR_TIE)
    tie_a, top_a = (x.numpy() for x in near_ties(torch.from_numpy(logits), torch.from_numpy(keys)))
    tie_w, top_w = (
        x.numpy() for x in near_ties(torch.from_numpy(np.where(keep, nw_logits, -1e30)), torch.from_numpy(keys))
    )
    values: dict[str, list] = {}
    flat_a, flat_w = [], []
    # copies of one token (keys within 1e-6 of the largest norm: the unconditional image tokens of several
    # references) are one key: tied where their values agree, one arg-max
    first = (distance.cdist(keys, keys) <= 1e-6 * np.linalg.norm(keys, axis=-1).max()).argmax(-1)  # (K,)
    tied = _copies_tied(logits, first), _copies_tied(np.where(keep, nw_logits, -1e30), first)
    for r in np.flatnonzero(rows):
        m = keep[r]
        x, y = logits[r, m], nw_logits[r, m]
        a, w = special.softmax(x), special.softmax(y)
        flat_a.append(a)
        flat_w.append(w)
        k = int(m.sum())
        ranked_x, ranked_y = tied[0][r, m], tied[1][r, m]
        varies = np.ptp(ranked_x) > 0 and np.ptp(ranked_y) > 0
        rho = stats.spearmanr(ranked_x, ranked_y).statistic if varies else np.nan
        # a key term constant to float32 rounding (1e-5 of its largest entry, as the probe counts it: the query frame
        # of weights that are already its NW weights) has r = inf; near it, r carries that rounding relatively
        spread, largest = b[m].std(), np.abs(b[m]).max()
        ratio = x.std() / spread if spread > 1e-5 * largest else np.inf
        row = {
            "kl": float((a * (np.log(a) - np.log(w))).sum()),
            "neff_nw": float(1 / (w * w).sum()),
            "tie": float(tie_a[r] or tie_w[r]),
            "top_tie": float(top_a[r] or top_w[r]),
        }
        if not np.isnan(rho):
            row.update(
                {
                    "spearman": rho,
                    # an arg-max of an all-tied row is a tie-break: top-1 over the rows with a rho, as rho
                    "top1": float(first[m][x.argmax()] == first[m][y.argmax()]),
                    "rho_baseline": float(_moran(np.float64(ratio), np.float64(k))),
                    # a row at exactly 0.9 (a value rho takes for some K) is not above it (stats.ROW_TIE)
                    "rows_rho_gt_0.9": float(rho > 0.9 + 1e-5),
                    "rows_rho_gt_0.9_null": float((_null_rho(k) > 0.9).mean()),
                    "rows_rho_pos1": float(abs(rho - 1) < 1e-9),
                    "rows_rho_neg1": float(abs(rho + 1) < 1e-9),
                    "rows_rho_pos1_null": 1 / math.factorial(k),
                }
            )
            row["rho_excess"] = rho - row["rho_baseline"]
            if np.isfinite(ratio):  # r infinite: left out of its mean (baseline 1)
                row["logit_ratio"], row["ratio_slack"] = ratio, ratio * 1e-5 * largest / spread
            error = row.get("ratio_slack", 0.0)
            row["baseline_slack"] = abs(_moran(np.float64(ratio + error), k) - _moran(np.float64(ratio - error), k))
        for name, value in row.items():
            values.setdefault(name, []).append(value)
    out = {name: float(np.mean(v)) for name, v in values.items()}
    out["pearson"] = stats.pearsonr(np.concatenate(flat_a), np.concatenate(flat_w)).statistic
    return out


def reference_cells(q, keys, keep, rows, pools: int, heads: int) -> list[list[dict]]:
    """Per item and head, the statistics of both forms: ``{form: stats}``.

    Args:
        q: ``(B, Q, H*D)``, keys: ``(B, K, H*D)`` from the hooks; keep: ``(B, K)`` kept keys; rows: ``(B, Q)`` rows
            inside the mask; pools: how many frames the batch forms (``B`` for one item each, else the chunks).
    """
    batch = q.shape[0]
    d = q.shape[-1] // heads
    q = q.reshape(batch, -1, heads, d).transpose(0, 2, 1, 3)  # (B, H, Q, D)
    k = keys.reshape(batch, -1, heads, d).transpose(0, 2, 1, 3)  # (B, H, K, D)
    return frame_cells(q @ k.swapaxes(-1, -2) / math.sqrt(d), k, keep, rows, pools)


def frame_cells(logits, k, keep, rows, pools: int) -> list[list[dict]]:
    """:func:`reference_cells` from the logits ``(B, H, Q, K)`` the weights are the softmax of (an edit's: the log of
    the weights the layer used) and the keys ``(B, H, K, D)`` (for copies and near-ties)."""
    batch, heads, n_queries = logits.shape[:3]
    out = [[{} for _ in range(heads)] for _ in range(batch)]
    per_pool = batch // pools
    for head in range(heads):
        for pool in range(pools):
            items = range(pool * per_pool, (pool + 1) * per_pool)
            keep_rows = {i: np.broadcast_to(keep[i], (n_queries, keep.shape[1])) for i in items}
            centred = np.concatenate([_centre(logits[i, head], keep_rows[i])[rows[i]] for i in items])
            kept = np.concatenate([keep_rows[i][rows[i]] for i in items])
            for form in FORMS:
                b = _key_term(centred, kept, form)
                for i in items:
                    out[i][head][form] = _item_stats(logits[i, head], keep_rows[i], rows[i], b, k[i, head])
    return out


def check(df, expected: dict, heads: int) -> int:
    """Compare the probe's cond/uncond rows with ``expected[(step, label)] = [per head {form: stats}]``; return how
    many values were compared."""
    compared = 0
    for (step, label), per_head in expected.items():
        cell = df[(df["step"] == step) & (df["branch"] == label)].sort_values("head")
        assert len(cell) == heads, (step, label)
        for head in range(heads):
            row = cell.iloc[head]
            for form in FORMS:
                ref = per_head[head][form]
                for name in CHECKED:
                    got, want = row[query_frame_column(name, form)], ref.get(name, math.nan)
                    if math.isnan(want):  # undefined (no row with a rho): NaN in the table too
                        assert math.isnan(got), (name, form, step, label, head, got)
                        compared += 1
                        continue
                    # float32 against float64 (rtol 1e-4, atol 2e-4, as tests/test_probe_matrix.py), plus what
                    # near-tied rows may move a row's rho (by up to 2), its top-1 or its share counts (by 1)
                    slack = {"spearman": 2, "rho_excess": 2}.get(name, 1) * ref["tie"]
                    slack = ref["top_tie"] if name == "top1" else slack
                    if name in ("kl", "pearson", "neff_nw", "logit_ratio", "rho_baseline"):
                        slack = 0.0
                    # what the float32 key term's rounding moves r by, and the baseline (and excess) with it
                    slack += ref.get("ratio_slack", 0.0) if name == "logit_ratio" else 0.0
                    slack += ref.get("baseline_slack", 0.0) if name in ("rho_baseline", "rho_excess") else 0.0
                    assert got == pytest.approx(want, rel=1e-4, abs=2e-4 + slack), (name, form, step, label, head)
                    compared += 1
    return compared


def _average(cells: list[tuple[str, list]], heads: int) -> dict[str, list]:
    """Average per-item statistics over a label's items (and images), as the probe's cells are."""
    out: dict[str, list] = {}
    for label in dict.fromkeys(name for name, _ in cells):
        group = [value for name, value in cells if name == label]
        out[label] = [
            {form: {n: float(np.mean([g[h][form][n] for g in group])) for n in group[0][h][form]} for form in FORMS}
            for h in range(heads)
        ]
    return out


# --------------------------------------------------------------------------- tiny SD 1.5


@pytest.mark.parametrize("frame", ["item", "branch"])
def test_image_branch_with_ragged_masks_matches_the_float64_reference(refs, frame):
    """CFG, two images per prompt, one IP-Adapter mask per reference image (each image has its own softmax over its
    own tokens, rows outside its mask take no part): per cell, both forms, every checked statistic."""
    pipe = tiny_pipeline("sd15")
    masks = masks_for(len(refs))
    layer = "down_blocks.1.attentions.0.transformer_blocks.0.attn2"
    with CaptureQK(pipe) as capture, probe(pipe, layers=f"^{layer}$", query_frame=frame) as run:
        pipe(
            "a photo of a flower",
            ip_adapter_image=[refs],
            num_inference_steps=2,
            num_images_per_prompt=2,
            guidance_scale=5.0,
            cross_attention_kwargs={"ip_adapter_masks": masks},
            generator=torch.Generator().manual_seed(0),
            output_type="latent",
        )
    df = run.to_dataframe()
    assert (df[QUERY_FRAME_COLUMN] == frame).all()
    heads = pipe.unet.get_submodule(layer).heads
    record = capture.captured[layer]
    layout = ("uncond", "uncond", "cond", "cond")  # diffusers' CFG batch: [negative, prompt] x 2 images
    compared = 0
    for step, q in enumerate(record["q"]):
        q = q.double().numpy()
        batch, queries = q.shape[:2]
        cells = []
        for image in range(len(refs)):
            keys = record["k"][step * len(refs) + image].double().numpy()
            rows = IPAdapterMaskProcessor.downsample(masks[0][:, image], batch, queries, 1)[..., 0].numpy() != 0
            assert 0 < rows[0].sum() < queries  # ragged: the mask leaves rows out
            keep = np.ones((batch, keys.shape[1]), bool)
            per_item = reference_cells(q, keys, keep, rows, batch if frame == "item" else 2, heads)
            cells += [(layout[i], per_item[i]) for i in range(batch)]
        expected = _average(cells, heads)
        # the uncond branch's image tokens are copies of one token per reference (one zero embedding), which the
        # probe ties on purpose; the reference does not model that, so only the cond branch is compared
        compared += check(df, {(step, "cond"): expected["cond"]}, heads)
    assert compared == 2 * heads * len(FORMS) * len(CHECKED)
    assert df[[query_frame_column(n, f) for f in FORMS for n in CHECKED]].notna().all().all()


@pytest.mark.parametrize("frame", ["item", "branch"])
def test_text_branch_leaves_padding_out_of_the_frame(refs, frame):
    """Two prompts and two negative prompts of different lengths: every item's text keys are its own prompt's tokens
    up to the first end-of-text (padding left out), so a branch frame pools rows whose kept keys differ."""
    pipe = tiny_pipeline("sd15")
    prompts, negatives = ["a photo of a flower", "a cat"], ["blurry", "dark and low quality"]
    layer = "up_blocks.1.attentions.0.transformer_blocks.0.attn2"
    with (
        CaptureQK(pipe, text=True) as capture,
        probe(pipe, layers=f"^{layer}$", kind="text", query_frame=frame) as run,
    ):
        pipe(
            prompts,
            negative_prompt=negatives,
            ip_adapter_image=[refs],
            num_inference_steps=2,
            guidance_scale=5.0,
            generator=torch.Generator().manual_seed(0),
            output_type="latent",
        )
    df = run.to_dataframe()
    assert set(df["kind"]) == {"text"}
    heads = pipe.unet.get_submodule(layer).heads
    record = capture.captured[layer]
    tokens = record["t"][0].shape[1]
    keep = np.zeros((4, tokens), bool)
    for i, text in enumerate(negatives + prompts):  # diffusers' CFG batch: [negative prompts, prompts]
        ids = pipe.tokenizer(text).input_ids
        keep[i, : ids.index(pipe.tokenizer.eos_token_id) + 1] = True  # up to and including the first end-of-text
    assert len(set(keep.sum(1))) == 4  # four different lengths: ragged key masks
    layout = ("uncond", "uncond", "cond", "cond")
    compared = 0
    for step, (q, keys) in enumerate(zip(record["q"], record["t"], strict=True)):
        q, keys = q.double().numpy(), keys.double().numpy()
        rows = np.ones(q.shape[:2], bool)
        per_item = reference_cells(q, keys, keep, rows, 4 if frame == "item" else 2, heads)
        expected = _average([(layout[i], per_item[i]) for i in range(4)], heads)
        compared += check(df, {(step, label): expected[label] for label in ("uncond", "cond")}, heads)
    assert compared == 2 * 2 * heads * len(FORMS) * len(CHECKED)


def test_item_and_branch_frames_differ_and_a_bad_frame_is_refused(refs):
    """With two images per branch the pools differ, so the columns must (else the option would do nothing); a bad
    frame is refused naming the choices, before anything is attached."""
    pipe = tiny_pipeline("sd15")
    tables = {}
    for frame in ("item", "branch"):
        with probe(pipe, query_frame=frame) as run:
            pipe("a photo", ip_adapter_image=[refs], num_inference_steps=2, num_images_per_prompt=2,
                 generator=torch.Generator().manual_seed(0), output_type="latent")  # fmt: skip
        tables[frame] = run.to_dataframe()
    stored = [c for c in tables["item"].columns if not c.startswith("qf_") and c != QUERY_FRAME_COLUMN]
    assert tables["item"][stored].equals(tables["branch"][stored])  # the stored frame does not depend on it
    assert not np.allclose(tables["item"]["qf_spearman"], tables["branch"]["qf_spearman"])
    with pytest.raises(ValueError, match=r"query_frame: expected one of \['item', 'branch'\]"):
        with probe(pipe, query_frame="batch"):
            pass
    assert not any(m._forward_hooks for m in pipe.unet.modules())


# --------------------------------------------------------------------------- the ip-adapter organism


@pytest.fixture(scope="module")
def ip_organism():
    from ipa_probe.tiny.digits import digits_pipeline

    pipe = digits_pipeline(recipe="ip-adapter")
    pipe.set_progress_bar_config(disable=True)
    return pipe


def test_organism_reproduces_the_documented_query_frame_rho(ip_organism):
    """Digit 3, three references (K = 12), 20 DDIM steps, CFG 3, seed 0, cond branch, item frame: the probe's mean
    qf rho over the step x layer x head cells equals the float64 recomputation from the test's own hooks and the
    numbers docs/gauge.md reports (0.7896 exact, 0.7683 Gaussian)."""
    from ipa_probe.tiny.digits import DIGITS_PROMPT, digits_reference_images

    refs = digits_reference_images(3, 3, seed=0)
    with CaptureQK(ip_organism) as capture, probe(ip_organism) as run:
        ip_organism(DIGITS_PROMPT, ip_adapter_image=[refs], num_inference_steps=20, guidance_scale=3.0,
                    generator=torch.Generator().manual_seed(0), output_type="latent")  # fmt: skip
    df = run.to_dataframe()
    cond = df[(df["kind"] == "image") & (df["branch"] == "cond")]
    assert len(cond) == 2560
    reference: dict[str, list[float]] = {form: [] for form in FORMS}
    slack: dict[str, list[float]] = {form: [] for form in FORMS}
    probed: dict[str, list[float]] = {form: [] for form in FORMS}
    for layer in capture.layers:
        heads = layer.attention.heads
        part = cond[cond["layer"] == layer.name]
        captured = capture.captured[layer.name]
        for step, (q, k) in enumerate(zip(captured["q"], captured["k"], strict=True)):
            q, k = q.double().numpy(), k.double().numpy()
            batch, d = q.shape[0], q.shape[-1] // heads
            q = q.reshape(batch, -1, heads, d).transpose(0, 2, 1, 3)[
                1
            ]  # (H, Q, D): the cond item ([negative, prompt])
            k = k.reshape(batch, -1, heads, d).transpose(0, 2, 1, 3)[1]  # (H, K, D)
            logits = q @ k.swapaxes(-1, -2) / math.sqrt(d)  # (H, Q, K)
            centred = logits - logits.mean(-1, keepdims=True)
            for form in FORMS:
                if form == "exact":
                    b = special.logsumexp(centred, axis=1, keepdims=True) - math.log(centred.shape[1])
                else:
                    b = centred.mean(1, keepdims=True) + centred.var(1, keepdims=True) / 2
                nw = centred - b
                ra, rw = stats.rankdata(logits, axis=-1), stats.rankdata(nw, axis=-1)
                ra, rw = ra - ra.mean(-1, keepdims=True), rw - rw.mean(-1, keepdims=True)
                with np.errstate(invalid="ignore"):  # one query (the 1 x 1 mid block): NW rows constant, no rho
                    rho = (ra * rw).sum(-1) / np.sqrt((ra * ra).sum(-1) * (rw * rw).sum(-1))  # (H, Q)
                if centred.shape[1] == 1:
                    rho[:] = np.nan  # exactly constant in exact arithmetic; float64 rounding must not rank noise
                reference[form] += [np.mean(r) for r in rho]
                # rows whose order float32 may decide otherwise (near-ties of either side, helpers.NEAR_TIE): rho of
                # a row lies in [-1, 1], so each such row may move its cell's mean by 2 / Q
                keys = torch.from_numpy(k)
                tied = near_ties(torch.from_numpy(logits), keys)[0] | near_ties(torch.from_numpy(nw), keys)[0]
                slack[form] += list(2 * tied.double().mean(-1).numpy())
                column = query_frame_column("spearman", form)
                probed[form] += list(part[part["step"] == step].sort_values("head")[column])
    for form, note in (("exact", 0.7896), ("gaussian", 0.7683)):
        ref, got, allowed = np.asarray(reference[form]), np.asarray(probed[form]), np.asarray(slack[form])
        assert (np.isnan(ref) == np.isnan(got)).all()  # the mid block's cells (one query) have no rho on both sides
        # per cell float32 against float64: 1e-5 covers the float32 rank correlation's own sums (the largest
        # difference seen was 1.3e-7), plus what near-tied rows may move; most cells have none, so the check bites
        finite = ~np.isnan(ref)
        assert (np.abs(got - ref)[finite] <= 1e-5 + allowed[finite]).all(), form
        assert (allowed[finite] == 0).mean() > 0.9, form
        # the note prints 4 digits (+-5e-5) from its own float64 computation; the probe's float32 mean over 2,400
        # finite cells differs from the float64 one by far less than 5e-5 (checked per cell above)
        assert np.nanmean(ref) == pytest.approx(note, abs=5e-5), form
        assert np.nanmean(got) == pytest.approx(note, abs=1e-4), form


# --------------------------------------------------------------------------- invariance under a per-head basis change


def _basis_change(pipe, seed: int) -> None:
    """q -> A q and k -> A^-T k per head, in place, on every IP-Adapter layer's to_q, to_k and to_k_ip[0]: every
    q·k, hence every attention weight and output, is unchanged (to float rounding); key norms are not."""
    from ipa_probe.layers import find_ip_layers

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in find_ip_layers(pipe):
            attention = layer.attention
            heads, inner = attention.heads, attention.to_q.weight.shape[0]
            d = inner // heads
            for h in range(heads):
                rows = slice(h * d, (h + 1) * d)
                orthogonal, _ = torch.linalg.qr(torch.randn(d, d, generator=gen, dtype=torch.float64))
                a = orthogonal @ torch.diag(torch.exp(0.7 * torch.randn(d, generator=gen, dtype=torch.float64)))
                inverse_t = torch.linalg.inv(a).T
                keys = (attention.to_k, attention.processor.to_k_ip[0])
                for module, m in ((attention.to_q, a), *((k, inverse_t) for k in keys)):
                    module.weight[rows] = (m @ module.weight[rows].double()).float()
                    if module.bias is not None:
                        module.bias[rows] = (m @ module.bias[rows].double()).float()


def test_query_frame_columns_do_not_move_under_a_per_head_basis_change(refs):
    """The same generation before and after a random per-head basis change (condition numbers up to ~20): outputs
    equal to float rounding, every qf column equal to float rounding, while the stored-frame rho moves."""
    tables, images = [], []
    for changed in (False, True):
        pipe = tiny_pipeline("sd15")
        if changed:
            _basis_change(pipe, seed=5)
        with probe(pipe, kind="both") as run:
            out = pipe("a photo of a flower", ip_adapter_image=[refs], num_inference_steps=2, guidance_scale=5.0,
                       generator=torch.Generator().manual_seed(0), output_type="np")  # fmt: skip
        images.append(out.images)
        tables.append(run.to_dataframe())
    # float32 logits computed from other weights: the outputs agree to rounding, far below one 8-bit level (4e-3)
    assert np.abs(images[0] - images[1]).max() < 1e-4
    before, after = tables
    ratios = [query_frame_column("logit_ratio", f) for f in FORMS]
    qf = [query_frame_column(n, f) for f in FORMS for n in CHECKED if n != "logit_ratio"]
    diff = (before[qf] - after[qf]).abs().to_numpy()
    # the logits differ by float32 rounding amplified by cond(A): a statistic of smooth functions of them moves by
    # ~1e-6; a rho or top-1 moves only where two keys' logits lie within that rounding (a near-tie swaps), so almost
    # every cell is equal to 1e-5 and none moves by more than one swapped pair in one row could (1e-2)
    assert (diff <= 1e-5).mean() > 0.99 and diff.max() < 1e-2, diff.max()
    # r = sd(L) / sd(b) reaches ~1e3 where b is nearly flat over the keys, and then carries the rounding of b
    # relatively: 1e-2 of itself (the largest relative change seen was 4e-3)
    np.testing.assert_allclose(after[ratios].to_numpy(), before[ratios].to_numpy(), rtol=1e-2, atol=1e-5)
    stored = (before["spearman"] - after["spearman"]).abs()
    assert stored.mean() > 0.02, stored.mean()  # so the test can fail: the stored frame does move


# --------------------------------------------------------------------------- the other query pool, on the organism


def _organism_pool_reference(capture, items: int) -> tuple[dict, dict]:
    """Per (step, layer, head) of the cond branch (the last ``items`` of each pass's batch), the float64 query-frame
    rho (exact form) under both pools, and each cell's near-tie slack in each: ``({pool: {cell: rho}}, {pool: {cell:
    slack}})``.

    The item pool estimates ``b`` over one item's queries, the branch pool over the cond items' queries together; a
    cell is the mean over the branch's items, as the probe's cells are."""
    rho_of = {"item": {}, "branch": {}}
    slack = {"item": {}, "branch": {}}
    for layer in capture.layers:
        heads = layer.attention.heads
        captured = capture.captured[layer.name]
        for step, (q, k) in enumerate(zip(captured["q"], captured["k"], strict=True)):
            q, k = q.double().numpy()[-items:], k.double().numpy()[-items:]  # the cond items ([negative, prompt])
            d = q.shape[-1] // heads
            q = q.reshape(items, -1, heads, d).transpose(0, 2, 1, 3)  # (items, H, Q, D)
            k = k.reshape(items, -1, heads, d).transpose(0, 2, 1, 3)  # (items, H, K, D)
            logits = q @ k.swapaxes(-1, -2) / math.sqrt(d)  # (items, H, Q, K)
            centred = logits - logits.mean(-1, keepdims=True)
            queries = centred.shape[2]
            b = {
                "item": special.logsumexp(centred, axis=2, keepdims=True) - math.log(queries),
                # every cond item's queries in one frame: (1, H, 1, K), the same b for each item
                "branch": special.logsumexp(centred.transpose(1, 0, 2, 3).reshape(heads, -1, centred.shape[-1]),
                                            axis=1, keepdims=True)[None] - math.log(items * queries),
            }  # fmt: skip
            keys = torch.from_numpy(k)
            tied_attention = near_ties(torch.from_numpy(logits), keys)[0]  # (items, H, Q)
            for pool, term in b.items():
                nw = centred - term
                ra, rw = stats.rankdata(logits, axis=-1), stats.rankdata(nw, axis=-1)
                ra, rw = ra - ra.mean(-1, keepdims=True), rw - rw.mean(-1, keepdims=True)
                with np.errstate(invalid="ignore"):  # constant NW rows (a one-query item frame): no rho
                    rho = (ra * rw).sum(-1) / np.sqrt((ra * ra).sum(-1) * (rw * rw).sum(-1))  # (items, H, Q)
                if pool == "item" and queries == 1:
                    rho[:] = np.nan  # exactly constant in exact arithmetic; float64 rounding must not rank noise
                tied = (tied_attention | near_ties(torch.from_numpy(nw), keys)[0]).double()
                for head in range(heads):
                    rho_of[pool][(step, layer.name, head)] = float(rho[:, head].mean(-1).mean())
                    # a near-tied row may move its item's rho by 2 / Q, so the cell (mean over items) by 2 x the share
                    slack[pool][(step, layer.name, head)] = float(2 * tied[:, head].mean())
    return rho_of, slack


@pytest.mark.parametrize("frame", ["item", "branch"])
def test_other_pool_and_its_effect_match_the_float64_reference(ip_organism, frame):
    """Three images per prompt (CFG 3: three items per branch): every cond cell's ``qf_spearman`` and
    ``qf_spearman_other_pool`` equal the test's own float64 rho under the run's pool and under the other one, and the
    summary's pool effect (the shift of the mean, on the shared cells, the cells with a rho, the standard error of the
    mean over cells and whether the shift exceeds it) is that reference's, stated in ``attrs["query_pool"]``."""
    from ipa_probe.tiny.digits import DIGITS_PROMPT, digits_reference_images

    items, other = 3, {"item": "branch", "branch": "item"}[frame]
    refs = digits_reference_images(3, 3, seed=0)
    with CaptureQK(ip_organism) as capture, probe(ip_organism, query_frame=frame) as run:
        ip_organism(DIGITS_PROMPT, ip_adapter_image=[refs], num_inference_steps=5, guidance_scale=3.0,
                    num_images_per_prompt=items, generator=torch.Generator().manual_seed(0),
                    output_type="latent")  # fmt: skip
    reference, slack = _organism_pool_reference(capture, items)
    df = run.to_dataframe()
    cond = df[(df["kind"] == "image") & (df["branch"] == "cond")]
    compared = 0
    for column, pool in (("qf_spearman", frame), ("qf_spearman_other_pool", other)):
        got = cond.set_index(["step", "layer", "head"])[column]
        keys = list(reference[pool])
        want = np.array([reference[pool][key] for key in keys])
        probed = got.loc[keys].to_numpy(np.float64)
        allowed = np.array([slack[pool][key] for key in keys])
        assert (np.isnan(want) == np.isnan(probed)).all(), column  # the item pool's one-query mid block: NaN
        finite = ~np.isnan(want)
        # per cell float32 against float64: 1e-5 covers the float32 rank correlation's sums (as above), plus what
        # near-tied rows may move; most cells have none, so the check bites
        assert (np.abs(probed - want)[finite] <= 1e-5 + allowed[finite]).all(), column
        # a cell here holds three items' rows, so thrice the chance of a near-tied row (the largest share seen: 0.16)
        assert (allowed[finite] == 0).mean() > 0.75, column
        compared += int(finite.sum())
    assert compared > 2 * 0.9 * len(cond)
    # the pools differ on these cells, so the column is not the run's own rho again
    assert not np.allclose(cond["qf_spearman"], cond["qf_spearman_other_pool"], equal_nan=True)

    summary = run.summary()
    assert summary.attrs["query_pool"].startswith(f"query pool: query_frame={other!r} instead of {frame!r}")
    rows = summary[(summary["kind"] == "image") & (summary["branch"] == "cond")]
    decided = 0
    for row in rows.itertuples():
        cells = [key for key in reference[frame] if key[0] == row.step]
        own, alt = (np.array([reference[pool][key] for key in cells]) for pool in (frame, other))
        # what the probe's float32 cells may differ from these by (the per-cell bound above), NaN cells counting 0
        err_own, err_alt = (np.array([1e-5 + slack[pool][key] for key in cells]) for pool in (frame, other))
        err_own, err_alt = np.where(np.isnan(own), 0, err_own), np.where(np.isnan(alt), 0, err_alt)
        n_own, n_alt = np.isfinite(own).sum(), np.isfinite(alt).sum()
        shift = np.nanmean(alt) - np.nanmean(own)
        shared = ~np.isnan(own) & ~np.isnan(alt)
        sem = np.nanstd(own, ddof=1) / math.sqrt(n_own)
        # a mean moves by at most the mean of its cells' bounds; a standard deviation by at most the bounds' root sum
        # of squares over sqrt(n - 1) (it is a norm of the centred values), so the standard error by that over sqrt(n)
        room = err_own.sum() / n_own + err_alt.sum() / n_alt
        room_sem = np.sqrt((err_own**2).sum() / (n_own - 1) / n_own)
        assert row.qf_pool_shift == pytest.approx(shift, abs=room)
        both = (err_own + err_alt)[shared].mean()
        assert row.qf_pool_shift_shared == pytest.approx((alt - own)[shared].mean(), abs=both)
        assert (row.qf_cells, row.qf_other_pool_cells) == (n_own, n_alt)
        assert row.qf_spearman_sem == pytest.approx(sem, abs=room_sem)
        assert not row.qf_pools_coincide
        # the decision is the reference's wherever the reference's margin exceeds how far the probe's two numbers
        # lie from it (each within the bounds just checked)
        if abs(abs(shift) - sem) > abs(row.qf_pool_shift - shift) + abs(row.qf_spearman_sem - sem):
            assert row.qf_pool_exceeds_se == (abs(shift) > sem), row.step
            decided += 1
        if row.qf_pool_exceeds_se:  # named in the note (every row named: the default names the 6 largest)
            named = query_pool_note(summary, most=len(summary))
            assert f"t={row.timestep:g} image cond {row.qf_pool_shift:+.4f}" in named
    assert summary.attrs["query_pool"] == query_pool_note(summary)
    assert decided == len(rows)  # no step sits within float rounding of its standard error


def test_one_image_per_branch_pays_nothing_and_the_pools_coincide(ip_organism, monkeypatch):
    """With one item per CFG branch the other pool is the same rows: its frame is never formed (a one-image run costs
    what it cost before the column existed), the column repeats ``qf_spearman`` bit for bit (NaN where NaN), and the
    summary says the pools coincide; with two items per branch the other frame is formed once per record. Each
    record's frames are formed once, with the other records of its pass and size (one pass per size and step)."""
    from ipa_probe.capture import cells as cells_module
    from ipa_probe.tiny.digits import DIGITS_PROMPT, digits_reference_images

    formed = []  # (form, groups) of each pass that forms frames
    frame_terms = cells_module.frame_terms

    def counted(attn, key_mask, row_mask, pools, form="both"):
        formed.append((form, attn.shape[0]))
        return frame_terms(attn, key_mask, row_mask, pools, form)

    monkeypatch.setattr(cells_module, "frame_terms", counted)
    refs = digits_reference_images(3, 3, seed=0)
    for images in (1, 2):
        formed.clear()
        with probe(ip_organism, steps=[0, 1]) as run:
            ip_organism(DIGITS_PROMPT, ip_adapter_image=[refs], num_inference_steps=3, guidance_scale=3.0,
                        num_images_per_prompt=images, generator=torch.Generator().manual_seed(0),
                        output_type="latent")  # fmt: skip
        df, summary = run.to_dataframe(), run.summary()
        records = 2 * df["layer"].nunique()  # two recorded steps, one record per layer and step
        sizes = len({plan[0] for plan in run._row_plan.values()})  # one pass per size (rows per item), steps joined
        groups = 2 * images  # a group per batch item: CFG's two branches, each of `images` items
        both = [n for form, n in formed if form == "both"]
        # every record once, sizes batched: one pass per size with both steps' records, cut in two where the stack
        # would leave a CPU's cache (cells.JOIN_ELEMENTS_CPU)
        assert sum(both) == records * groups and sizes <= len(both) <= 2 * sizes < records
        if images == 1:
            assert {form for form, _ in formed} == {"both"}  # the run's own frames only
            own, alt = df["qf_spearman"].to_numpy(float), df["qf_spearman_other_pool"].to_numpy(float)
            assert np.array_equal(own, alt, equal_nan=True) and np.isnan(own).any()  # the mid block's NaN kept
            assert summary["qf_pools_coincide"].all() and (summary["qf_pool_shift"] == 0).all()
            assert not summary["qf_pool_exceeds_se"].any()
            assert "the pools coincide" in summary.attrs["query_pool"]
        else:
            assert sorted(n for form, n in formed if form == "exact") == sorted(both)  # the other pool, each pass
            assert not summary["qf_pools_coincide"].any()
            assert "would move the mean query-frame rho" in summary.attrs["query_pool"]
