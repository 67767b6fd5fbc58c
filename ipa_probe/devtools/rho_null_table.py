"""Tabulate ``P(rho > 0.9)`` of the per-row Spearman rho under independent rankings, above the exact range.

Usage: ``python -m ipa_probe.devtools.rho_null_table [--samples 16777216] [--max-keys 40]``. Prints the entries of
:data:`ipa_probe.statistics.nulls._TAIL_HITS` (one ``K: hits,`` line per number of keys, with the chance level) from
:func:`ipa_probe.statistics.nulls.rho_null` with seed 0, from ``EXACT_NULL_KEYS + 1`` keys up to the first ``K`` where
no draw reached 0.9 (or ``--max-keys``). Single-threaded: about 20 minutes in all at the default on a loaded 2-core
machine.
"""

from __future__ import annotations

import argparse
import sys

import torch

from ..statistics.nulls import EXACT_NULL_KEYS, rho_null
from ..statistics.schema import ROW_THRESHOLD


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=2**24, help="random permutations per number of keys")
    parser.add_argument("--max-keys", type=int, default=40, help="stop here even if draws still reach 0.9")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    for keys in range(EXACT_NULL_KEYS + 1, args.max_keys + 1):
        p = rho_null(keys, samples=args.samples).tail(ROW_THRESHOLD)
        print(f"    {keys}: {round(p * args.samples)},  # P = {p:.3g}", flush=True)
        if p == 0:
            break
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
