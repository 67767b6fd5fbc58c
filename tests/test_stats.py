"""ipa_probe.statistics and ipa_probe.statistics.kernels against scipy and closed forms."""

import math
import warnings

import numpy as np
import pytest
import torch
from scipy import stats as sps

from ipa_probe.statistics import rows as rows_module
from ipa_probe.statistics.agreement import compare_weights
from ipa_probe.statistics.draws import shuffle_rows
from ipa_probe.statistics.kernels import (
    dot_logits,
    key_norm_bias,
    matched_bandwidth,
    n_eff,
    nw_logits,
    nw_weights,
    softmax_keys,
)
from ipa_probe.statistics.rows import centred_ranks, copy_groups, fit_bandwidth, rank, raveled_pearson, row_spearman
from ipa_probe.statistics.schema import STAT_NAMES


def _stat(s, name):
    return s[..., STAT_NAMES.index(name)]


@pytest.mark.parametrize("on_numpy", [True, False])  # a CPU's sort through numpy, and the searches of other devices
def test_rank_matches_scipy_with_ties(on_numpy, monkeypatch):
    monkeypatch.setattr(rows_module, "NUMPY_SORTS_CPU", on_numpy)
    x = torch.tensor([[3.0, 1.0, 1.0, 2.0, 5.0, 5.0, 5.0], [0.0, -0.0, 0.0, -0.0, 1.0, -1.0, -2.5]])  # -0 ties 0
    for row in x:
        np.testing.assert_allclose(rank(row[None])[0].numpy(), sps.rankdata(row.numpy()))
    assert torch.equal(rank(torch.zeros(3, 1)), torch.ones(3, 1)) and rank(torch.zeros(0, 4)).shape == (0, 4)
    x = torch.randint(0, 5, (3, 40, 9), generator=torch.Generator().manual_seed(0)).float()  # many ties
    expected = np.apply_along_axis(sps.rankdata, -1, x.numpy())
    np.testing.assert_array_equal(rank(x).numpy(), expected)
    x = torch.cat([x, torch.randn(3, 40, 9, generator=torch.Generator().manual_seed(1))], 1)  # rows without ties too
    np.testing.assert_array_equal(rank(x).numpy(), np.apply_along_axis(sps.rankdata, -1, x.numpy()))
    by_row = x.transpose(0, 1)  # a view whose leading dimensions do not merge: ranked as its values
    np.testing.assert_array_equal(rank(by_row).numpy(), np.apply_along_axis(sps.rankdata, -1, by_row.numpy()))
    centred = centred_ranks(x, x > 0, (x > 0).sum(-1).float(), torch.float32)  # among the kept entries, centred
    kept = np.where(x.numpy() > 0, x.numpy(), np.inf)
    ranks = np.apply_along_axis(sps.rankdata, -1, kept)
    n = (x.numpy() > 0).sum(-1, keepdims=True)
    np.testing.assert_array_equal(centred.numpy(), np.where(x.numpy() > 0, ranks - (n + 1) / 2, 0.0))


def test_rank_orders_float32_by_its_bits_as_values_do():
    # the CPU's ranks sort float32's bits as integers: -0 ties with 0, negatives (tiny, large, -inf) order by value
    tiny, big = torch.finfo(torch.float32).tiny, torch.finfo(torch.float32).max
    row = [-0.0, 0.0, tiny, -tiny, -math.inf, math.inf, -big, big, -1.5, -1.5, 2.0, -0.0, -2.0, 1e-30, -1e-30, 0.0]
    x = torch.tensor([row, row[::-1]], dtype=torch.float32)
    x = torch.cat((x, torch.randn(64, 16, generator=torch.Generator().manual_seed(1)).round(decimals=1)))  # ties
    np.testing.assert_array_equal(rank(x).numpy(), np.apply_along_axis(sps.rankdata, -1, x.numpy()))


