"""Training checkpoints of the digits organism: one atomic file, checked before use; a kill at any write resumes to
the weights of an uninterrupted run; one training per output folder."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from ipa_probe._io import OutputLocked, output_lock
from ipa_probe.tiny import digits as D
from ipa_probe.tiny.digits.checkpoint import CHECKPOINT_NAME, CheckpointError, TrainingCheckpoint, tensors_digest

# --------------------------------------------------------------------------- the checkpoint file on a toy model


def _toy(seed: int = 0):
    torch.manual_seed(seed)
    modules = {"net": torch.nn.Linear(3, 2)}
    optimizers = {"train": torch.optim.AdamW(modules["net"].parameters(), lr=0.1)}
    return modules, optimizers


def _steps(modules, optimizers, n: int) -> None:
    for _ in range(n):
        loss = modules["net"](torch.ones(1, 3)).sum()
        optimizers["train"].zero_grad()
        loss.backward()
        optimizers["train"].step()


def _state(step: int) -> dict:
    return {
        "stage": "train",
        "step": step,
        "losses": {"train": [0.5] * step},
        "wall_s": {"train": 1.0},
        "resumed": 0,
    }


def _saved(tmp_path, step: int = 2):
    modules, optimizers = _toy()
    _steps(modules, optimizers, step)
    checkpoint = TrainingCheckpoint(tmp_path, "toy", {"config": {"a": 1}}, {"train": 5})
    checkpoint.save(_state(step), modules, optimizers)
    return checkpoint, modules


def test_a_checkpoint_round_trips_and_leaves_no_temporary_file(tmp_path):
    checkpoint, trained = _saved(tmp_path)
    modules, optimizers = _toy(seed=1)  # other initial weights: all must be replaced by the file's
    state = checkpoint.load(modules, optimizers)
    assert state == _state(2)
    assert torch.equal(modules["net"].weight, trained["net"].weight)
    assert optimizers["train"].state_dict()["state"][0]["step"] == 2
    assert sorted(os.listdir(tmp_path)) == [CHECKPOINT_NAME]  # the temporary file was renamed into place
    # the digest is over exactly these tensors, recomputed here from the file with hashlib
    import hashlib

    tensors = load_file(str(tmp_path / CHECKPOINT_NAME))
    digest = hashlib.sha256()
    for key in sorted(tensors):
        value = tensors[key].contiguous()
        digest.update(f"{key}|{value.dtype}|{tuple(value.shape)}|".encode())
        digest.update(value.reshape(-1).view(torch.uint8).numpy().tobytes())
    assert tensors_digest(tensors) == digest.hexdigest()


def test_no_checkpoint_is_a_fresh_run(tmp_path):
    modules, optimizers = _toy()
    assert TrainingCheckpoint(tmp_path, "toy", {}, {"train": 5}).load(modules, optimizers) is None


def _rewrite(path, tensors=None, meta_edit=None):
    """Rewrite a checkpoint's tensors and/or its run state, keeping or recomputing the digest as asked."""
    from safetensors import safe_open

    with safe_open(str(path), "pt") as handle:
        metadata = handle.metadata()
        old = {k: handle.get_tensor(k) for k in handle.keys()}  # noqa: SIM118
    meta = json.loads(metadata["ipa_probe.digits_checkpoint"])
    tensors = old if tensors is None else tensors(old)
    if meta_edit is not None:
        meta_edit(meta, tensors)
    save_file(tensors, str(path), metadata={"ipa_probe.digits_checkpoint": json.dumps(meta)})


