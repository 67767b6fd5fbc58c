"""The NW baseline's quality beside the learned adapter (issue #40 point 7): how often the query-frame and
stored-frame NW heads' outputs read as the references' label, beside the learned adapter and the adapter switched
off, from the same seeds (:func:`label_rates`). ``ipa-probe compare`` prints and saves it on the digits organism
(:func:`digit_rate_line`); :mod:`ipa_probe.experiments.nw_quality` runs it over the three recipes."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pandas as pd
import PIL.Image

from ._checks import check_items
from .compare import _check_seeds, _generator

__all__ = ["RATE_METHODS", "digit_rate_line", "label_rates"]


#: The heads :func:`label_rates` compares: the learned adapter, the NW head in either frame, and the adapter off.
RATE_METHODS: tuple[str, ...] = ("learned", "nw_head_query", "nw_head_stored", "adapter_off")


def label_rates(
    pipe,
    sets: Sequence[tuple[int, Sequence[PIL.Image.Image]]],
    seeds: Sequence[int],
    classify,
    call_kwargs: dict | None = None,
    methods: Sequence[str] = RATE_METHODS,
) -> pd.DataFrame:
    """How often each head's output reads as the references' label: the NW baseline's quality beside the learned
    adapter's and the adapter switched off (issue #40 point 7).

    For every ``(label, references)`` set and seed, one image per method from the same initial noise: ``learned``
    (the pipeline as it is), ``nw_head_query`` / ``nw_head_stored`` (:func:`ipa_probe.nw_head`, matched bandwidth,
    query or stored frame) and ``adapter_off`` (every IP-Adapter's scale 0, restored after); ``classify`` labels the
    images. The rate's interval is Clopper-Pearson (exact, inside [0, 1]), clustered by reference set where there are
    several (the seeds of one set share its references: :func:`~ipa_probe.attribution.clustered_clopper_pearson`);
    for one set it is the plain interval over the seeds, a statement about that set.

    ``classify``: PIL images -> ``(labels, probabilities)`` (e.g. :func:`ipa_probe.tiny.digits.classify_digit_images`);
    ``methods``: a subset of :data:`RATE_METHODS`. Returns one row per method: ``method``, ``right`` (count),
    ``images``, ``rate``, ``low``, ``high``.
    """
    from .attribution import clopper_pearson, clustered_clopper_pearson
    from .layers import find_ip_layers
    from .nwhead import nw_head

    unknown = [m for m in check_items(methods, "methods", "method names") if m not in RATE_METHODS]
    if unknown:
        raise ValueError(f"unknown method(s) {unknown}; choose from {list(RATE_METHODS)}")
    seeds = _check_seeds(seeds)
    call = dict(call_kwargs or {})
    processors = [layer.processor for layer in find_ip_layers(pipe)]

    def images(references) -> list[PIL.Image.Image]:
        return [
            pipe(ip_adapter_image=[list(references)], generator=_generator(pipe.device, s), **call).images[0]
            for s in seeds
        ]

    rows = []
    for method in methods:
        right, total = [], []  # per reference set
        for label, references in sets:
            if method.startswith("nw_head"):
                with nw_head(pipe, frame=method.removeprefix("nw_head_")):
                    out = images(references)
            elif method == "adapter_off":
                saved = [list(p.scale) for p in processors]
                try:
                    for p in processors:
                        p.scale = [0.0] * len(p.scale)
                    out = images(references)
                finally:
                    for p, scale in zip(processors, saved, strict=True):
                        p.scale = scale
            else:
                out = images(references)
            labels, _ = classify(out)
            right.append(int((np.asarray(labels) == label).sum()))
            total.append(len(out))
        if len(sets) > 1:
            low, high = clustered_clopper_pearson(right, total)
        else:
            low, high = clopper_pearson(sum(right), sum(total))
        rows.append({"method": method, "right": sum(right), "images": sum(total), "rate": sum(right) / sum(total)})
        rows[-1].update(low=low, high=high)
    return pd.DataFrame(rows)


def digit_rate_line(table: pd.DataFrame, label: int) -> str:
    """One line of :func:`label_rates`' table: each head's right count, rate and Clopper-Pearson interval."""
    names = {
        "learned": "learned",
        "nw_head_query": "NW head (query frame)",
        "nw_head_stored": "NW head (stored frame)",
    }
    names["adapter_off"] = "adapter off"
    parts = [
        f"{names[r.method]} {r.right}/{r.images} [{r.low:.2f}, {r.high:.2f}]" for r in table.itertuples(index=False)
    ]
    return f"digit-right rate (the classifier reads {label}; 95% Clopper-Pearson): " + ", ".join(parts)
