"""The ``mixed`` recipe: ``support`` with part of each UNet batch on mixed reference sets. Its sampler's law (a
chi-square test), ``support``'s batches unchanged by the new field, the recipe's name in configs, checkpoints and
folders, and the shipped ``mixed`` weights."""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from scipy import stats

from ipa_probe._checks import DIGITS_MIXED_FRACTION
from ipa_probe.tiny import digits as D
from ipa_probe.tiny.digits.loop import step_generator, training_digits
from ipa_probe.tiny.digits.train import _references

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def labels():
    y = training_digits()["y"]
    return y, [torch.nonzero(y == c).flatten() for c in range(10)]


def _support_sampler_before_mixed(config, gen, labels, by_class, n):
    """A frozen copy of ``support``'s reference draw as it was before ``mixed`` existed (train.py, _unet_loss)."""
    b = config.batch
    k = int(torch.randint(1, config.max_refs + 1, (), generator=gen))
    target = torch.randint(0, n, (b,), generator=gen)
    refs = torch.empty(b, k, dtype=torch.long)
    for i, t in enumerate(target.tolist()):
        pool = by_class[int(labels[t])]
        pool = pool[pool != t]
        refs[i] = pool[torch.randperm(len(pool), generator=gen)[:k]]
    return refs, target


@pytest.mark.parametrize("seed", [0, 1, 7])
def test_support_batches_are_those_drawn_before_the_mixed_field(labels, seed):
    y, by_class = labels
    config = D.DigitsTrainConfig(seed=seed)
    assert config.mixed == 0.0 and config.recipe == "support"
    for step in (0, 1, 799):
        new, old = step_generator(seed, "unet", step), step_generator(seed, "unet", step)
        refs, target = _references(config, new, y, by_class, len(y))
        refs_old, target_old = _support_sampler_before_mixed(config, old, y, by_class, len(y))
        assert torch.equal(refs, refs_old) and torch.equal(target, target_old)
        # the generator is left where it was, so the noise and dropping draws that follow are the same too
        assert torch.equal(torch.rand(8, generator=new), torch.rand(8, generator=old))


def _mixed_draws(labels, mixed: float, calls: int, batch: int = 256):
    y, by_class = labels
    config = D.DigitsTrainConfig(mixed=mixed, batch=batch)
    draws = []
    for call in range(calls):
        refs, target = _references(config, step_generator(3, "unet", call), y, by_class, len(y))
        draws.append((refs, target))
    return draws


def test_mixed_sets_follow_the_support_set_posterior(labels):
    """Given a set, the target's digit is c with probability count(c) / k: tested per count pattern with a
    chi-square goodness of fit on the count of the target's digit in its set.

    Within a pattern (the set's digit counts, sorted, e.g. (2, 1) for k = 3), P(target's digit has count m) =
    m * (number of digits with count m) / k. The pattern (k,) (all one digit) is left out: support items have it
    too, with probability 1 of the target's digit, which the test below checks.
    """
    y, _ = labels
    draws = _mixed_draws(labels, mixed=0.5, calls=120)
    observed: dict[tuple, Counter] = {}
    uniform: dict[tuple, Counter] = {}  # the power check's law: the target's digit uniform among the set's digits
    slots = Counter()  # sets of k distinct digits: which slot holds the target's digit
    rng = np.random.default_rng(0)
    refs_classes = []
    for refs, target in draws:
        ref_y, target_y = y[refs].numpy(), y[target].numpy()  # (B, k), (B,)
        assert not (refs == target[:, None]).any()  # the target is never one of its references
        for row, t, r in zip(ref_y, target_y, refs.tolist(), strict=True):
            assert len(set(r)) == len(r)  # distinct images
            counts = Counter(row.tolist())
            assert t in counts  # the target's digit is one of the references'
            if len(counts) == 1:
                continue
            pattern = tuple(sorted(counts.values(), reverse=True))
            observed.setdefault(pattern, Counter())[counts[t]] += 1
            if len(counts) == len(row):
                slots[(len(row), row.tolist().index(t))] += 1
            wrong = rng.choice(sorted(counts))
            uniform.setdefault(pattern, Counter())[counts[wrong]] += 1
            refs_classes.extend(row.tolist())
    tested = 0
    for pattern, counter in observed.items():
        n = sum(counter.values())
        if len(set(pattern)) == 1:  # one cell: nothing to test (the slot test below covers distinct digits)
            continue
        cells = sorted(set(pattern))
        expected = np.array([m * pattern.count(m) / sum(pattern) for m in cells]) * n
        # every expected count >= 20 (the chi-square's approximation is good from about 5); (3, 1) is the rarest
        assert expected.min() >= 20, (pattern, n)
        # p > 1e-3: the draws are seeded, so the outcome is fixed; a right sampler fails for 0.1% of seeds
        assert stats.chisquare([counter[m] for m in cells], expected).pvalue > 1e-3, (pattern, counter)
        # the test has power: a target digit uniform among the set's distinct digits is rejected on these sizes
        wrong = uniform[pattern]
        assert stats.chisquare([wrong[m] for m in cells], expected * sum(wrong.values()) / n).pvalue < 1e-6
        tested += 1
    assert tested >= 3  # (2, 1), (2, 1, 1), (3, 1) at least
    # k distinct digits: the target takes each slot's digit with probability 1 / k (the count test cannot see this)
    for k in (2, 3, 4):
        seen = [slots[(k, j)] for j in range(k)]
        assert sum(seen) >= 200 and stats.chisquare(seen).pvalue > 1e-3, (k, seen)
    # each reference's digit is uniform over the 10 (mixed items only: sets of two or more digits, which tilt no digit)
    counts = np.bincount(refs_classes, minlength=10)
    assert stats.chisquare(counts).pvalue > 1e-3


