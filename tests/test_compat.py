"""docs/compatibility.md: it lists every diffusers pipeline class that takes an IP-Adapter, and each row is what a
fresh run gives (:mod:`ipa_probe.devtools.compat`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from ipa_probe.devtools.compat import check_class, parse_table, render_table
from ipa_probe.tiny.zoo import Zoo, ip_adapter_pipeline_classes
from ipa_probe.tiny.zoo_builders import BUILDERS

PAGE = Path(__file__).resolve().parents[1] / "docs" / "compatibility.md"

#: Classes diffusers itself cannot run with an IP-Adapter, with the reason; every other row must pass every check.
DIFFUSERS_CANNOT_RUN = {
    "LEditsPPPipelineStableDiffusionXL": "its __call__ hands ip_adapter_image to its own VAE encode_image",
}


@pytest.fixture(scope="module")
def page_rows() -> dict[str, tuple[str, ...]]:
    return parse_table(PAGE.read_text())


@pytest.fixture(scope="module")
def classes() -> dict[str, type]:
    return ip_adapter_pipeline_classes()


def test_the_page_lists_every_ip_adapter_pipeline_class_of_the_installed_diffusers(page_rows, classes):
    import diffusers

    missing, extra = sorted(set(classes) - set(page_rows)), sorted(set(page_rows) - set(classes))
    assert not missing, (
        f"diffusers {diffusers.__version__} has classes the page does not list: {missing}; add a "
        "builder to ipa_probe/tiny/zoo_builders.py and run python -m ipa_probe.devtools.compat --write "
        "docs/compatibility.md"
    )
    assert not extra, f"the page lists classes diffusers {diffusers.__version__} does not have: {extra}"
    assert set(classes) <= set(BUILDERS)
    assert "StableDiffusionPipeline" in classes and "KolorsPipeline" in classes  # found in modules, not namespace


def test_the_class_finder_sees_only_classes_taking_ip_adapter_image(classes):
    import inspect

    assert all("ip_adapter_image" in inspect.signature(cls.__call__).parameters for cls in classes.values())
    assert len(classes) >= 50


def test_rows_render_and_parse_back():
    from ipa_probe.devtools.compat import Row

    row = Row("StableDiffusionPipeline", 2, 2, {"cfg": ("uncond", "cond"), "no cfg": ("cond",)}, ["a | note"])
    assert parse_table(render_table([row], "v"))["StableDiffusionPipeline"] == row.cells()
    assert row.cells()[3] == "cfg: uncond, cond; no cfg: cond" and "a / note" in row.cells()[4]


@pytest.fixture(scope="module")
def zoo():
    return Zoo()


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_a_fresh_run_gives_the_pages_row(zoo, refs, page_rows, name):
    row = check_class(zoo, name, refs)
    assert row.cells() == page_rows[name]
    if name in DIFFUSERS_CANNOT_RUN:
        assert row.runs == 0
    else:
        assert row.ok, row.failures


def test_the_checks_own_reading_is_a_client_of_the_spine(refs):
    """The check reads each pass beside the probe without a denoiser pre-hook of its own: one with both attached,
    none after; its own timesteps count the loop's steps."""
    import torch

    from ipa_probe.capture.run import probe
    from ipa_probe.devtools.compat import _Passes
    from ipa_probe.tiny.sd import tiny_pipeline

    pipe = tiny_pipeline("sd15")
    before = len(pipe.unet._forward_pre_hooks)
    passes = _Passes(pipe)
    try:
        with probe(pipe):
            assert len(pipe.unet._forward_pre_hooks) == before + 1
            pipe("a", ip_adapter_image=[refs[:1]], num_inference_steps=3, output_type="latent",
                 generator=torch.Generator().manual_seed(0))  # fmt: skip
    finally:
        passes.remove()
    assert len(pipe.unet._forward_pre_hooks) == before
    assert passes.steps() == 3 and passes.timesteps == pipe.scheduler.timesteps.tolist()  # CFG batched: a pass a step
