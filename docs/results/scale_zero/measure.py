"""docs/attribution.md's scale-0 paths measured: how far ``mode="scale", factor=0`` ends from the ablation it
approximates, on the digits organism (the shipped ``support`` recipe; 4 DDIM steps, CFG 1, seed 0; references two 3s
``digits_reference_images(3, 2, seed=100)`` and two 5s ``(5, 2, seed=200)``, as in ``tests/test_intervention.py``).
Each entry is the largest absolute difference of the final latents of two paths (``scale``: factor-0 edits;
``ablate``: the same references removed): reference 0 scaled against ablated; two nested blocks (references 0, then
1) against the same given at once; all four references against ``set_ip_adapter_scale(0)``. Run from the repository
root, one torch thread::

    PYTHONPATH=$PWD python docs/results/scale_zero/measure.py docs/results/scale_zero/record.json
"""

import contextlib
import sys
from pathlib import Path

import torch

from ipa_probe import intervene
from ipa_probe._io import versions, write_json
from ipa_probe.tiny.digits import DIGITS_PROMPT, digits_pipeline, digits_reference_images


def measure() -> dict:
    torch.set_num_threads(1)
    pipe = digits_pipeline()
    pipe.set_progress_bar_config(disable=True)
    refs = digits_reference_images(3, 2, seed=100) + digits_reference_images(5, 2, seed=200)

    def final(*blocks, adapter_scale: float = 1.0) -> torch.Tensor:
        """The final latent with ``blocks`` (``intervene`` keyword sets) entered outermost first."""
        pipe.set_ip_adapter_scale(adapter_scale)
        try:
            with contextlib.ExitStack() as stack:
                for block in blocks:
                    stack.enter_context(intervene(pipe, **block))
                return pipe(DIGITS_PROMPT, ip_adapter_image=[refs], num_inference_steps=4, guidance_scale=1.0,
                            generator=torch.Generator().manual_seed(0), output_type="latent").images  # fmt: skip
        finally:
            pipe.set_ip_adapter_scale(1.0)

    def paths(mode: str, extra: dict) -> dict:
        edit = {"mode": mode, **extra}
        return {
            "single": (final({"reference": 0, **edit}),),
            "nested": (
                final({"reference": 0, **edit}, {"reference": 1, **edit}),
                final({"reference": [0, 1], **edit}),
            ),
            "every": (final({"reference": [0, 1, 2, 3], **edit}), final(adapter_scale=0.0)),
        }

    scale, ablate = paths("scale", {"factor": 0.0}), paths("ablate", {})
    diff = {
        "scale_vs_ablate": float((scale["single"][0] - ablate["single"][0]).abs().max()),
        "nested_scale_vs_at_once": float((scale["nested"][0] - scale["nested"][1]).abs().max()),
        "every_scale_vs_adapter_scale_0": float((scale["every"][0] - scale["every"][1]).abs().max()),
        "nested_ablate_vs_at_once": float((ablate["nested"][0] - ablate["nested"][1]).abs().max()),
        "every_ablate_vs_adapter_scale_0": float((ablate["every"][0] - ablate["every"][1]).abs().max()),
    }
    return {"largest_abs_difference": diff, "latent_max_abs": float(ablate["single"][0].abs().max()),
            "threads": torch.get_num_threads(), "versions": versions()}  # fmt: skip


if __name__ == "__main__":
    write_json(Path(sys.argv[1]), measure())
