"""The query-frame key term against a float64 recomputation written here, and its invariances."""

import math

import numpy as np
import pytest
import torch
from scipy.special import logsumexp

from ipa_probe.statistics.kernels import query_frame_bias, segment_query_frame_terms
from ipa_probe.statistics.rows import Segments


def _reference(logits: np.ndarray, rows: np.ndarray, keys: np.ndarray, form: str) -> np.ndarray:
    """b over one pool, float64, one key at a time: rows (R,) and keys (K,) boolean."""
    kept = logits[:, keys]
    centred = kept - kept.mean(-1, keepdims=True)  # (R, K_kept)
    pool = centred[rows]
    out = np.zeros(logits.shape[-1])
    if form == "exact":
        out[keys] = logsumexp(pool, axis=0) - math.log(pool.shape[0])
    else:
        out[keys] = pool.mean(0) + pool.var(0) / 2  # np.var: population variance
    return out


@pytest.mark.parametrize("form", ["exact", "gaussian"])
@pytest.mark.parametrize("masked", [False, True])
def test_matches_float64_reference(form, masked):
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 2, 7, 5, generator=gen, dtype=torch.float64) * 3  # (B, H, R, K)
    rows = torch.ones(3, 2, 7, dtype=torch.bool)
    keys = torch.ones(3, 2, 1, 5, dtype=torch.bool)
    if masked:  # ragged: each pool keeps its own rows and keys
        rows = torch.rand(3, 2, 7, generator=gen) > 0.4
        rows[..., 0] = True
        keys[0, :, :, 3:] = False
        keys[2, 1, :, 0] = False
    b = query_frame_bias(logits, rows if masked else None, keys if masked else None, form)
    assert b.shape == (3, 2, 1, 5)
    for i in range(3):
        for h in range(2):
            want = _reference(logits[i, h].numpy(), rows[i, h].numpy(), keys[i, h, 0].numpy(), form)
            # float64 on both sides; the torch and numpy reductions differ only in summation order
            np.testing.assert_allclose(b[i, h, 0].numpy(), want, rtol=0, atol=1e-12)


def test_invariant_to_row_shift_and_basis_change():
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(2, 50, 4, generator=gen, dtype=torch.float64)  # (H, Q, D)
    k = torch.randn(2, 6, 4, generator=gen, dtype=torch.float64)  # (H, K, D)
    a = torch.randn(2, 4, 4, generator=gen, dtype=torch.float64) + 2 * torch.eye(4, dtype=torch.float64)
    logits = q @ k.transpose(-1, -2)
    moved = (q @ a.transpose(-1, -2)) @ (k @ torch.linalg.inv(a)).transpose(-1, -2)  # q -> A q, k -> A^-T k
    shifted = logits + torch.randn(2, 50, 1, generator=gen, dtype=torch.float64) * 5  # a constant per row
    for form in ("exact", "gaussian"):
        b = query_frame_bias(logits, form=form)
        # float64 with cond(A) of a few: the products agree to ~1e-13, far inside this bound
        torch.testing.assert_close(query_frame_bias(moved, form=form), b, rtol=0, atol=1e-10)
        torch.testing.assert_close(query_frame_bias(shifted, form=form), b, rtol=0, atol=1e-10)


def test_gaussian_form_matches_exact_on_gaussian_queries():
    # For q ~ N(0, I) the centred logits of a key are Gaussian over q, where log E exp(x) = mean + var / 2 exactly;
    # with 200,000 queries the exact form's sampling error is about sd(exp L) / (sqrt(n) E exp L) ~ 1e-2 for the
    # logit spreads below (var up to ~1), so 0.03 leaves room for the tail of that error.
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(200_000, 4, generator=gen, dtype=torch.float64)
    k = torch.randn(5, 4, generator=gen, dtype=torch.float64) * 0.5
    logits = (q @ k.T)[None]  # (1, Q, K)
    exact, gauss = query_frame_bias(logits, form="exact"), query_frame_bias(logits, form="gaussian")
    torch.testing.assert_close(exact, gauss, rtol=0, atol=0.03)
    # and both equal the closed form |k_i - k̄|^2 / 2 of isotropic Gaussian queries, to the same sampling error
    centred = k - k.mean(0)
    torch.testing.assert_close(gauss[0, 0], (centred * centred).sum(-1) / 2, rtol=0, atol=0.03)


