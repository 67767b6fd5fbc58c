"""How much the query frame's choices move the query-frame rho on the ``ip-adapter`` digits organism.

The query-frame columns (``qf_*`` exact, ``qf_gauss_*`` Gaussian; docs/gauge.md, "The query frame") compare the
attention with Gaussian NW in the frame where the model's own queries are isotropic; the frame is a pool of queries.
This script runs the organism's CLI defaults (digit 3, three references: K = 12 keys per row, 20 DDIM steps, CFG 3,
references and images from seed 0) with the frame pooled per item and per CFG branch, for one image and for the
CLI's eight, and prints the mean over the cond branch's step x layer x head cells of the stored-frame rho and of
both query-frame forms, with their excess over the gauge baseline, and the first and last step of the Gaussian form;
then, for each item-frame run, what the run itself says of the other pool (``qf_spearman_other_pool``): the shift of
the mean over all cells and over the cells with a rho in both pools, and the mean rho of the cells only the branch
pool defines (the 1 x 1 mid block's).

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
    own, other = cond["qf_spearman"], cond["qf_spearman_other_pool"]
    both, gained = own.notna() & other.notna(), own.isna() & other.notna()
    return {
        "pool_shift": other.mean() - own.mean(),
        "pool_shift_shared": (other - own)[both].mean(),
        "gained_cells": int(gained.sum()),
        "gained_rho": other[gained].mean(),
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
    notes = []
    for images in (1, 8):
        for frame in ("item", "branch"):
            m = measure(pipe, images, frame)
            if frame == "item":
                notes.append(
                    f"{images} image(s), item frame: the branch pool would move the mean qf rho by "
                    f"{m['pool_shift']:+.4f} (all cells), {m['pool_shift_shared']:+.4f} (cells with a rho in both); "
                    + (f"{m['gained_cells']} cells have one only in the branch pool, mean {m['gained_rho']:.3f}"
                       if m["gained_cells"] else "no cell has one only in the branch pool")
                )  # fmt: skip
            print(
                f"| {images} | {frame} | {m['spearman']:.4f} | {m['qf_spearman']:.4f} | {m['qf_gauss_spearman']:.4f} "
                f"| {m['qf_rho_excess']:+.4f} / {m['qf_gauss_rho_excess']:+.4f} | {m['qf_gauss_logit_ratio']:.3f} "
                f"| {m['gauss_first']:.3f} -> {m['gauss_last']:.3f} |"
            )
    print("\n".join(notes))


if __name__ == "__main__":
    main()
