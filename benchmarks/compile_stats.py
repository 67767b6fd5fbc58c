"""Per-record statistics eager against ``torch.compile`` (``probe(compile=True)``, issue #42): compile time, CPU time
per record, and the largest difference of the numbers.

One synthetic SD 1.5 record per point (CFG batch of 2, 8 heads of width 40, random q and k, as a tap gives them),
formed once (:func:`~ipa_probe.capture.cells.record_logits`, ``group_cell``, ``cell_inputs``, the library's default
``rows="auto"`` sample); then its statistics (:func:`~ipa_probe.capture.cells.compare_cells`, what a pass's flush
runs, the part that dominates a record) are timed eagerly and as ``torch.compile(compare_cells, dynamic=True)``, the
nulls' keys drawn beforehand from generators of the same seed (:func:`~ipa_probe.capture.cells.null_keys`, as the
probe's compiled pass does), so both compare the same nulls. The first compiled call is the compile (later shapes
reuse it unless a guard fails). CPU time is ``time.process_time`` (this process's threads), the median of
``--repeats`` calls.

    python benchmarks/compile_stats.py --threads 1
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def _inputs(n_queries: int, n_tokens: int):
    from ipa_probe.capture.cells import cell_inputs, group_cell, record_logits
    from ipa_probe.capture.config import auto_sample_rows
    from ipa_probe.statistics.draws import stratified_rows

    class Plain:  # a processor without custom image-branch logits: SDPA's, as IPAdapterAttnProcessor2_0
        pass

    g = torch.Generator().manual_seed(0)
    split = lambda x: x.unflatten(-1, (8, 40)).transpose(1, 2)  # noqa: E731 - (B, N, H * D) -> (B, H, N, D) views
    q, k = split(torch.randn(2, n_queries, 320, generator=g)), split(torch.randn(2, n_tokens, 320, generator=g))
    h, processor = torch.full((), 40**0.25), Plain()
    attn, q_norms = record_logits(processor, q, k, False)
    size = auto_sample_rows(n_queries, n_tokens)
    sample = None if size is None else stratified_rows(n_queries, size, torch.Generator().manual_seed(1), "cpu")
    cell = group_cell(2, q, k, attn, False, None, processor, None, h, False, sample)
    return cell_inputs(cell, 2, q, k, None, False, processor, None, None, 2, q_norms, sample), size


_COMPILED = []


def _run(records, compiled: bool) -> tuple[torch.Tensor, float]:
    from ipa_probe.capture.cells import compare_cells, join_cells, null_keys

    if compiled and not _COMPILED:
        _COMPILED.append(torch.compile(compare_cells, dynamic=True))
    gens = (torch.Generator().manual_seed(0), torch.Generator().manual_seed(0))
    start = time.process_time()
    joined = join_cells(records)
    out = (_COMPILED[0] if compiled else compare_cells)(records, null_keys(joined, gens), joined=joined)[0]
    return out, time.process_time() - start


def rank_only(shapes: list[tuple[int, ...]], repeats: int) -> None:
    """``--rank``: :func:`ipa_probe.statistics.rows.rank` alone, ``torch.compile(dynamic=True)`` against eager, per
    shape."""
    from ipa_probe.statistics.rows import rank

    wall = time.perf_counter()
    compiled = torch.compile(lambda x: rank(x), dynamic=True)
    compiled(torch.randn(2, 8, 256, 16))
    print(f"rank: compile {time.perf_counter() - wall:.0f} s wall (dynamic shapes)", flush=True)
    for shape in shapes:
        x = torch.randn(*shape)
        assert torch.equal(compiled(x), rank(x))  # ranks are exact (half-integers): equal, not close
        times = {}
        for name, fn in (("compiled", compiled), ("eager", rank)):
            start = time.perf_counter()
            for _ in range(repeats):
                fn(x)
            times[name] = (time.perf_counter() - start) / repeats
        print(f"rank {shape}: compiled {1e3 * times['compiled']:.1f} ms, eager {1e3 * times['eager']:.1f} ms")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--queries", type=int, nargs="+", default=[256, 1024, 4096])
    parser.add_argument("--tokens", type=int, nargs="+", default=[4, 16, 64])
    parser.add_argument("--rank", action="store_true", help="the rank function alone (as measured before)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.rank:
        rank_only([(2, 8, 256, 64), (6, 8, 64, 4), (2, 8, 1024, 8)], 20)
        return 0
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, one record of 2 x 8 heads", flush=True)
    first = True
    for n_queries in args.queries:
        for n_tokens in args.tokens:
            records, size = _inputs(n_queries, n_tokens)
            records = [records]
            eager, _ = _run(records, False)
            wall = time.perf_counter()
            got, first_cpu = _run(records, True)  # the compile (first point), or a shape's first call
            wall = time.perf_counter() - wall
            diff = (got - eager).abs().nan_to_num(0).max().item()
            nan_same = bool(torch.equal(got.isnan(), eager.isnan()))
            times = {c: statistics.median(_run(records, c)[1] for _ in range(args.repeats)) for c in (False, True)}
            print(
                f"queries {n_queries:5d} tokens {n_tokens:3d} rows {size or 'exact':>5}: eager "
                f"{1e3 * times[False]:8.2f} ms, compiled {1e3 * times[True]:8.2f} ms "
                f"({times[False] / times[True]:.2f}x); first compiled call {wall:.1f} s wall"
                f"{' (the compile)' if first else ''}; max |diff| {diff:.2e}, NaNs alike {nan_same}",
                flush=True,
            )
            first = False
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
