"""The statistics: one room that the probe, the maps, the sweeps and the experiments call. Pure torch (a CPU sorts
through numpy, in place; ``bandwidth`` reads the torch-free checks); everything runs on the tensors' device.

- ``kernels``: dot-product and Gaussian NW logits and weights, the query frame's key term, n_eff, heads split/merge.
- ``rows``: per-row ranks, Spearman and Pearson, masked means and spreads, reduced over the last axis or per cell
  over rows flattened side by side (``Segments``); copies among keys; the KL-optimal bandwidth.
- ``agreement``: ``compare_weights`` / ``compare_frames``, every statistic of attention against NW weights (one
  pass for many frames and many cells).
- ``nulls``, ``draws``: the chance levels of a per-row rho and its gauge baseline; the nulls' permutations and the
  stratified row samples, seeded, on the device.
- ``compiled``: ``torch.compile`` of the statistics (``probe(compile=True)``) and its eager fallback.
- ``schema``: the one list of per-cell fields, table columns, summary columns and branch labels.
- ``bandwidth``: the bandwidth spec: parse, check, resolve (one value per timestep), describe.
"""
