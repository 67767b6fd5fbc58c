"""Capture: the probe context manager, its run record, the per-family taps and the run's tables and plots.

``run`` holds :func:`probe`, :class:`ProbeConfig` and :class:`ProbeRun`; ``taps`` the per-family knowledge of where
the image-branch query and keys live; ``report`` turns a run into tables, summaries and plots; ``mapplots`` draws
the per-reference maps and overlays.
"""

from .config import ProbeConfig
from .run import ProbeRun, probe

__all__ = ["ProbeConfig", "ProbeRun", "probe"]
