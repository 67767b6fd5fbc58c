"""The exact Gaussian NW head swapped in for a pipeline's IP-Adapter attention (zero parameters).

``unet`` holds the SD 1.5 / SDXL processor and the swap lifecycle (:func:`nw_head`, :func:`apply_nw_head`,
:func:`remove_nw_head`); ``dit`` the Flux and SD3 processors.
"""

from .dit import FluxNWHeadAttnProcessor, SD3NWHeadAttnProcessor
from .unet import NWHeadAttnProcessor, NWHeadConfig, NWHeadSwap, apply_nw_head, nw_head, remove_nw_head

__all__ = [
    "FluxNWHeadAttnProcessor",
    "NWHeadAttnProcessor",
    "NWHeadConfig",
    "NWHeadSwap",
    "SD3NWHeadAttnProcessor",
    "apply_nw_head",
    "nw_head",
    "remove_nw_head",
]