@pytest.mark.parametrize("k", [2, 4, 16, 257])
def test_row_spearman_matches_scipy(k):
    g = torch.Generator().manual_seed(k)
    a = torch.randn(6, k, generator=g, dtype=torch.float64)
    b = a + torch.randn(6, k, generator=g, dtype=torch.float64)
    b[:, 0] = b[:, 1]  # a tie
    with warnings.catch_warnings():  # k = 2: the tie makes b constant, so both sides give NaN (scipy also warns)
        warnings.simplefilter("ignore", sps.ConstantInputWarning)
        expected = [sps.spearmanr(a[i], b[i]).statistic for i in range(6)]
    np.testing.assert_allclose(row_spearman(a, b).numpy(), expected, atol=1e-12)  # float64 sums of k ranks


def test_row_spearman_constant_row_is_nan():
    assert row_spearman(torch.ones(1, 4), torch.arange(4.0)[None]).isnan().all()


def test_raveled_pearson_matches_scipy_and_respects_mask():
    g = torch.Generator().manual_seed(1)
    a = torch.rand(3, 5, 4, generator=g, dtype=torch.float64)
    b = a + 0.3 * torch.rand(3, 5, 4, generator=g, dtype=torch.float64)
    r = raveled_pearson(a, b)
    for i in range(3):
        assert r[i].item() == pytest.approx(sps.pearsonr(a[i].ravel(), b[i].ravel()).statistic, abs=1e-12)  # float64
    mask = torch.tensor([True, False, True, True, False]).expand(3, 5)
    rm = raveled_pearson(a, b, mask)
    assert rm[0].item() == pytest.approx(sps.pearsonr(a[0, mask[0]].ravel(), b[0, mask[0]].ravel()).statistic)


def test_nw_identity_float64():
    """Gaussian weights exp(-|q-k|^2/2h^2) normalised equal softmax of dot products plus the key-norm bias."""
    g = torch.Generator().manual_seed(2)
    q = torch.randn(7, 5, dtype=torch.float64, generator=g)
    k = 2 * torch.randn(9, 5, dtype=torch.float64, generator=g)
    for h in (0.3, 1.0, matched_bandwidth(5), 4.0):
        direct = torch.exp(-(torch.cdist(q, k) ** 2) / (2 * h * h))
        direct = direct / direct.sum(-1, keepdim=True)
        # float64: two orders of summing exponents of size up to |k|^2 / 2h^2 ~ 1e3 differ by ~1e-13
        torch.testing.assert_close(nw_weights(q, k, h), direct, rtol=0, atol=1e-12)
        biased = torch.softmax(dot_logits(q, k, 1 / h**2) + key_norm_bias(k, h), -1)
        torch.testing.assert_close(biased, direct, rtol=0, atol=1e-12)


@pytest.mark.parametrize("keys", [1, 4, 8, 15, 16, 77])
def test_softmax_keys_equals_the_float64_softmax(keys):
    """The key-axis softmax (a transposed copy for short rows on the CPU) against exp / sum in float64, on rows with
    a large common offset and -inf entries (masked keys)."""
    g = torch.Generator().manual_seed(keys)
    logits = 30 * torch.randn(2, 3, 50, keys, generator=g) + 100
    if keys > 1:
        logits[..., 0, 1:] = -math.inf  # one row with one finite key: weight exactly 1 there
    got = softmax_keys(logits)
    assert got.shape == logits.shape
    x = logits.double()
    e = torch.exp(x - x.amax(-1, keepdim=True))
    want = e / e.sum(-1, keepdim=True)
    # float32 exp and sum over at most 77 terms in [0, 1]: errors ~1e-7 absolute; 1e-6 leaves 10x room
    torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-6)
    if keys > 1:
        assert torch.all(got[..., 0, 0] == 1.0) and torch.all(got[..., 0, 1:] == 0.0)


