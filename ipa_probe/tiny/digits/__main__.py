"""``python -m ipa_probe.tiny.digits --out DIR``: the right-digit rates of the shipped organism."""

from .evaluate import _main

_main()
