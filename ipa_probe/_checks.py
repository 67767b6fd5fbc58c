"""Checks of run settings (seed, scale, steps, bandwidth, device), shared by the command line and sweep manifests.

Each raises ``ValueError`` with one line naming the setting, what was given and what is accepted. Nothing heavy is
imported at module level (the command line checks its arguments before torch is imported).
"""

from __future__ import annotations

import math
from typing import Any

__all__ = [
    "BANDWIDTH_RANGE",
    "DEFAULT_DIGITS_RECIPE",
    "DIGITS_RECIPES",
    "MAX_SEED",
    "check_device",
    "check_recipe",
    "check_steps",
    "parse_bandwidth",
    "parse_float",
    "parse_int",
]

#: Largest seed: seeds are stored in int64 columns and seed ``torch.Generator``.
MAX_SEED = 2**63 - 1

#: Numeric NW bandwidths accepted: outside, float32 NW logits ``-|q - k|^2 / (2 h^2)`` overflow or all vanish.
BANDWIDTH_RANGE = (1e-6, 1e6)

#: How the digits organism is trained (docs/organism.md): ``support`` (UNet, adapter and image encoder together on
#: support sets of the target's class, as the paper's flow model is) and ``ip-adapter`` (a frozen image-free base,
#: then only the adapter, on self-reconstruction, as IP-Adapter is).
DIGITS_RECIPES = ("support", "ip-adapter")

#: The recipe ``digits_pipeline()``, ``probe``, ``compare`` and ``train-digits`` use unless told: the one that draws
#: the references' digit more reliably (docs/organism.md).
DEFAULT_DIGITS_RECIPE = "support"


def check_recipe(recipe: Any) -> str:
    """``recipe`` if it is one of :data:`DIGITS_RECIPES`, else a ``ValueError`` naming them."""
    if not isinstance(recipe, str) or recipe not in DIGITS_RECIPES:
        raise ValueError(f"expected recipe to be one of {', '.join(map(repr, DIGITS_RECIPES))}, got {recipe!r}")
    return recipe


def parse_int(value: Any, key: str, minimum: int, maximum: int | None = None) -> int:
    """An integer in ``[minimum, maximum]`` from an int, an integral float or a numeric string."""
    if isinstance(value, str):
        try:
            value = int(value.strip())
        except ValueError:
            raise ValueError(f"{key}: expected an integer, got {value!r}") from None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{key}: expected an integer, got {value!r}")
    if value < minimum or (maximum is not None and value > maximum):
        upper = f" and <= {maximum}" if maximum is not None else ""
        raise ValueError(f"{key}: expected an integer >= {minimum}{upper}, got {value}")
    return value


def parse_float(value: Any, key: str, minimum: float | None = None) -> float:
    """A finite float (``>= minimum`` when given) from a number or a numeric string."""
    if isinstance(value, str):
        try:
            value = float(value.strip())
        except ValueError:
            raise ValueError(f"{key}: expected a number, got {value!r}") from None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"{key}: expected a finite number, got {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{key}: expected a finite number >= {minimum:g}, got {value!r}")
    return float(value)


def parse_bandwidth(value: Any, keywords: tuple[str, ...] = ("matched", "fit")) -> str | float:
    """One of ``keywords`` or a number in :data:`BANDWIDTH_RANGE` (a numeric string is converted).

    Raises:
        ValueError: anything else, with the accepted forms in the message.
    """
    low, high = BANDWIDTH_RANGE
    accepted = f"{', '.join(map(repr, keywords))} or a positive number in [{low:g}, {high:g}]"
    given = value
    if isinstance(value, str):
        text = value.strip()
        if text in keywords:
            return text
        try:
            value = float(text)
        except ValueError:
            raise ValueError(f"bandwidth: expected {accepted}, got {value!r}") from None
    if isinstance(value, bool) or not isinstance(value, int | float) or not (low <= value <= high):
        raise ValueError(f"bandwidth: expected {accepted}, got {given!r}")
    return float(value)


def check_steps(scheduler, steps: int) -> None:
    """Raise unless ``scheduler`` runs ``steps`` denoising steps (tried on a copy made from its config).

    Catches what the pipeline would only hit mid-run: more steps than the scheduler's training timesteps, and step
    counts whose first timestep lies past the end of its noise table (DDIM with ``steps_offset=1`` at exactly
    ``num_train_timesteps`` steps).
    """
    copy = type(scheduler).from_config(scheduler.config)
    try:
        copy.set_timesteps(steps)
    except ValueError as err:
        raise ValueError(f"steps: {steps} is more than this scheduler runs ({str(err).splitlines()[0]})") from None
    table = getattr(copy, "alphas_cumprod", None)
    if table is not None and len(copy.timesteps) and int(copy.timesteps.max()) >= len(table):
        raise ValueError(
            f"steps: with {steps} steps the scheduler's first timestep {int(copy.timesteps.max())} lies past its "
            f"{len(table)} training timesteps; use at most {steps - 1} steps"
        )


def check_device(name: str) -> None:
    """Raise unless ``name`` is a torch device that is present and can hold data (``meta`` cannot)."""
    import torch

    try:
        device = torch.device(name)
    except RuntimeError as err:
        raise ValueError(f"device {name!r} is not a torch device ({err}); use e.g. cpu or cuda") from None
    present = {
        "cpu": lambda: True,
        "cuda": lambda: torch.cuda.is_available() and (device.index or 0) < torch.cuda.device_count(),
        "mps": lambda: torch.backends.mps.is_available(),
        "xpu": lambda: hasattr(torch, "xpu") and torch.xpu.is_available(),
    }
    if device.type not in present:
        raise ValueError(f"device {name!r} cannot run a pipeline; use cpu, cuda, mps or xpu")
    if not present[device.type]():
        raise ValueError(f"device {name!r} is not present on this machine; use --device cpu")