def test_equal_key_norms_give_rho_one_and_zero_kl_at_matched_bandwidth():
    # float64: in float32 two keys within rounding of each other could rank differently on the two sides (a
    # near-tie, see helpers.near_ties); at float64 no two of these random logits come that close
    g = torch.Generator().manual_seed(3)
    q = torch.randn(4, 50, 16, generator=g, dtype=torch.float64)
    k = torch.randn(4, 6, 16, generator=g, dtype=torch.float64)
    k = 3 * k / k.norm(dim=-1, keepdim=True)
    s = compare_weights(dot_logits(q, k), nw_logits(q, k, matched_bandwidth(16)))
    torch.testing.assert_close(_stat(s, "spearman"), torch.ones(4))
    torch.testing.assert_close(_stat(s, "pearson"), torch.ones(4))
    assert (_stat(s, "kl").abs() < 1e-6).all()  # the statistics are returned in float32
    assert (_stat(s, "top1") == 1).all()


def test_copies_tie_in_spearman_whatever_their_last_bits():
    """Two copies of each token whose NW logits differ in the last bits (as another kernel may round them) still tie:
    the ranks are taken on each group's first copy, so rho is exactly 1, as in exact arithmetic."""
    g = torch.Generator().manual_seed(9)
    q = torch.randn(2, 30, 8, generator=g)
    keys = torch.randn(2, 4, 8, generator=g).repeat(1, 2, 1)  # (2, 8, 8): keys 4..7 copy keys 0..3
    attn = dot_logits(q, keys)
    nw = attn.clone()
    nw[..., 4:] = torch.nextafter(nw[..., 4:], torch.tensor(math.inf))  # one ulp up, the second copies only
    groups = copy_groups(keys).unsqueeze(-2)  # (2, 1, 8)
    assert groups[0, 0].tolist() == [0, 1, 2, 3, 0, 1, 2, 3]
    assert (_stat(compare_weights(attn, nw, key_groups=groups), "spearman") == 1).all()
    assert (_stat(compare_weights(attn, nw), "spearman") < 1 - 1e-3).all()  # split on one side, tied on the other


def test_an_edited_attention_ranks_the_copies_it_weighted_apart():
    """Three copies of each token that an edit weighted 1 : 2 : 2 (the NW side's copies alike), their logits apart in
    the last bits on both sides: with ``apart`` rho is scipy's of the float64 weights (copies tied where the weights
    are equal: the last two on the attention side, all three on the NW side); top-1 counts any copy as the token."""
    from ipa_probe.statistics.agreement import compare_frames

    g = torch.Generator().manual_seed(3)
    q, token_keys = torch.randn(2, 30, 8, generator=g, dtype=torch.float64), torch.randn(2, 4, 8, generator=g)
    factor = torch.tensor([1.0, 2.0, 2.0], dtype=torch.float64).repeat_interleave(4)
    a = (dot_logits(q, token_keys.double()).softmax(-1).repeat(1, 1, 3) * factor).log_softmax(-1)  # (2, 30, 12)
    w = nw_logits(q, token_keys.double(), 1.0).log_softmax(-1).repeat(1, 1, 3)  # copies bit-equal in float64
    attn, nw = a.float(), w.float()
    attn[..., 8:], nw[..., 4:] = (torch.nextafter(x, torch.tensor(math.inf)) for x in (attn[..., 8:], nw[..., 4:]))
    groups = copy_groups(token_keys.repeat(1, 3, 1)).unsqueeze(-2)  # (2, 1, 12)
    assert rows_module.weighted_alike(attn, groups)[0, 0].unique().numel() == 8  # 4 tokens, the 2 weightings each
    frames = [(nw, None, torch.Generator().manual_seed(0))]
    got = compare_frames(attn, frames, key_groups=groups, apart=True)[0]
    rho = [[sps.spearmanr(x, y).statistic for x, y in zip(ax, wx, strict=True)] for ax, wx in zip(a, w, strict=True)]
    torch.testing.assert_close(_stat(got, "spearman").double(), torch.tensor(rho).mean(-1), rtol=0, atol=1e-6)
    top1 = (a.argmax(-1) % 4 == w.argmax(-1) % 4).double().mean(-1)
    torch.testing.assert_close(_stat(got, "top1").double(), top1, rtol=0, atol=1e-6)
    grouped = compare_frames(attn, frames, key_groups=groups)[0]  # every copy on its first copy's weight: another rho
    assert (_stat(grouped, "spearman") - _stat(got, "spearman")).abs().min() > 1e-2