def _redigest(meta, tensors):
    meta["tensors_sha256"] = tensors_digest(tensors)


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda p: p.write_bytes(p.read_bytes()[:100]), "cannot be read"),
        (lambda p: p.write_bytes(b""), "cannot be read"),
        (lambda p: p.write_bytes(os.urandom(300)), "cannot be read"),
        (lambda p: save_file({"x": torch.zeros(1)}, str(p)), "not an ipa_probe training checkpoint"),
        # a tensor changed after writing: the digest no longer matches
        (lambda p: _rewrite(p, tensors=lambda t: {**t, "model/net/bias": t["model/net/bias"] + 1}), "digest"),
        # structurally wrong, with a consistent digest: a wrong shape, a missing tensor, an unknown one
        (
            lambda p: _rewrite(p, lambda t: {**t, "model/net/bias": torch.zeros(3)}, _redigest),
            "expected torch.float32 (2,)",
        ),
        (
            lambda p: _rewrite(p, lambda t: {k: v for k, v in t.items() if k != "model/net/weight"}, _redigest),
            "lacks the tensor 'model/net/weight'",
        ),
        (lambda p: _rewrite(p, lambda t: {**t, "extra": torch.zeros(1)}, _redigest), "unexpected tensor 'extra'"),
        # the run state: wrong types, a step its losses or its optimizer do not agree with, another run
        (lambda p: _rewrite(p, meta_edit=lambda m, t: m["state"].update(step="2")), "has step '2'"),
        (lambda p: _rewrite(p, meta_edit=lambda m, t: m["state"].pop("step")), "has step None"),
        (
            lambda p: _rewrite(p, meta_edit=lambda m, t: m["state"].update(step=3)),
            "records 2 losses for stage 'train', expected 3",
        ),
        (
            lambda p: _rewrite(p, meta_edit=lambda m, t: m["state"].update(step=3, losses={"train": [0.1] * 3})),
            "records 3 steps of stage 'train' but its optimizer took 2",
        ),
        (lambda p: _rewrite(p, meta_edit=lambda m, t: m["identity"].update(config={"a": 2})), "other settings"),
        (lambda p: _rewrite(p, meta_edit=lambda m, t: m.update(recipe="other")), "is of the 'other' training"),
        (lambda p: _rewrite(p, meta_edit=lambda m, t: m.pop("identity")), "no valid 'identity'"),
    ],
)
def test_a_damaged_or_foreign_checkpoint_is_refused_naming_the_file_and_nothing_is_loaded(tmp_path, damage, message):
    checkpoint, _ = _saved(tmp_path)
    damage(checkpoint.path)
    modules, optimizers = _toy(seed=1)
    before = modules["net"].weight.detach().clone()
    with pytest.raises(CheckpointError) as info:
        checkpoint.load(modules, optimizers)
    text = str(info.value)
    assert message in text and str(checkpoint.path) in text and "delete it" in text and "\n" not in text
    assert torch.equal(modules["net"].weight, before) and not optimizers["train"].state


def test_an_older_checkpoint_pair_is_refused_naming_both_files(tmp_path):
    (tmp_path / "checkpoint.json").write_text('{"stage": "vae", "step": 4}')
    save_file({"x": torch.zeros(1)}, str(tmp_path / CHECKPOINT_NAME))
    modules, optimizers = _toy()
    with pytest.raises(CheckpointError, match="older ipa_probe's checkpoint pair") as info:
        TrainingCheckpoint(tmp_path, "toy", {}, {"train": 5}).load(modules, optimizers)
    assert "checkpoint.json" in str(info.value) and CHECKPOINT_NAME in str(info.value)


# --------------------------------------------------------------------------- kills between writes, real training

#: the smallest real trainings, one per recipe step (stage 2 on a tiny stage-1 base made once per test process)
_SUPPORT = D.DigitsTrainConfig(vae_steps=1, encoder_steps=1, steps=2, batch=4, checkpoint_every=1, threads=1)
_BASE = D.DigitsBaseConfig(encoder_steps=1, steps=2, batch=4, checkpoint_every=1, threads=1)


# session-scoped (used only here): the slow kill tests run first (conftest), apart from this module's other tests,
# and a module fixture would be made again for those
@pytest.fixture(scope="session")
def tiny_base(tmp_path_factory):
    out = tmp_path_factory.mktemp("base")
    D.train_digits(out, _BASE, progress=False)
    return out


class _Killed(BaseException):
    """Stands for SIGKILL: not an Exception, so no handler in the code under test catches it."""


def _write_calls(monkeypatch, kill_at: int | None) -> list[str]:
    """Count (and at call ``kill_at`` interrupt) every write the training makes: tensors written, files flushed,
    files renamed into place, JSON and figures written. A checkpoint's ``save_file`` is named
    ``"save_file:checkpoint"``."""
    import safetensors.torch

    calls: list[str] = []

    def wrap(owner, name):
        original = getattr(owner, name)

        def counted(*args, **kwargs):
            is_checkpoint = name == "save_file" and CHECKPOINT_NAME in str(args[1] if len(args) > 1 else "")
            calls.append("save_file:checkpoint" if is_checkpoint else name)
            if kill_at is not None and len(calls) == kill_at:
                raise _Killed(name)
            return original(*args, **kwargs)

        monkeypatch.setattr(owner, name, counted)

    wrap(safetensors.torch, "save_file")
    wrap(os, "fsync")
    wrap(os, "replace")
    return calls