def test_mixed_fraction_of_items_and_support_items(labels):
    """Items whose set holds two or more digits are mixed ones: their number is binomial with p = mixed * P(a mixed
    set of k uniform digits is not all one digit) = mixed * (1 - 10^(1 - k)); the others are support items or
    one-digit mixed sets, all of the target's digit."""
    y, _ = labels
    draws = _mixed_draws(labels, mixed=0.5, calls=60)
    several, p = 0, []
    for refs, target in draws:
        ref_y, target_y = y[refs], y[target]  # (B, k), (B,)
        k = refs.shape[1]
        one_digit = (ref_y == ref_y[:, :1]).all(dim=1)
        assert torch.equal(ref_y[one_digit], target_y[one_digit, None].expand(-1, k))
        several += int((~one_digit).sum())
        p += [0.5 * (1 - 10.0 ** (1 - k))] * len(target)
    # the sum of independent Bernoullis: two-sided normal test at 1e-3 (the draws are seeded; see above)
    mean, var = sum(p), sum(q * (1 - q) for q in p)
    assert abs(several - mean) / var**0.5 < stats.norm.isf(5e-4)


def test_mixed_setting_names_the_recipe_and_is_checked():
    assert D.RECIPES == ("support", "ip-adapter", "mixed") and DIGITS_MIXED_FRACTION == 0.5
    assert "mixed" not in D.DigitsTrainConfig().to_dict()  # a support record and checkpoint as before the field
    config = D.DigitsTrainConfig(mixed=DIGITS_MIXED_FRACTION)
    assert config.recipe == "mixed" and config.to_dict()["mixed"] == 0.5
    for bad in (-0.1, 1.0, "0.5", True):
        with pytest.raises(ValueError, match="mixed"):
            D.DigitsTrainConfig(mixed=bad)


@pytest.mark.slow
def test_a_support_checkpoint_is_not_resumed_as_mixed_and_folders_name_their_recipe(tmp_path):
    tiny = {"vae_steps": 1, "encoder_steps": 1, "steps": 2, "batch": 4, "checkpoint_every": 1, "threads": 1}
    D.train_digits(tmp_path / "s", D.DigitsTrainConfig(**tiny), progress=False, stop_after=1)
    with pytest.raises(D.CheckpointError, match="of the 'support' training, not 'mixed'"):
        D.train_digits(tmp_path / "s", D.DigitsTrainConfig(**tiny, mixed=0.5), progress=False)
    record = D.train_digits(tmp_path / "m", D.DigitsTrainConfig(**tiny, mixed=0.5), progress=False)
    assert record["recipe"] == "mixed" and record["config"]["mixed"] == 0.5
    with pytest.raises(ValueError, match="got a 'mixed' one; pass recipe='mixed'"):
        D.digits_pipeline(tmp_path / "m", recipe="support")
    assert D.digits_pipeline(tmp_path / "m").unet.encoder_hid_proj is not None  # the folder's own recipe


