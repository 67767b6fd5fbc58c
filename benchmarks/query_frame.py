"""How much the query frame's choices move the query-frame rho on the ``ip-adapter`` digits organism.

The query-frame columns (``qf_*`` exact, ``qf_gauss_*`` Gaussian; docs/gauge.md, "The query frame") compare the
attention with Gaussian NW in the frame where the model's own queries are isotropic; the frame is a pool of queries.
This script runs the organism's CLI defaults (digit 3, three references: K = 12 keys per row, 20 DDIM steps, CFG 3,
references and images from seed 0) with the frame pooled per item and per CFG branch, for one image and for the
CLI's eight, and prints the mean over the cond branch's step x layer x head cells of the stored-frame rho and of
both query-frame forms, with their excess over the gauge baseline, and the first and last step of the Gaussian form.

    python benchmarks/query_frame.py            # about a minute on 2 CPU cores
"""

from __future__ import annotations

import torch

import ipa_probe
from ipa_probe.tiny.digits import DIGITS_PROMPT, digits_pipeline, digits_reference_images


def measure(pipe, images: int, frame: str) -> dict[str, float]:
    """Cond-branch means of one probed generation: ``images`` per prompt, the query frame pooled per ``frame``."""
    refs = digits_reference_images(3, 3, seed=0)
    with ipa_probe.probe(pipe, query_frame=frame) as run:
        pipe(
            DIGITS_PROMPT,
            ip_adapter_image=[refs],
            num_inference_steps=20,
            guidance_scale=3.0,
            num_images_per_prompt=images,
            generator=torch.Generator().manual_seed(0),
            output_type="latent",
        )
    table = run.to_dataframe()
    cond = table[(table["kind"] == "image") & (table["branch"] == "cond")]
    by_step = cond.groupby("step")["qf_gauss_spearman"].mean()
    return {
        "cells": len(cond),
        "spearman": cond["spearman"].mean(),
        "qf_spearman": cond["qf_spearman"].mean(),
        "qf_gauss_spearman": cond["qf_gauss_spearman"].mean(),
        "qf_rho_excess": cond["qf_rho_excess"].mean(),
        "qf_gauss_logit_ratio": cond["qf_gauss_logit_ratio"].mean(),
        "qf_gauss_rho_excess": cond["qf_gauss_rho_excess"].mean(),
        "gauss_first": by_step.iloc[0],
        "gauss_last": by_step.iloc[-1],
    }


def main() -> None:
    torch.set_num_threads(min(2, torch.get_num_threads()))
    pipe = digits_pipeline(recipe="ip-adapter")
    pipe.set_progress_bar_config(disable=True)
    print(
        "| images | frame | stored-frame rho | qf rho exact | qf rho Gaussian | excess exact / Gaussian "
        "| Gaussian r | Gaussian first -> last step |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for images in (1, 8):
        for frame in ("item", "branch"):
            m = measure(pipe, images, frame)
            print(
                f"| {images} | {frame} | {m['spearman']:.4f} | {m['qf_spearman']:.4f} | {m['qf_gauss_spearman']:.4f} "
                f"| {m['qf_rho_excess']:+.4f} / {m['qf_gauss_rho_excess']:+.4f} | {m['qf_gauss_logit_ratio']:.3f} "
                f"| {m['gauss_first']:.3f} -> {m['gauss_last']:.3f} |"
            )


if __name__ == "__main__":
    main()
