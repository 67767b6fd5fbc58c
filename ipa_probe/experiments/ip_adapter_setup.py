"""What the ip-adapter experiment and its controls share (:mod:`~.ip_adapter`, :mod:`~.matched_control`): the
schedule and timesteps, the organism's pipelines, the reference sets and one probed generation."""

from __future__ import annotations

__all__ = [
    "NUM_STEPS",
    "PAPER_LAST_SPEARMAN",
    "PAPER_TIMESTEPS",
    "REFS_PER_SET",
    "organism_pipelines",
    "run_reference_set",
    "step_indices",
]

#: The paper's timesteps: the 50-step SD 1.x grid (steps_offset=1: 981, 961, ..., 1) at these step indices.
PAPER_TIMESTEPS = (981, 761, 501, 261, 1)
NUM_STEPS = 50
REFS_PER_SET = 4
#: The paper's mean per-row Spearman at the last timestep; it reports no value at the other timesteps.
PAPER_LAST_SPEARMAN = 0.89


def step_indices(num_steps: int = NUM_STEPS) -> list[int]:
    """Indices into the DDIM schedule of :data:`PAPER_TIMESTEPS` (50 steps, steps_offset=1: 0, 11, 24, 36, 49)."""
    from ..tiny.digits.model import organism_scheduler

    scheduler = organism_scheduler()
    scheduler.set_timesteps(num_steps)
    timesteps = scheduler.timesteps.tolist()
    missing = [t for t in PAPER_TIMESTEPS if t not in timesteps]
    if missing:
        raise ValueError(f"expected the {num_steps}-step schedule to contain {missing}; use 50 steps")
    return [timesteps.index(t) for t in PAPER_TIMESTEPS]


def organism_pipelines(recipe: str = "support") -> dict:
    """The trained organism of ``recipe`` and its untrained control (same architecture, initial weights), progress
    bars off: ``{"trained": pipe, "untrained": pipe}``. An unknown recipe raises ``ValueError`` listing the recipes.
    """
    from ..tiny.digits import digits_pipeline, untrained_digits_pipeline

    pipes = {"trained": digits_pipeline(recipe=recipe), "untrained": untrained_digits_pipeline(recipe=recipe)}
    for pipe in pipes.values():
        pipe.set_progress_bar_config(disable=True)
    return pipes


def _reference_sets(count: int, seed: int = 0) -> list[tuple[int, list]]:
    from ..tiny.digits import digits_reference_images

    return [(i % 10, digits_reference_images(i % 10, REFS_PER_SET, seed=seed + i // 10)) for i in range(count)]


def _mixed_sets(count: int) -> list[tuple[tuple[int, int], list]]:
    from ..tiny.digits import digits_reference_images

    sets = []
    for i in range(count):
        a, b = i % 10, (i % 10 + 1 + (i // 10) % 9) % 10
        sets.append(
            ((a, b), digits_reference_images(a, 2, seed=100 + i) + digits_reference_images(b, 2, seed=200 + i))
        )
    return sets


def run_reference_set(pipe, references: list, seed: int, steps: list[int], guidance_scale: float = 1.0):
    """One generation with ``references``: the probe's table (conditional branch, image kind) and the attribution
    table (:func:`ipa_probe.attribution.reference_attribution`) at ``steps``."""
    from ..attribution import reference_attribution
    from ..tiny.digits import DIGITS_PROMPT

    result = reference_attribution(
        pipe,
        steps=steps,
        seed=seed,
        prompt=DIGITS_PROMPT,
        ip_adapter_image=[references],
        num_inference_steps=NUM_STEPS,
        guidance_scale=guidance_scale,
    )
    table = result.run.to_dataframe()
    return table[(table["branch"] == "cond") & (table["kind"] == "image")], result.table
