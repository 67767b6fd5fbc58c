"""The exact Gaussian NW head swapped in for a pipeline's IP-Adapter attention (zero parameters).

``swap`` holds the feature (:func:`nw_head`, :func:`apply_nw_head`, :func:`remove_nw_head`, :class:`NWHeadConfig`)
and picks the processor of each layer's model family: ``unet`` (SD 1.5 / SDXL), ``flux``, ``sd3``. What the three
processors share (the timestep clock, the bandwidth, the NW kernel) is in ``kernel``.
"""

from .flux import FluxNWHeadAttnProcessor
from .kernel import TimestepClock
from .sd3 import SD3NWHeadAttnProcessor
from .swap import NW_HEAD, NWHeadConfig, NWHeadSwap, apply_nw_head, nw_head, remove_nw_head
from .unet import NWHeadAttnProcessor

__all__ = [
    "NW_HEAD",
    "FluxNWHeadAttnProcessor",
    "NWHeadAttnProcessor",
    "NWHeadConfig",
    "NWHeadSwap",
    "SD3NWHeadAttnProcessor",
    "TimestepClock",
    "apply_nw_head",
    "nw_head",
    "remove_nw_head",
]