@pytest.mark.slow
def test_train_digits_command_trains_the_mixed_recipe(tmp_path, capsys):
    from ipa_probe.cli import main

    out = tmp_path / "mixed"
    argv = ["train-digits", "--recipe", "mixed", "--out", str(out), "--no-progress", "--threads", "1"]
    assert main([*argv, "--vae-steps", "1", "--encoder-steps", "1", "--steps", "1", "--batch", "4"]) == 0
    record = json.loads((out / "record.json").read_text())
    assert record["recipe"] == "mixed" and record["config"]["mixed"] == DIGITS_MIXED_FRACTION
    capsys.readouterr()
    assert main(["train-digits", "--recipe", "mixed", "--stage", "base", "--out", str(tmp_path / "x")]) == 2
    assert "--stage and --base apply to --recipe ip-adapter only" in capsys.readouterr().err


# --------------------------------------------------------------------------- the shipped mixed weights


@pytest.fixture(scope="module")
def mixed_organism():
    return D.digits_pipeline(recipe="mixed")


def test_shipped_mixed_weights_are_a_clean_run_of_the_mixed_recipe(mixed_organism):
    record = json.loads((D.DIGITS_MIXED_WEIGHTS / "record.json").read_text())
    assert record["finished"] and record["resumed"] == 0 and record["recipe"] == "mixed"
    assert record["config"] == D.DigitsTrainConfig(mixed=DIGITS_MIXED_FRACTION).to_dict()
    assert (D.DIGITS_MIXED_WEIGHTS / "loss.png").stat().st_size > 1000
    assert not list(D.DIGITS_MIXED_WEIGHTS.rglob("checkpoint*"))  # the checkpoint is not shipped
    pipe = mixed_organism
    assert pipe.vae.config.scaling_factor == pytest.approx(record["scaling_factor"])
    ip = [p for n, p in pipe.unet.attn_processors.items() if n.endswith("attn2.processor")]
    shipped = load_file(str(D.DIGITS_MIXED_WEIGHTS / "ip_adapter" / D.WEIGHT_NAME))
    assert len(ip) == 10  # support's architecture
    for n, proc in enumerate(ip):
        assert torch.equal(proc.to_k_ip[0].weight, shipped[f"ip_adapter.{2 * n + 1}.to_k_ip.weight"])
    support = load_file(str(D.DIGITS_WEIGHTS / "ip_adapter" / D.WEIGHT_NAME))
    assert not torch.equal(shipped["ip_adapter.1.to_k_ip.weight"], support["ip_adapter.1.to_k_ip.weight"])
    # the stages before the UNet's do not see ``mixed``: the shipped VAE and text encoder are support's, bit for bit
    for part in ("vae/diffusion_pytorch_model.safetensors", "text_encoder/model.safetensors"):
        ours, theirs = (load_file(str(root / "model" / part)) for root in (D.DIGITS_MIXED_WEIGHTS, D.DIGITS_WEIGHTS))
        assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours), part
    with pytest.raises(ValueError, match="got a 'mixed' one; pass recipe='mixed'"):
        D.digits_pipeline(D.DIGITS_MIXED_WEIGHTS, recipe="support")
    with pytest.raises(ValueError, match="got a 'support' one; pass recipe='support'"):
        D.digits_pipeline(D.DIGITS_WEIGHTS, recipe="mixed")


def test_shipped_mixed_organism_generates_and_has_an_untrained_control(mixed_organism):
    pipe = mixed_organism
    pipe.set_progress_bar_config(disable=True)
    refs = D.digits_reference_images(3, 2)
    out = pipe(D.DIGITS_PROMPT, ip_adapter_image=[refs], num_inference_steps=2, output_type="np")
    assert out.images.shape == (1, 16, 16, 3) and np.isfinite(out.images).all()
    untrained = D.untrained_digits_pipeline(recipe="mixed")
    record = json.loads((D.DIGITS_MIXED_WEIGHTS / "record.json").read_text())
    assert untrained.vae.config.scaling_factor == pytest.approx(record["scaling_factor"])
    same = D.untrained_digits_pipeline(recipe="support").unet.state_dict()  # same architecture and initial weights
    assert all(torch.equal(v, same[k]) for k, v in untrained.unet.state_dict().items())


# --------------------------------------------------------------------------- the records' tables in docs/organism.md


def _t_interval(values, bounds=(0.0, 1.0)):
    """Mean and Student's t 95% interval over seeds, recomputed with scipy (cut to ``bounds`` when given)."""
    x = np.asarray(values, dtype=np.float64)
    half = stats.t.ppf(0.975, len(x) - 1) * x.std(ddof=1) / np.sqrt(len(x))
    low, high = x.mean() - half, x.mean() + half
    return (x.mean(), *(np.clip([low, high], *bounds) if bounds else (low, high)))