def test_rank_statistics_do_not_depend_on_bandwidth():
    g = torch.Generator().manual_seed(4)
    q = torch.randn(2, 40, 8, generator=g, dtype=torch.float64)
    k = torch.randn(2, 5, 8, generator=g, dtype=torch.float64) * torch.rand(2, 5, 1, generator=g) * 3
    rhos = [_stat(compare_weights(dot_logits(q, k), nw_logits(q, k, h)), "spearman") for h in (0.2, 1.0, 7.0)]
    for rho in rhos[1:]:
        torch.testing.assert_close(rho, rhos[0])


def test_permutation_null_near_zero():
    g = torch.Generator().manual_seed(5)
    a = torch.randn(20_000, 8, generator=g)
    s = compare_weights(a, a.clone())
    assert _stat(s, "spearman").item() == pytest.approx(1.0)
    assert abs(_stat(s, "spearman_null").item()) < 0.02


@pytest.mark.parametrize("k", [2, 3, 4, 5])
def test_null_shuffles_draw_every_permutation_equally_often(k):
    """At few keys every one of the K! permutations is drawn, each about equally often (chi-square over all K!
    cells, 0.1 % level: a fixed seed, so this either always passes or never)."""
    n = 200 * math.factorial(k)
    rows = torch.arange(k, dtype=torch.float32).expand(n, k)
    shuffled = shuffle_rows(rows, torch.Generator().manual_seed(10 + k)).long()
    codes = (shuffled * k ** torch.arange(k)).sum(-1)  # the permutation as a base-K number
    counts = codes.bincount(minlength=k**k)
    counts = counts[counts > 0].numpy()
    assert len(counts) == math.factorial(k)  # every permutation, and nothing that is not one (checked below)
    assert torch.equal(shuffled.sort(-1).values, rows.long())
    assert sps.chisquare(counts).pvalue > 1e-3


@pytest.mark.parametrize("k", [4, 9, 64])
def test_null_shuffles_are_uniform_permutations(k):
    """Every row gets an independent uniformly random permutation: the first two positions' keys are uniform over
    the K (K - 1) ordered pairs (chi-square, 0.1 % level: a fixed seed, so this either always passes or never)."""
    n = 30_000
    rows = torch.arange(k, dtype=torch.float32).expand(n, k)
    shuffled = shuffle_rows(rows, torch.Generator().manual_seed(k)).long()
    assert torch.equal(shuffled.sort(-1).values, rows.long())
    pairs = (shuffled[:, 0] * k + shuffled[:, 1]).bincount(minlength=k * k).reshape(k, k)
    counts = pairs[~torch.eye(k, dtype=torch.bool)].numpy()
    assert (pairs.diagonal() == 0).all()
    assert sps.chisquare(counts).pvalue > 1e-3


