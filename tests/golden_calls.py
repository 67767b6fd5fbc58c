"""The three fixed probe calls whose tables are kept as golden fixtures (tests/data/golden_*.csv.gz).

Run ``python tests/golden_calls.py`` to write the fixtures again; only do that when a change to the statistics is
meant (say so in the commit). tests/test_golden.py holds the probe to them.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

import ipa_probe

DATA = Path(__file__).parent / "data"


def _digits(pipe):
    from ipa_probe.tiny.digits import DIGITS_PROMPT, digits_reference_images

    refs = digits_reference_images(3, 2, seed=100) + digits_reference_images(5, 2, seed=200)
    # rows=256: the default before rows="auto" (the fixtures hold the old probe's numbers; at these sizes "auto"
    # differs only where a cell's rows x keys exceed 4,096)
    with ipa_probe.probe(pipe, maps=True, seed=1, rows=256) as run:
        pipe(
            DIGITS_PROMPT,
            ip_adapter_image=[refs],
            num_inference_steps=3,
            guidance_scale=3.0,
            generator=torch.Generator().manual_seed(0),
            output_type="latent",
        )
    return run


def _sd15(pipe):
    from ipa_probe.tiny.sd import default_reference_images

    with ipa_probe.probe(pipe, bandwidth="fit", kind="both", rows=64, seed=2) as run:
        pipe(
            "a photo",
            ip_adapter_image=[default_reference_images(2)],
            num_inference_steps=2,
            guidance_scale=5.0,
            generator=torch.Generator().manual_seed(0),
            output_type="latent",
        )
    return run


def _sdxl(pipe):
    from ipa_probe.tiny.sd import default_reference_images

    with ipa_probe.probe(pipe, bandwidth=2.0, query_frame="branch", seed=3, rows=256) as run:  # rows: see _digits
        pipe(
            "a photo",
            ip_adapter_image=[default_reference_images(2)],
            num_inference_steps=2,
            guidance_scale=1.0,
            generator=torch.Generator().manual_seed(0),
            output_type="latent",
        )
    return run


def golden_tables() -> dict[str, object]:
    """The tables of the three calls (each run at one torch thread, the fixtures' setting)."""
    from ipa_probe.tiny.digits import digits_pipeline
    from ipa_probe.tiny.sd import tiny_pipeline

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        digits = digits_pipeline()
        digits.set_progress_bar_config(disable=True)
        run = _digits(digits)
        tables = {"digits": run.to_dataframe(), "digits_references": run.reference_mass()}
        for kind, fn in (("sd15", _sd15), ("sdxl", _sdxl)):
            pipe = tiny_pipeline(kind)
            pipe.set_progress_bar_config(disable=True)
            tables[kind] = fn(pipe).to_dataframe()
    finally:
        torch.set_num_threads(before)
    return tables


if __name__ == "__main__":
    for name, table in golden_tables().items():
        table.to_csv(DATA / f"golden_{name}.csv.gz", index=False, float_format="%.9g")
        print(name, table.shape, file=sys.stderr)