def _page_rows(prefixes):
    """The cells of docs/organism.md's table rows that start with each prefix, as floats."""
    page = (ROOT / "docs" / "organism.md").read_text()
    rows = {}
    for line in page.splitlines():
        for prefix in prefixes:
            if line.startswith(f"| {prefix} |"):
                cells = line.split("|")[2:-1]
                rows[prefix] = [[float(v) for v in re.findall(r"[−-]?\d+\.\d+", c.replace("−", "-"))] for c in cells]
    assert set(rows) == set(prefixes), set(prefixes) - set(rows)
    return rows


RECIPES_IN_TABLES = ("support", "ip-adapter", "mixed")


def test_the_mixed_references_table_is_recomputed_from_the_records_labels():
    """organism.md's mixed-reference table, every column, from the labels in mixed_references.json."""
    from pathlib import Path

    record = json.loads(
        (Path(__file__).resolve().parents[1] / "docs/results/digits/mixed_references.json").read_text()
    )
    rows = _page_rows(
        (
            "one-digit sets: output is the references' digit",
            "mixed sets (digits d, d + 3, d + 6): output is one of the three",
            "mixed sets: the first / second / third reference's digit",
            "one-digit minus mixed (paired by seed)",
        )
    )
    for column, recipe in enumerate(RECIPES_IN_TABLES):
        by_seed: dict[int, dict[str, list]] = {}
        for entry in record[recipe]["labels"]:
            labels, d = np.asarray(entry["labels"]), entry["digit"]
            seen = by_seed.setdefault(entry["seed"], {"same": [], "any": [], "positions": []})
            if entry["kind"] == "same":
                seen["same"].extend(labels == d)
            else:
                given = [(d + 3 * j) % 10 for j in range(3)]
                seen["any"].extend(np.isin(labels, given))
                seen["positions"].extend(labels[:, None] == np.asarray(given)[None])
        seeds = sorted(by_seed)
        same = [np.mean(by_seed[s]["same"]) for s in seeds]
        any_ = [np.mean(by_seed[s]["any"]) for s in seeds]
        positions = [np.mean([np.mean(np.asarray(by_seed[s]["positions"])[:, j]) for s in seeds]) for j in range(3)]
        # the page rounds to 2 decimals
        np.testing.assert_allclose(rows["one-digit sets: output is the references' digit"][column], _t_interval(same),
                                   atol=0.005 + 1e-9)  # fmt: skip
        np.testing.assert_allclose(
            rows["mixed sets (digits d, d + 3, d + 6): output is one of the three"][column], _t_interval(any_),
            atol=0.005 + 1e-9,
        )  # fmt: skip
        np.testing.assert_allclose(rows["mixed sets: the first / second / third reference's digit"][column],
                                   positions, atol=0.005 + 1e-9)  # fmt: skip
        diff = _t_interval(np.subtract(same, any_), bounds=None)
        np.testing.assert_allclose(rows["one-digit minus mixed (paired by seed)"][column], diff, atol=0.005 + 1e-9)


def test_the_counts_table_is_recomputed_from_the_records_labels():
    """organism.md's 2 + 1 table, every column, from the labels in mixed_counts.json."""
    record = json.loads((ROOT / "docs/results/digits/mixed_counts.json").read_text())
    prefixes = ("output is d", "output is d + 5", "neither",
                "d's share of the outputs that are d or d + 5 (in proportion: 0.67)")  # fmt: skip
    rows = _page_rows(prefixes)
    for column, recipe in enumerate(RECIPES_IN_TABLES):
        two, one, neither = {}, {}, {}
        for entry in record[recipe]["labels"]:
            labels, d, e = np.asarray(entry["labels"]), entry["digit"], entry["lone"]
            assert e == (d + 5) % 10
            for store, hits in ((two, labels == d), (one, labels == e), (neither, ~np.isin(labels, [d, e]))):
                store.setdefault(entry["seed"], []).extend(hits)
        seeds = sorted(two)
        per = [[np.mean(store[s]) for s in seeds] for store in (two, one, neither)]
        share = [t / (t + o) for t, o in zip(per[0], per[1], strict=True)]
        for prefix, values in zip(prefixes, [*per, share], strict=True):
            # the page rounds to 2 decimals
            np.testing.assert_allclose(rows[prefix][column], _t_interval(values), atol=0.005 + 1e-9, err_msg=prefix)