def test_rejects_unknown_form():
    with pytest.raises(ValueError, match="exact"):
        query_frame_bias(torch.zeros(2, 3), form="median")


def test_key_masks_that_differ_between_rows_of_a_pool():
    """Text keys of two prompts pooled in one frame: each key's b over the frame's rows that keep it (float64
    reference written here, one key at a time)."""
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 9, 6, generator=gen, dtype=torch.float64) * 2  # (H, R, K)
    keys = torch.ones(2, 9, 6, dtype=torch.bool)
    keys[:, :4, 4:] = False  # rows 0-3: a prompt of 4 tokens; rows 4-8: 6 tokens
    keys[:, :, 5] &= torch.arange(9) >= 7  # key 5 kept by rows 7 and 8 only
    rows = torch.ones(2, 9, dtype=torch.bool)
    rows[:, 8] = False  # so key 5 is kept by one frame row (7)
    for form in ("exact", "gaussian"):
        b = query_frame_bias(logits, rows, keys, form)[:, 0]  # (H, K)
        for h in range(2):
            x, m = logits[h].numpy(), keys[h].numpy()
            centred = np.where(m, x - np.array([x[r, m[r]].mean() for r in range(9)])[:, None], 0.0)
            for i in range(6):
                pool = centred[rows[h].numpy() & m[:, i], i]
                want = logsumexp(pool) - math.log(len(pool)) if form == "exact" else pool.mean() + pool.var() / 2
                # float64 on both sides: summation order only
                assert b[h, i].item() == pytest.approx(want, abs=1e-12), (form, h, i)


def test_both_forms_at_once_equal_each_form():
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(3, 2, 11, 4, generator=gen)
    rows = torch.rand(3, 2, 11, generator=gen) > 0.3
    both = query_frame_bias(logits, rows, form="both")
    assert both.shape == (2, 3, 2, 1, 4)
    # the same operations on the same centred tensor: equal bit for bit
    assert torch.equal(both[0], query_frame_bias(logits, rows, form="exact"))
    assert torch.equal(both[1], query_frame_bias(logits, rows, form="gaussian"))


@pytest.mark.parametrize("form", ["exact", "gaussian"])
def test_segment_frames_of_any_sizes_match_float64_reference(form):
    """Frames of 7, 1, 12 and 3 rows (the last with no row inside: b = 0) flattened key-major side by side, as
    capture.cells.joint_frames passes every layer size of a pass: each frame's b and centred rows are its own."""
    gen = torch.Generator().manual_seed(1)
    keys, sizes = 5, (7, 1, 12, 3)
    pools = [torch.randn(n, keys, generator=gen, dtype=torch.float64) * 3 for n in sizes]  # (R, K) each
    inside = [torch.rand(n, generator=gen) > 0.3 for n in sizes]
    inside[0][0], inside[1][0], inside[3][:] = True, True, False
    row_ids, segment_ids, offset = [], [], 0
    for frame, n in enumerate(sizes):  # entry (k, r) of frame f: row offset + r, segment f * K + k
        k, r = torch.meshgrid(torch.arange(keys), torch.arange(n), indexing="ij")
        row_ids.append((offset + r).reshape(-1))
        segment_ids.append((frame * keys + k).reshape(-1))
        offset += n
    logits = torch.cat([pool.t().reshape(-1) for pool in pools])  # (N,) key-major
    rows, frames = Segments(torch.cat(row_ids), offset), Segments(torch.cat(segment_ids), len(sizes) * keys)
    centred, b = segment_query_frame_terms(logits, rows, torch.cat(inside), frames, form)
    assert b.shape == (1, len(sizes) * keys)
    b = b[0].reshape(len(sizes), keys)
    every_key = np.ones(keys, dtype=bool)
    start = 0
    for frame, (pool, rows_in) in enumerate(zip(pools, inside, strict=True)):
        x = pool.numpy()
        expected = _reference(x, rows_in.numpy(), every_key, form) if rows_in.any() else np.zeros(keys)
        np.testing.assert_allclose(b[frame].numpy(), expected, rtol=1e-12, atol=1e-12)
        mine = centred[start : start + x.size].reshape(keys, -1).t().numpy()
        np.testing.assert_allclose(mine, x - x.mean(-1, keepdims=True), rtol=1e-12, atol=1e-12)
        start += x.size
