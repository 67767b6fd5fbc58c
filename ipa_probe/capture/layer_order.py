"""Layer ids in the order the network runs them: ``down_blocks.N``, ``mid_block``, ``up_blocks.N`` (UNets),
``transformer_blocks.N`` then ``single_transformer_blocks.N`` (Flux-style DiTs), numbers compared as numbers.

``unet.attn_processors`` lists a diffusers UNet's layers as down, up, mid (the mid block is registered last), so a
figure or table that keeps that order puts ``mid_block`` after the decoder. Sort with :func:`network_order` wherever
layers are listed.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

__all__ = ["BLOCK_ORDER", "network_key", "network_order"]

#: The top-level block prefixes in the order the denoiser runs them; a name with another prefix comes after these,
#: in the order it was given.
BLOCK_ORDER: tuple[str, ...] = (
    "down_blocks",
    "mid_block",
    "up_blocks",
    "transformer_blocks",
    "single_transformer_blocks",
)


def _natural(text: str) -> tuple:
    """``"attentions.10.x"`` -> ``((1, "attentions."), (0, 10), (1, ".x"))``: numbers compare as numbers."""
    return tuple((0, int(part)) if part.isdigit() else (1, part) for part in re.split(r"(\d+)", text) if part)


def network_key(name: str) -> tuple:
    """A sort key that puts layer ``name`` where the network runs it (see the module docstring).

    Args:
        name: a layer id such as ``"mid_block.attentions.0.transformer_blocks.0.attn2"``.

    Returns:
        a tuple: the block's rank in :data:`BLOCK_ORDER` (``len(BLOCK_ORDER)`` for others), then the rest of the
        name with its numbers as numbers.
    """
    if not isinstance(name, str):
        raise TypeError(f"name: expected a layer id (str), got {type(name).__name__}")
    head, _, rest = name.partition(".")
    rank = BLOCK_ORDER.index(head) if head in BLOCK_ORDER else len(BLOCK_ORDER)
    return (rank, _natural(rest)) if rank < len(BLOCK_ORDER) else (rank, ())


def network_order(names: Iterable[str]) -> list[str]:
    """``names`` sorted into network order (stable: names outside :data:`BLOCK_ORDER` keep their order, last).

    Example:
        ```py
        >>> network_order(["up_blocks.1.a", "mid_block.a", "down_blocks.10.a", "down_blocks.2.a"])
        ['down_blocks.2.a', 'down_blocks.10.a', 'mid_block.a', 'up_blocks.1.a']
        ```
    """
    return sorted(names, key=network_key)
