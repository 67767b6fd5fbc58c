"""What every part of the attribution experiment shares: the generation's settings, the effects and predictors it
compares, the tolerances of its shuffle check, the populations and resolutions of its verdicts, and one observed
generation (:func:`observe`). See :mod:`ipa_probe.experiments.attribution` for the experiment itself."""

from __future__ import annotations

import numpy as np
import pandas as pd

NUM_STEPS = 20


GUIDANCE_SCALE = 3.0


#: loop indices of the 20-step schedule where shares and posterior are recorded (timesteps 951, 701, 451, 201, 1)
RECORDED_STEPS = (0, 5, 10, 15, 19)


#: the effects compared, with their table names
EFFECTS = {"latent_effect": "RMS change of the final latent", "class_drop": "drop of P(reference's digit)"}


PREDICTORS = {
    "attention_share": "attention share",
    "contribution_norm": "contribution norm",
    "contribution_projection": "contribution projection",
    "posterior_weight": "exact posterior weight",
    "attribution_patching": "attribution patching",
    "output_projection": "contribution on the output's gradient",
}


#: Predictors of the whole generation (one backward pass, :mod:`ipa_probe.attribution.patching`), not read per step:
#: compared once (timestep ``"all"``), beside the step means of the others.
WHOLE_RUN_PREDICTORS = ("attribution_patching", "output_projection")


#: The predictors read per (layer, step): averaged over a layer group and step range in the grid.
STEP_PREDICTORS = tuple(p for p in PREDICTORS if p not in WHOLE_RUN_PREDICTORS)


#: Reordering the references permutes the image tokens, so every softmax normaliser and every weighted sum of values
#: adds the same float32 terms in another order (relative error ~1e-7 each), and the denoising loop carries those
#: differences to the end. Measured on the 20-step CFG-3 setting (smoke tier, 6 sets): the trained organism's final
#: latent moved by at most 1.4e-6 of its largest |value| (4.7e-6 at |x| ~ 3.3), the untrained one's by up to 2e-4
#: (7.1e-3 at |x| ~ 35: its random weights amplify rounding); in float64 the two orders gave the same latents (the
#: test checks 1e-10). The full tier's 20 sets: 1.4e-6 trained, up to 1.06e-3 untrained (0.032 at |x| ~ 30), so 2e-3
#: of the largest |value| leaves 1.9x room above the untrained organism's drift (10x above the smoke tier's).
SHUFFLE_LATENT_RTOL = 2e-3


#: The same reordering in the shares at the first recorded step, permuted back: there both orders see the same
#: ``x_t``, so the shares differ only by the float32 softmax's summation order (full tier, 20 sets: up to 1e-7 on the
#: trained organism, 2.8e-5 on the untrained one, whose random weights give larger logits); 1e-4 leaves 3.5x room
#: and is 500x below the 0.05 pooling threshold. Later steps' shares follow an ``x_t`` that carries the loop's drift
#: (see :data:`SHUFFLE_LATENT_RTOL`): the full tier's first run measured up to 3.3e-4 there on the untrained organism
#: (3 of 20 sets above 1e-4, final latents within 1e-3 of their largest value), 1.9e-6 on the trained one, so the
#: check holds the first step to this and reports the others.
SHUFFLE_SHARE_ATOL = 1e-4


#: The populations of reference sets: the ablated 2 + 2 sets and the two controls.
POPULATIONS = ("2+2 digits", "same digit", "4 digits")


#: Resolutions at which the verdict's rule is applied.
RESOLUTIONS = ("average", "layer", "layer x head", "layer x position", "layer x head x position")


def observe(pipe, refs: list, seed: int):
    """One generation of the experiment's setting with ``refs``: its
    :class:`~ipa_probe.attribution.ReferenceAttribution` (shares on average, per head and per position; posterior;
    ``x_t``) at :data:`RECORDED_STEPS`."""
    from ..attribution import reference_attribution

    return reference_attribution(pipe, steps=RECORDED_STEPS, seed=seed, **_call(refs))


def _call(refs: list) -> dict:
    from ..tiny.digits import DIGITS_PROMPT

    return dict(
        prompt=DIGITS_PROMPT, ip_adapter_image=[refs], num_inference_steps=NUM_STEPS, guidance_scale=GUIDANCE_SCALE
    )


def _matrix(frame: pd.DataFrame, column: str) -> np.ndarray:
    """``(S, R)`` values of ``column`` by set and reference."""
    return frame.pivot(index="set", columns="reference", values=column).sort_index().to_numpy(np.float64)


def _interval_text(r: dict) -> str:
    return f"{r['spearman']:+.2f} [{r['low']:+.2f}, {r['high']:+.2f}]"


def predictor_test(test: dict, permutations: int, seed: int) -> dict:
    """The columns of one predictor's test against an effect, from :func:`ipa_probe.attribution.paired_rank_test`'s
    ``mean``, ``low``, ``high``, ``sets`` and per-set ``values``: its mean per-set Spearman, interval, set count, the
    one-sided sign-flip p of the per-set values (:func:`ipa_probe.attribution.sign_flip_test`), whether it predicts
    before Holm (p below ``ALPHA``), and the test's null (``_null``, for the family's Holm-compatible bound, the same
    test inverted: :func:`~.attribution_tests.adjust_comparisons`)."""
    from ..attribution import ALPHA, sign_flip_test

    p, null = sign_flip_test(test["values"], permutations, seed)
    out = {"spearman": test["mean"], "low": test["low"], "high": test["high"], "p": p, "sets": test["sets"]}
    return {**out, "predicts": bool(p < ALPHA), "_null": null}
