"""The NW baseline's quality in the open (issue #40 point 7): how often the query-frame and stored-frame NW heads'
outputs read as the references' digit, beside the learned adapter and the adapter switched off, on the trained digits
organisms (:func:`label_rates`; :func:`run` over the three recipes)."""

from __future__ import annotations

from collections.abc import Sequence

import pandas as pd

from ..compare_rates import RATE_METHODS, label_rates

__all__ = ["RATE_METHODS", "label_rates", "recipe_rates"]


def recipe_rates(
    recipes: Sequence[str] = ("support", "ip-adapter", "mixed"), digits=range(10), seeds=(0, 1), steps: int = 20
) -> pd.DataFrame:
    """:func:`label_rates` on each trained digits organism: one set of 3 held-out references per digit
    (``digits_reference_images(d, 3, seed=700)``), DDIM ``steps`` steps, CFG 3 (the organisms' working setting).

    Returns:
        the rows of every recipe with a ``recipe`` column, and ``digits``, ``seeds``, ``steps`` of the run.
    """
    from ..tiny.digits import DIGITS_PROMPT, classify_digit_images, digits_pipeline, digits_reference_images

    frames = []
    sets = [(d, digits_reference_images(d, 3, seed=700)) for d in digits]
    call = {"prompt": DIGITS_PROMPT, "num_inference_steps": steps, "guidance_scale": 3.0}
    for recipe in recipes:
        pipe = digits_pipeline(recipe=recipe)
        pipe.set_progress_bar_config(disable=True)
        table = label_rates(pipe, sets, seeds, classify_digit_images, call)
        frames.append(table.assign(recipe=recipe, digits=len(sets), seeds=len(seeds), steps=steps))
    return pd.concat(frames, ignore_index=True)