def test_null_shuffle_of_a_prefix_is_uniform_and_leaves_the_rest():
    """With a prefix mask (kept keys first, as the key mask's reordering makes them), each row's kept entries get a
    uniformly random permutation among themselves and the left-out entries stay where they were: the kept entry that
    lands first is uniform over the kept ones (chi-square, 0.1 % level, fixed seed)."""
    n, k = 40_000, 12
    kept = torch.arange(n) % 4 + 5  # 5..8 kept keys per row
    prefix = torch.arange(k) < kept[:, None]
    rows = torch.arange(k, dtype=torch.float32).expand(n, k)
    shuffled = shuffle_rows(rows, torch.Generator().manual_seed(3), prefix).long()
    assert torch.equal(torch.where(prefix, -1, shuffled), torch.where(prefix, -1, rows.long()))  # the rest in place
    assert torch.equal(torch.where(prefix, shuffled, k).sort(-1).values, torch.where(prefix, rows.long(), k))
    for m in (5, 8):
        first = shuffled[kept == m, 0].bincount(minlength=m).numpy()
        assert len(first) == m and sps.chisquare(first).pvalue > 1e-3


@pytest.mark.parametrize("on_numpy", [True, False])
def test_null_permutation_is_the_keys_stable_argsort(on_numpy, monkeypatch):
    """Each row's permutation sorts its keys, ties in place order (numpy's stable argsort, the test's own), whichever
    way the CPU sorts, a prefix mask's left-out entries kept in place: the same draw on every path."""
    monkeypatch.setattr(rows_module, "NUMPY_SORTS_CPU", on_numpy)
    g = torch.Generator().manual_seed(5)
    keys = (torch.rand(200, 64, generator=g) * 16).floor() / 16  # many ties among the keys
    prefix = torch.arange(64) < torch.randint(1, 65, (200, 1), generator=g)
    expected = np.argsort(np.where(prefix.numpy(), keys.numpy(), 1 + np.arange(64)), axis=-1, kind="stable")
    rows = torch.arange(64.0).expand(200, 64)
    assert torch.equal(shuffle_rows(rows, keys, prefix), torch.from_numpy(expected).float())


@pytest.mark.parametrize("k", [6, 12])
def test_null_shuffle_draws_per_generator_as_alone(k):
    """Frames stacked on the leading dimension with their own generators draw what each draws for its frames alone."""
    w = torch.randn(3, 5, 7, k, generator=torch.Generator().manual_seed(0))
    stacked = shuffle_rows(w, [(torch.Generator().manual_seed(1), 1), (torch.Generator().manual_seed(2), 2)])
    alone = [
        shuffle_rows(w[:1], torch.Generator().manual_seed(1)),
        shuffle_rows(w[1:], torch.Generator().manual_seed(2)),
    ]
    assert torch.equal(stacked, torch.cat(alone))


def test_global_rng_untouched():
    x, y = torch.randn(3, 10, 4), torch.randn(3, 10, 4)
    state = torch.get_rng_state()
    compare_weights(x, y)
    assert torch.equal(state, torch.get_rng_state())


def test_nonfinite_rows_are_flagged_not_raised():
    a = torch.randn(1, 10, 4)
    a[0, 3, 1] = math.nan
    a[0, 4] = -math.inf
    s = compare_weights(a, a.clone())
    assert _stat(s, "nonfinite").item() == pytest.approx(0.2)
    assert _stat(s, "spearman").item() == pytest.approx(1.0)


def test_kl_top1_neff_by_hand():
    p = torch.tensor([[[0.7, 0.2, 0.1]]]).log()
    w = torch.tensor([[[0.2, 0.7, 0.1]]]).log()
    s = compare_weights(p, w)[0]
    kl = 0.7 * math.log(0.7 / 0.2) + 0.2 * math.log(0.2 / 0.7)
    assert _stat(s, "kl").item() == pytest.approx(kl, rel=1e-5)
    assert _stat(s, "top1").item() == 0
    assert _stat(s, "neff_attn").item() == pytest.approx(1 / (0.49 + 0.04 + 0.01), rel=1e-5)
    assert n_eff(torch.full((4,), 0.25)).item() == pytest.approx(4.0)


