"""The training protocol of the paper's release: schedule, time sampling, validation and the best checkpoint."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy import stats as sstats
from scipy.spatial.distance import cdist

from ipa_probe.experiments import ExperimentContext, ModelConfig, TrainConfig, make_meta, train
from ipa_probe.experiments.checkpoint import load_checkpoint
from ipa_probe.experiments.tiers import GPU_TIERS, TIERS, get_tier
from ipa_probe.experiments.training import CHECKPOINT, VAL_SEED, build_scheduler, sample_time, validation_tasks

TINY_MODEL = ModelConfig(dim=2, d_model=16, n_heads=2, n_layers=1)
TINY_VAL = TrainConfig(
    steps=8,
    batch_tasks=4,
    n_target=16,
    m=5,
    m_max=12,
    warmup=3,
    lr=0.1,  # large and constant: the validation MMD² rises again, so the best step is not the last
    checkpoint_every=3,
    schedule="constant",
    eval_every=2,
    val_tasks=3,
    val_points=24,
    val_euler_steps=20,
)


# ------------------------------------------------------------------------------------------------------ schedule
@pytest.mark.parametrize("schedule", ["cosine", "constant"])
def test_schedule_follows_the_closed_form(schedule):
    steps, warmup, peak = 40, 8, 2e-3
    cfg = TrainConfig(steps=steps, warmup=warmup, lr=peak, schedule=schedule)
    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.AdamW([param], lr=peak)
    scheduler = build_scheduler(optimizer, cfg)
    used = []
    for _ in range(steps):
        used.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    k = np.arange(steps, dtype=np.float64)
    # the release's warm-up max(k, 1) / warmup, then constant or half a cosine period down to zero
    after = 0.5 * (1 + np.cos(np.pi * (k - warmup) / (steps - warmup))) if schedule == "cosine" else np.ones(steps)
    expected = peak * np.where(k < warmup, np.maximum(k, 1) / warmup, after)
    np.testing.assert_allclose(used, expected, rtol=1e-12, atol=0)
    assert used[warmup] == pytest.approx(peak)
    if schedule == "cosine":
        assert used[-1] < 0.01 * peak and all(a >= b for a, b in zip(used[warmup:], used[warmup + 1 :], strict=False))


def test_bad_protocol_settings_raise():
    with pytest.raises(ValueError, match="schedule"):
        TrainConfig(schedule="linear")
    with pytest.raises(ValueError, match="time_sampling"):
        TrainConfig(time_sampling="beta")
    with pytest.raises(ValueError, match="eval_every"):
        TrainConfig(eval_every=-1)


# ------------------------------------------------------------------------------------------------- time sampling
def test_uniform_time_sampling_is_uniform_and_clamped():
    t = sample_time((20_000, 1), torch.Generator().manual_seed(0), "uniform").double().flatten()
    assert t.min() >= 1e-5 and t.max() < 1
    assert sstats.kstest(t.numpy(), "uniform").pvalue > 1e-3


def test_log_uniform_bandwidth_sampling_makes_the_bandwidth_log_uniform():
    sigma_min = 0.01
    t = sample_time((20_000,), torch.Generator().manual_seed(1), "log_uniform_bandwidth", sigma_min).double()
    h = (1 - (1 - sigma_min) * t) / t  # the NW bandwidth sigma_t / t of each drawn time
    u = (np.log(h.numpy()) - math.log(sigma_min)) / (5.0 - math.log(sigma_min))
    assert sstats.kstest(u, "uniform").pvalue > 1e-3
    assert t.max() <= 1 and t.min() >= 1 / (math.exp(5.0) + 1 - sigma_min) - 1e-6


# ---------------------------------------------------------------------------------- validation, best checkpoint
def _mmd2_float64(x: np.ndarray, y: np.ndarray) -> float:
    """Unbiased MMD², Gaussian kernel, sigma = lower median of the full 2n x 2n distance matrix (paper §A.4)."""
    z = np.concatenate([x, y])
    d = cdist(z, z)
    flat = np.sort(d.ravel())
    sigma = flat[(flat.size - 1) // 2]
    k = np.exp(-(d**2) / (2 * sigma**2))
    n, m = len(x), len(y)
    kxx, kyy, kxy = k[:n, :n], k[n:, n:], k[:n, n:]
    return (kxx.sum() - np.trace(kxx)) / (n * (n - 1)) + (kyy.sum() - np.trace(kyy)) / (m * (m - 1)) - 2 * kxy.mean()


def _own_validation(model, meta, cfg) -> float:
    """The validation MMD² recomputed here: own Euler loop, own float64 MMD²."""
    tasks = validation_tasks(meta, cfg)
    x = torch.randn(tasks.target.shape, generator=torch.Generator().manual_seed(VAL_SEED + cfg.seed))
    grid = torch.linspace(1e-5, 1, cfg.val_euler_steps, dtype=torch.float64)
    with torch.no_grad():
        for t0, t1 in zip(grid[:-1], grid[1:], strict=True):
            x = x + float(t1 - t0) * model(x, float(t0), tasks.support).velocity
    pairs = zip(x.double().numpy(), tasks.target.double().numpy(), strict=True)
    return float(np.mean([_mmd2_float64(a, b) for a, b in pairs]))


class _Interrupt(Exception):
    pass


def test_best_checkpoint_is_the_lowest_validation_and_survives_a_resume(tmp_path):
    meta = make_meta("mixed2d", 2)
    straight = train(TINY_MODEL, TINY_VAL, meta, run_dir=tmp_path / "a", progress=False)
    assert [k for k, _ in straight.validation] == [2, 4, 6, 8]
    values = [v for _, v in straight.validation]
    assert straight.best_step == straight.validation[int(np.argmin(values))][0]
    assert straight.best_step < 5  # chosen before the interruption below, so the resume must carry it
    assert straight.best_val == min(values)
    # the returned weights are the best step's: their validation MMD² recomputed independently is the minimum
    assert _own_validation(straight.model, meta, TINY_VAL) == pytest.approx(min(values), rel=2e-3, abs=1e-5)

    def die_at_5(step, loss):
        if step == 5:  # after validations at 2 and 4; the last checkpoint is step 3
            raise _Interrupt

    with pytest.raises(_Interrupt):
        train(TINY_MODEL, TINY_VAL, meta, run_dir=tmp_path / "b", progress=False, callback=die_at_5)
    resumed = train(TINY_MODEL, TINY_VAL, meta, run_dir=tmp_path / "b", progress=False)
    assert resumed.resumed_from == 3
    assert resumed.losses == straight.losses and resumed.validation == straight.validation
    assert (resumed.best_step, resumed.best_val) == (straight.best_step, straight.best_val)
    for (name, p), q in zip(straight.model.state_dict().items(), resumed.model.state_dict().values(), strict=True):
        assert torch.equal(p, q), name
    final_a = load_checkpoint(tmp_path / "a" / CHECKPOINT)["model"]
    final_b = load_checkpoint(tmp_path / "b" / CHECKPOINT)["model"]
    assert all(torch.equal(final_a[k], final_b[k]) for k in final_a)
    assert not all(torch.equal(final_a[k], v) for k, v in straight.model.state_dict().items())


def test_without_validation_the_final_weights_are_the_result(tmp_path):
    cfg = TrainConfig(**dict(TINY_VAL.to_dict(), eval_every=0))
    result = train(TINY_MODEL, cfg, make_meta("mixed2d", 2), run_dir=tmp_path, progress=False)
    final = load_checkpoint(tmp_path / CHECKPOINT)
    assert result.validation == [] and result.best_step == 8 and final["best_model"] is None
    assert all(torch.equal(v, final["model"][k]) for k, v in result.model.state_dict().items())


def test_context_records_the_checkpoint_choice(tmp_path):
    ctx = ExperimentContext(TIERS["quick"], tmp_path, progress=False)
    ctx.trained("gmm", ctx.model_config(2), ctx.train_config(12, seed=0))
    run = next(iter(ctx.runs.values()))
    assert run["selected"] == "best validation MMD²" and [k for k, _ in run["validation"]] == [6, 12]
    assert run["best_val_mmd2"] == min(v for _, v in run["validation"])
    assert run["best_step"] in (6, 12)
    # loading the finished run again reports the same choice
    again = ExperimentContext(TIERS["quick"], tmp_path, progress=False)
    again.trained("gmm", again.model_config(2), again.train_config(12, seed=0))
    loaded = next(iter(again.runs.values()))
    assert not loaded["trained_now"] and loaded["best_step"] == run["best_step"]
    assert loaded["validation"] == run["validation"]


# --------------------------------------------------------------------------------------------------------- tiers
def test_paper_tier_has_the_papers_sizes_and_is_not_a_cpu_tier():
    tier = get_tier("paper")
    assert "paper" in GPU_TIERS and "paper" not in TIERS
    assert (tier.d_model, tier.n_layers, tier.n_heads, tier.batch_tasks, tier.n_target) == (128, 3, 4, 256, 256)
    assert (tier.lr, tier.warmup, tier.schedule, tier.eval_every) == (1e-4, 1000, "constant", 1000)
    assert (tier.collapse_steps, tier.shells_steps, tier.heads_steps) == (100_000, 50_000, 50_000)
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert ExperimentContext(tier, "unused").device.type == expected


# ------------------------------------------------------------------------------------------ scarcity vs steps
def test_scarcity_steps_scores_every_snapshot(tmp_path):
    from ipa_probe.experiments import scarcity_steps

    assert scarcity_steps.snapshot_steps(1000) == [250, 500, 1000]
    assert scarcity_steps.snapshot_steps(600, first=100) == [100, 200, 400, 600]
    tier = TIERS["quick"]
    frame = scarcity_steps.measure(tier, steps=4, out=tmp_path, progress=False, first=2)
    assert sorted(set(frame["step"])) == [2, 4] and set(frame["m"]) == set(scarcity_steps.MS)
    assert set(frame["data"]) == set(tier.scarcity_data) and len(frame) == 2 * 2 * len(tier.scarcity_data)
    # the plug-in is scored once per (data, m); the learned model changes between snapshots
    assert frame.groupby(["data", "m"])["plugin"].nunique().eq(1).all()
    assert (frame.groupby(["data", "m"])["learned"].nunique() == 2).all()
    row = frame.iloc[0]
    assert row["gain_pct"] == pytest.approx(100 * (row["plugin"] - row["learned"]) / row["plugin"])
    assert "| steps |" in scarcity_steps.table(frame)
    # every snapshot was written as measured; a second start trains nothing and returns the same rows
    assert all((tmp_path / f"rows-{data}-4.csv").exists() for data in tier.scarcity_data)
    again = scarcity_steps.measure(tier, steps=4, out=tmp_path, progress=False, first=2, datas=("digits",))
    expected = frame[frame["data"] == "digits"].reset_index(drop=True)
    assert again.equals(expected)
    assert scarcity_steps.plot(frame, tmp_path / "f.png").stat().st_size > 1000


def test_paper_tier_refuses_to_start_without_cuda(monkeypatch, tmp_path, capsys):
    from ipa_probe.cli import main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # never start the paper tier in tests
    assert main(["experiments", "collapse", "--tier", "paper", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "CUDA" in err[0] and "--tier full" in err[0]
    assert not any(tmp_path.iterdir())
