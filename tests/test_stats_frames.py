"""compare_frames' stacked pass (frames whose key terms are per key go through one call) gives each frame exactly
what compare_weights gives it alone, its own generator drawing its own null."""

from __future__ import annotations

import pytest
import torch

from ipa_probe.statistics.agreement import compare_frames, compare_weights

G, H, R, K = 2, 3, 48, 8


def records(masked: bool):
    g = torch.Generator().manual_seed(7)
    attn = torch.randn(G, H, R, K, generator=g) * 2
    stored = attn - torch.rand(G, H, 1, K, generator=g)  # (G, H, R, K)
    query = torch.stack([attn - torch.rand(G, H, 1, K, generator=g) for _ in range(2)])  # (2, G, H, R, K)
    stored_term = torch.rand(G, H, 1, K, generator=g)
    query_term = torch.rand(2, G, H, 1, K, generator=g)
    options = {}
    if masked:
        copies = torch.arange(K).expand(G, H, 1, K).clone()
        copies[..., 5] = 4  # keys 4 and 5 are copies of one token: equal logits on both sides
        for x in (attn, stored, query):
            x[..., 5] = x[..., 4]
        key_mask = torch.ones(G, H, 1, K, dtype=torch.bool)
        key_mask[1, :, :, 2] = False  # one padding key in the second group
        row_mask = torch.rand(G, H, R, generator=g) > 0.25
        attn[0, 1, 3, 6] = float("nan")  # a non-finite row, left out of everything
        options = {"key_mask": key_mask, "row_mask": row_mask, "key_groups": copies}
    return attn, (stored, stored_term), (query, query_term), options


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("replicates", [None, 8])
def test_stacked_frames_equal_each_frame_alone(masked, replicates):
    attn, (stored, stored_term), (query, query_term), options = records(masked)
    frames = [
        (stored, stored_term, torch.Generator().manual_seed(1)),
        (query, query_term, torch.Generator().manual_seed(2)),
    ]
    got_stored, got_query = compare_frames(attn, frames, replicates=replicates, **options)
    expected = [
        compare_frames(attn, [frame], replicates=replicates, **options)[0]  # one frame: no stacking
        for frame in (
            (stored, stored_term, torch.Generator().manual_seed(1)),
            (query, query_term, torch.Generator().manual_seed(2)),
        )
    ]
    # bit for bit: the same per-row values reduced over the same rows, the same draws from each generator
    assert torch.equal(got_stored.nan_to_num(-9.0), expected[0].nan_to_num(-9.0))
    assert torch.equal(got_query.nan_to_num(-9.0), expected[1].nan_to_num(-9.0))
    assert got_stored.shape[:2] == (G, H) and got_query.shape[:3] == (2, G, H)
    if replicates is None:  # and one frame alone is compare_weights of the same arguments
        alone = compare_weights(
            attn.expand(query.shape), query, torch.Generator().manual_seed(2), key_term=query_term, **options
        )
        assert torch.equal(got_query.nan_to_num(-9.0), alone.nan_to_num(-9.0))
