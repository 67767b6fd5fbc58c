"""The NW baseline's quality (issue #40 point 7): label_rates against the test's own generations and labels."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ipa_probe.experiments.nw_quality import label_rates
from ipa_probe.layers import find_ip_layers
from ipa_probe.tiny.digits import DIGITS_PROMPT, classify_digit_images, digits_reference_images


def test_label_rates_against_the_tests_own_generations(organism):
    refs = digits_reference_images(3, 2, seed=100)
    call = {"prompt": DIGITS_PROMPT, "num_inference_steps": 3, "guidance_scale": 3.0}
    seeds = [0, 1]
    out = label_rates(organism, [(3, refs)], seeds, classify_digit_images, call).set_index("method")
    scales = [list(layer.processor.scale) for layer in find_ip_layers(organism)]
    assert all(s == [1.0] for s in scales)  # the adapter's scale restored after "adapter_off"

    def labels(scale: float) -> np.ndarray:
        organism.set_ip_adapter_scale(scale)
        try:
            images = [organism(ip_adapter_image=[refs], generator=torch.Generator().manual_seed(s), **call).images[0]
                      for s in seeds]  # fmt: skip
        finally:
            organism.set_ip_adapter_scale(1.0)
        return classify_digit_images(images)[0]

    for method, scale in (("learned", 1.0), ("adapter_off", 0.0)):
        right = int((labels(scale) == 3).sum())
        assert out.loc[method, "right"] == right and out.loc[method, "images"] == 2
        assert 0.0 <= out.loc[method, "low"] <= right / 2 <= out.loc[method, "high"] <= 1.0
    assert set(out.index) == {"learned", "nw_head_query", "nw_head_stored", "adapter_off"}
    with pytest.raises(ValueError, match="unknown method"):
        label_rates(organism, [(3, refs)], seeds, classify_digit_images, call, methods=["nope"])