def _kill_points(calls: list[str]) -> list[int]:
    """The writes (1-based) to interrupt: every write, except that of a checkpoint's three (tensors written, flushed,
    renamed into place) one is taken per checkpoint, in turn (the first checkpoint's tensors, the second's flush, the
    third's rename, ...), and the last checkpoint also takes those no earlier one took. So each of the three is
    interrupted, every checkpoint is interrupted, and a resume starts once from nothing and once from each
    checkpoint (a kill at checkpoint ``j`` resumes from checkpoint ``j - 1``; one at the first write after the last
    checkpoint, from the last)."""
    starts = [i for i, name in enumerate(calls) if name == "save_file:checkpoint"]
    assert all(calls[i + 1 : i + 3] == ["fsync", "replace"] for i in starts), calls
    skipped = set()
    for j, start in enumerate(starts):
        taken = {j % 3} | (set(range(j + 1, 3)) if j == len(starts) - 1 else set())
        skipped |= {start + position for position in range(3) if position not in taken}
    return [i + 1 for i in range(len(calls)) if i not in skipped]


def _weights(out) -> dict[str, torch.Tensor]:
    files = [p for p in out.rglob("*.safetensors") if p.name != CHECKPOINT_NAME]
    return {f"{p.relative_to(out)}:{k}": v for p in files for k, v in load_file(str(p)).items()}


_STEP_FIELDS = {"support": ("vae_steps", "encoder_steps", "steps"), "adapter": ("steps",)}


def _config(kind, base):
    return (
        _SUPPORT
        if kind == "support"
        else D.DigitsAdapterConfig(base=str(base), steps=2, batch=4, max_refs=2, checkpoint_every=1, threads=1)
    )


#: the kill points of a training are shared out among this many tests, so that parallel workers share them
_PARTS = 3


@pytest.fixture(scope="session")
def uninterrupted(tiny_base, tmp_path_factory):
    """kind -> the uninterrupted run of that training (made once per test process): its record, weights, writes."""
    runs = {}

    def run(kind):
        if kind not in runs:
            out = tmp_path_factory.mktemp(f"straight_{kind}")
            with pytest.MonkeyPatch.context() as patch:
                calls = _write_calls(patch, None)
                record = D.train_digits(out, _config(kind, tiny_base), progress=False)
            runs[kind] = record, _weights(out), calls
        return runs[kind]

    return run


@pytest.mark.parametrize("kind", ["support", "adapter"])
def test_an_uninterrupted_training_checkpoints_every_step_and_every_write_is_counted(kind, uninterrupted):
    straight, _, calls = uninterrupted(kind)
    assert straight["finished"] and len(calls) > 10
    assert set(calls) == {"save_file:checkpoint", "save_file", "fsync", "replace"}
    # one checkpoint per step (checkpoint_every=1), every one of them interrupted
    checkpoints = calls.count("save_file:checkpoint")
    assert checkpoints == sum(straight["config"][field] for field in _STEP_FIELDS[kind]) >= 2
    points = _kill_points(calls)
    assert len(points) == len(calls) - 2 * checkpoints + max(0, 3 - checkpoints)
    assert all(points[part::_PARTS] for part in range(_PARTS))  # every part below kills at least once


#: (function name, digest of its inputs) -> what it returned, shared by this process's killed and resumed runs
_MEMO: dict[tuple, dict] = {}