def test_fit_bandwidth_recovers_the_generating_bandwidth():
    g = torch.Generator().manual_seed(6)
    q = torch.randn(3, 200, 8, generator=g, dtype=torch.float64)
    k = (
        torch.randn(3, 6, 8, generator=g, dtype=torch.float64)
        * torch.linspace(0.5, 2, 6, dtype=torch.float64)[:, None]
    )
    true_h = torch.tensor([0.8, 1.7, 3.0], dtype=torch.float64)
    attn = nw_logits(q, k, true_h[:, None, None])
    h = fit_bandwidth(attn, q @ k.transpose(-1, -2) - (k * k).sum(-1).unsqueeze(-2) / 2, center=1.7)
    torch.testing.assert_close(h.double(), true_h, rtol=0.03, atol=0)


def test_key_mask_equals_dropping_the_keys():
    g = torch.Generator().manual_seed(7)
    q = torch.randn(3, 30, 8, generator=g, dtype=torch.float64)
    k = torch.randn(3, 9, 8, generator=g, dtype=torch.float64) * torch.rand(3, 9, 1, generator=g, dtype=torch.float64)
    keep = torch.tensor([True, False, True, True, False, True, True, True, False])
    attn, nw = dot_logits(q, k), nw_logits(q, k, 1.3)
    masked = compare_weights(attn, nw, key_mask=keep)
    dropped = compare_weights(attn[..., keep], nw[..., keep])
    names = [n for n in STAT_NAMES if n != "spearman_null"]
    idx = [STAT_NAMES.index(n) for n in names]
    torch.testing.assert_close(masked[..., idx], dropped[..., idx], rtol=1e-6, atol=1e-9)
    assert (_stat(masked, "spearman_null").abs() < 0.3).all()
    # a per-row mask (ragged key counts) also matches dropping row by row
    row_keep = torch.ones(3, 30, 9, dtype=torch.bool)
    row_keep[:, :, 6:] = False
    row_keep[:, 10:, 4:] = False
    s = compare_weights(attn, nw, key_mask=row_keep)
    rho_rows = torch.cat(
        [row_spearman(attn[:, :10, :6], nw[:, :10, :6]), row_spearman(attn[:, 10:, :4], nw[:, 10:, :4])], 1
    )
    torch.testing.assert_close(_stat(s, "spearman").double(), rho_rows.mean(-1), rtol=1e-6, atol=1e-9)


def test_nw_logits_keep_float32_precision_under_a_common_offset():
    g = torch.Generator().manual_seed(8)
    q = torch.randn(20, 6, generator=g, dtype=torch.float64)
    k = torch.randn(5, 6, generator=g, dtype=torch.float64)
    offset = torch.full((6,), 1e3, dtype=torch.float64)
    exact = nw_weights(q, k, 0.7)
    shifted = nw_weights((q + offset).float(), (k + offset).float(), 0.7)
    torch.testing.assert_close(shifted.double(), exact, atol=1e-3, rtol=0)


def test_top1_counts_an_argmax_on_any_copy_of_one_token_as_agreement():
    """Copies of one token (several reference images' unconditional tokens) differ only by float noise; which copy
    each weighting's arg-max lands on must not decide ``top1``."""
    from ipa_probe.statistics.kernels import dot_logits, nw_logits
    from ipa_probe.statistics.rows import copy_groups

    q = torch.tensor([[[0.5, 0.0]]])  # (1, Q=1, D=2)
    k = torch.tensor([[[1.0, 0.0], [1.0 + 1e-6, 0.0], [-1.0, 0.0]]])  # keys 0 and 1: one token, rounded apart
    attn, nw = dot_logits(q, k), nw_logits(q, k, 1.0)
    assert attn.argmax(-1).item() == 1 and nw.argmax(-1).item() == 0  # the two weightings pick different copies
    assert _stat(compare_weights(attn, nw), "top1").item() == 0.0
    groups = copy_groups(k)
    assert groups.tolist() == [[0, 0, 2]]
    assert _stat(compare_weights(attn, nw, key_groups=groups.unsqueeze(-2)), "top1").item() == 1.0