def _cheaper_reruns(patch) -> None:
    """What the killed and resumed runs of a test redo that no assertion below reads, made cheaper with every write
    where it was: the loss figure (a blank one, written by the same ``write_figure``: its temporary file, flush and
    rename stay kill points), and the training digits' latents (``train._unet_data`` and
    ``train_ip._latents_and_prompts``, no-grad functions of the VAE's weights: computed once per distinct VAE, text
    encoder, mode and digits, so a resume that brought back other VAE weights still computes its own latents, and
    ends on other weights than the uninterrupted run's, which the test catches). The uninterrupted runs keep both."""
    import matplotlib.pyplot as plt

    from ipa_probe import _io
    from ipa_probe.tiny.digits import train, train_ip

    def blank_loss_figure(path, losses, titles):
        _io.write_figure(plt.figure(figsize=(1, 1)), path)

    def memoised(module, name):
        original = getattr(module, name)

        def once(*args):
            key = [name]
            for arg in args:
                if isinstance(arg, torch.nn.Module):
                    key += [type(arg).__name__, arg.training, tensors_digest(arg.state_dict())]
                else:
                    key.append(tensors_digest({"x": arg}))
            if tuple(key) not in _MEMO:
                _MEMO[tuple(key)] = original(*args)
            return dict(_MEMO[tuple(key)])

        patch.setattr(module, name, once)

    for module in (train, train_ip):
        patch.setattr(module, "plot_losses", blank_loss_figure)
    memoised(train, "_unet_data")
    memoised(train_ip, "_latents_and_prompts")


@pytest.mark.slow
@pytest.mark.parametrize("part", range(_PARTS))
@pytest.mark.parametrize("kind", ["support", "adapter"])
def test_a_kill_at_any_write_resumes_to_the_weights_of_an_uninterrupted_run(
    tmp_path, monkeypatch, kind, part, tiny_base, uninterrupted
):
    """Together, the parts kill at every one of the uninterrupted run's kill points (each part at every third); the
    killed and resumed runs redo less of what nothing here reads (:func:`_cheaper_reruns`)."""
    _cheaper_reruns(monkeypatch)
    config = _config(kind, tiny_base)
    straight, expected, calls = uninterrupted(kind)
    for kill_at in _kill_points(calls)[part::_PARTS]:
        out = tmp_path / f"killed_at_{kill_at}"
        with monkeypatch.context() as patch:
            _write_calls(patch, kill_at)
            with pytest.raises(_Killed):
                D.train_digits(out, config, progress=False)
        assert not [p for p in out.iterdir() if p.name.endswith(".tmp")]  # no temporary file left behind
        resumed = D.train_digits(out, config, progress=False)
        assert resumed["finished"] and resumed["final_losses"] == straight["final_losses"], kill_at
        got = _weights(out)
        assert got.keys() == expected.keys(), kill_at
        assert all(torch.equal(got[k], expected[k]) for k in expected), kill_at


def test_a_second_training_on_a_locked_folder_stops_at_once(tmp_path):
    with output_lock(tmp_path, "another ipa-probe train-digits"):
        with pytest.raises(OutputLocked, match="in use"):
            D.train_digits(tmp_path, _SUPPORT, progress=False)
    assert not (tmp_path / CHECKPOINT_NAME).exists()


def test_the_cli_answers_a_damaged_checkpoint_or_a_locked_folder_in_one_line(tmp_path, capsys):
    from ipa_probe.cli import main
    from ipa_probe.runfolder import STAGING_NAME

    out = tmp_path / "run"
    out.mkdir()
    (out / CHECKPOINT_NAME).write_bytes(b"\x00" * 20)  # no manifest lists it: not this run's to resume (issue 39)
    argv = ["train-digits", "--out", str(out), "--no-progress", "--steps", "2", "--vae-steps", "2", "--batch", "4"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"no ipa_probe run manifest lists ({CHECKPOINT_NAME})" in err[0]
    (out / CHECKPOINT_NAME).unlink()
    # a killed training's staging folder, resumed by the same command, holding a damaged checkpoint
    staging = out / STAGING_NAME
    staging.mkdir()
    record = {"run_id": "r0", "command": "ipa-probe train-digits", "status": "interrupted", "mode": "fresh"}
    key = {"recipe": D.DEFAULT_RECIPE, "training": "support"}
    (staging / "ipa_probe_manifest.json").write_text(json.dumps({**record, "key": key, "files": {}}))
    (staging / CHECKPOINT_NAME).write_bytes(b"\x00" * 20)
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(staging / CHECKPOINT_NAME) in err[0] and "delete it" in err[0]
    assert f"{out} is as it was before this run" in err[0]
    with output_lock(out, "another ipa-probe train-digits"):
        assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "in use by" in err[0]


def test_train_digits_refuses_a_config_of_no_recipe(tmp_path):
    with pytest.raises(TypeError, match="DigitsTrainConfig, DigitsBaseConfig or DigitsAdapterConfig"):
        D.train_digits(tmp_path, {"steps": 3})
