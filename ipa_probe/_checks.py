"""Checks of run settings (seed, scale, steps, bandwidth, device), shared by the command line, sweep manifests and
the Python API.

The ``parse_*`` functions read text too (command-line values, CSV cells) and raise ``ValueError``; the ``check_*``
functions of the Python API take the value as it is and raise ``TypeError`` for a value of the wrong type and
``ValueError`` for one out of range, both naming the argument, what was given and what is accepted. Nothing heavy is
imported at module level (the command line checks its arguments before torch is imported).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

__all__ = [
    "BANDWIDTH_RANGE",
    "DEFAULT_GAUGE_FACTORS",
    "GAUGE_FACTOR_RANGE",
    "DEFAULT_DIGITS_RECIPE",
    "DIGITS_BASE_FILES",
    "DIGITS_MIXED_FRACTION",
    "DIGITS_RECIPES",
    "DIGITS_SMALLEST_CLASS",
    "MAX_RESAMPLES",
    "MAX_SEED",
    "NW_FRAMES",
    "NW_FORMS",
    "check_choice",
    "check_flag",
    "check_fraction",
    "check_int",
    "check_items",
    "check_nw_frame",
    "check_seed",
    "check_threshold",
    "PIPELINE_DEVICES",
    "check_device",
    "check_device_name",
    "describe_value",
    "check_recipe",
    "check_steps",
    "max_refs_limit",
    "parse_bandwidth",
    "parse_gauges",
    "parse_step_selection",
    "step_selected",
    "Timesteps",
    "check_steps_ran",
    "parse_float",
    "parse_int",
]

#: Largest seed: seeds are stored in int64 columns and seed ``torch.Generator``.
MAX_SEED = 2**63 - 1

#: Most bootstrap resamples a sweep's aggregate takes (``--resamples``, ``n_resamples``). The merge draws them in
#: batches of at most 10,000 (memory ~ 10,000 x rows x 8 bytes), so this bounds its time: at 100,000 the Monte Carlo
#: error of a 95% interval's ends is far below the interval's own width; the default, 9,999, already is.
MAX_RESAMPLES = 100_000

#: Torch device types that can run a pipeline (``meta`` and the like hold no data).
PIPELINE_DEVICES = ("cpu", "cuda", "mps", "xpu")

#: Numeric NW bandwidths accepted: outside, float32 NW logits ``-|q - k|^2 / (2 h^2)`` overflow or all vanish.
BANDWIDTH_RANGE = (1e-6, 1e6)

#: How the digits organism is trained (docs/organism.md): ``support`` (UNet, adapter and image encoder together on
#: support sets of the target's class, as the paper's flow model is), ``ip-adapter`` (a frozen image-free base, then
#: only the adapter, on self-reconstruction, as IP-Adapter is) and ``mixed`` (``support`` with a fraction
#: :data:`DIGITS_MIXED_FRACTION` of each batch on mixed reference sets, the target's digit one reference's).
DIGITS_RECIPES = ("support", "ip-adapter", "mixed")

#: The fraction of each UNet batch the ``mixed`` recipe trains on mixed reference sets (``DigitsTrainConfig.mixed``).
DIGITS_MIXED_FRACTION = 0.5

#: The files of an ``ip-adapter`` base (``train-digits --recipe ip-adapter --stage base``), by part, relative to its
#: folder: the adapter stage loads both, and ``train-digits --base`` is checked for them before torch loads.
DIGITS_BASE_FILES = {
    "unet": "unet/diffusion_pytorch_model.safetensors",
    "image_encoder": "image_encoder/model.safetensors",
}

#: Images of the rarest class among the digits that train the organism (scikit-learn's digits ``[0, 1500)``: 146
#: eights; tests/test_faults.py recounts it from the data). A target's references are drawn from the other images of
#: its class, so ``max_refs`` is at most this minus one (``support``) or this (``ip-adapter``: the target itself is
#: one of its references).
DIGITS_SMALLEST_CLASS = 146


def max_refs_limit(training: str) -> int:
    """The largest ``max_refs`` a digits training (``"support"`` or ``"adapter"``) can draw from its data."""
    return DIGITS_SMALLEST_CLASS - 1 if training == "support" else DIGITS_SMALLEST_CLASS


#: The recipe ``digits_pipeline()``, ``probe``, ``compare`` and ``train-digits`` use unless told: the one that draws
#: the references' digit more reliably (docs/organism.md).
DEFAULT_DIGITS_RECIPE = "support"


#: The NW head's frames: ``stored`` (the key-norm term ``|k|^2 / (2 h^2)`` of the stored keys: gauge dependent) and
#: ``query`` (each key's log-partition over the current pass's queries: invariant under every q/k basis change).
NW_FRAMES = ("stored", "query")

#: How the query-frame head estimates its key term (see :func:`ipa_probe.statistics.kernels.query_frame_bias`).
NW_FORMS = ("exact", "gaussian")


def check_nw_frame(frame: Any, form: Any = None, bandwidth: Any = "matched") -> tuple[str, str | None]:
    """Check the NW head's frame and form against its bandwidth; torch-free (the command line calls it too).

    Args:
        frame: one of :data:`NW_FRAMES`.
        form: ``None``, or for ``frame="query"`` one of :data:`NW_FORMS`.
        bandwidth: the head's bandwidth setting; the query frame takes only the default ``"matched"``.

    Returns:
        ``(frame, form)``, ``form`` being ``"exact"`` for the query frame when not given and ``None`` for the stored
        frame.

    Raises:
        TypeError: a frame or form that is not a string.
        ValueError: an unknown frame or form, a form with the stored frame, or a bandwidth with the query frame.
    """
    if not isinstance(frame, str):
        raise TypeError(f"frame: expected one of {NW_FRAMES}, got {describe_value(frame)}")
    if frame not in NW_FRAMES:
        raise ValueError(f"frame: expected one of {NW_FRAMES}, got {frame!r}")
    if frame == "stored":
        if form is not None:
            raise ValueError(f"form={form!r} applies to the query-frame head only; pass frame='query' or drop form")
        return frame, None
    form = "exact" if form is None else form
    if not isinstance(form, str):
        raise TypeError(f"form: expected one of {NW_FORMS}, got {describe_value(form)}")
    if form not in NW_FORMS:
        raise ValueError(f"form: expected one of {NW_FORMS}, got {form!r}")
    if not (isinstance(bandwidth, str) and bandwidth == "matched"):
        raise ValueError(
            f"bandwidth={bandwidth!r} does not apply to frame='query': its logits are the model's own "
            "q·k/sqrt(d_head) (its own temperature) with each key's log-partition over the queries taken out; "
            "drop bandwidth (or pass 'matched'), or use frame='stored' for a chosen bandwidth"
        )
    return frame, form


def check_recipe(recipe: Any) -> str:
    """``recipe`` if it is one of :data:`DIGITS_RECIPES`, else a ``ValueError`` naming them."""
    if not isinstance(recipe, str) or recipe not in DIGITS_RECIPES:
        raise ValueError(f"expected recipe to be one of {', '.join(map(repr, DIGITS_RECIPES))}, got {recipe!r}")
    return recipe


def describe_value(value: Any) -> str:
    text = repr(value)
    return f"{text[:60]}..." if len(text) > 60 else f"{text} ({type(value).__name__})"


def check_int(value: Any, name: str, minimum: int | None = None, maximum: int | None = None) -> int:
    """``value`` as it is, if it is an int (not a bool; numpy integers are taken) in ``[minimum, maximum]``.

    Raises:
        TypeError: not an integer. ValueError: out of range.
    """
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise TypeError(f"{name}: expected an int, got {describe_value(value)}")
    value = value.__index__()
    if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        low = "-inf" if minimum is None else minimum
        high = "inf" if maximum is None else maximum
        raise ValueError(f"{name}: expected an int in [{low}, {high}], got {value}")
    return value


def check_seed(value: Any, name: str = "seed") -> int:
    """A seed: an int in ``[0, MAX_SEED]`` (what ``torch.Generator.manual_seed`` takes and an int64 column holds)."""
    return check_int(value, name, 0, MAX_SEED)


def check_choice(value: Any, name: str, choices: Sequence[str]) -> Any:
    """``value`` if it is one of ``choices``; a ValueError naming them otherwise."""
    if value not in choices:
        raise ValueError(f"{name}: expected one of {', '.join(map(repr, choices))}, got {value!r}")
    return value


def check_flag(value: Any, name: str) -> bool:
    """``True`` or ``False`` (numpy booleans too); anything else, a string such as ``"no"`` included, is refused."""
    if type(value).__name__ not in ("bool", "bool_"):
        raise TypeError(f"{name}: expected True or False, got {describe_value(value)}")
    return bool(value)


def check_fraction(value: Any, name: str) -> float:
    """A number strictly between 0 and 1 (a confidence level, a threshold on a correlation's fraction)."""
    if isinstance(value, bool) or not isinstance(value, int | float) and not hasattr(value, "__float__"):
        raise TypeError(f"{name}: expected a number in (0, 1), got {describe_value(value)}")
    number = float(value)
    if not 0 < number < 1:
        raise ValueError(f"{name}: expected a number in (0, 1), e.g. 0.95, got {value!r}")
    return number


def check_threshold(value: Any, name: str = "threshold") -> float:
    """A correlation threshold: a number in (-1, 1) (the fraction of cells whose rho is above it is reported)."""
    if isinstance(value, bool) or not isinstance(value, int | float) and not hasattr(value, "__float__"):
        raise TypeError(f"{name}: expected a number in (-1, 1), got {describe_value(value)}")
    if not -1 < float(value) < 1:
        raise ValueError(f"{name}: expected a correlation threshold in (-1, 1), e.g. 0.9, got {value!r}")
    return float(value)


def check_items(value: Any, name: str, what: str) -> tuple:
    """The items of a list, tuple or other iterable that is not a string, as a tuple; ``what`` names one item.

    Raises:
        TypeError: a string, bytes, a mapping or a non-iterable (e.g. ``5`` where ``[5]`` was meant).
    """
    if isinstance(value, str | bytes | dict) or not hasattr(value, "__iter__"):
        raise TypeError(f"{name}: expected a list of {what}, got {describe_value(value)}")
    return tuple(value)


def parse_int(value: Any, key: str, minimum: int, maximum: int | None = None) -> int:
    """An integer in ``[minimum, maximum]`` from an int, an integral float or a numeric string."""
    if isinstance(value, str):
        try:
            value = int(value.strip())
        except ValueError:
            raise ValueError(f"{key}: expected an integer, got {value!r}") from None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int | float):  # a list, None: the wrong type
        raise TypeError(f"{key}: expected an integer, got {value!r} ({type(value).__name__})")
    if not isinstance(value, int):
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


#: The q/k gauge factors a gauge sweep uses by default (powers of two: the reparametrisation is exact in floats).
DEFAULT_GAUGE_FACTORS: tuple[float, ...] = (0.25, 0.5, 1.0, 2.0, 4.0)


#: The scalar gauge factors the command line accepts (checked before torch loads): beyond them float32 weights lose
#: bits or overflow for ordinary inputs. The Python API checks the factor against the weights' own dtype instead.
GAUGE_FACTOR_RANGE: tuple[float, float] = (2.0**-20, 2.0**20)

_GAUGE_FORMS = "numbers c > 0, random[:SEED[:SPREAD]], adversarial[:up|down[:MAXCOND]] or shift[:SEED[:SCALE]]"

#: The smallest adversarial condition bound: rounding the basis change into float32 weights alone moves cond(A) by
#: about d eps (1e-5 at d = 64), so a bound closer to 1 than 1e-3 is one the written weights cannot be held to.
ADVERSARIAL_MIN_COND = 1.001

#: The largest row-shift scale (sd of b in key units): a shift moves every logit of a row by q.b, and float32 loses
#: about eps |q.b| of each; beyond this scale the outputs and the query-frame statistics no longer stay within their
#: tolerance (measured on the digits organism and the tiny SD 1.5 pipeline: docs/gauge.md, "How far a row shift
#: holds").
ROW_SHIFT_SCALE_MAX = 10.0

#: The log-singular-value range, in units of SPREAD, that a random basis change's cond is checked against before
#: torch loads: the range of d standard normals is about 5.2 at d = 128 (the widest heads), 6.5 leaves a margin.
_RANDOM_RANGE_SIGMAS = 6.5

#: Machine epsilon of the weight dtypes the command line offers (torch-free).
_DTYPE_EPS = {"float32": 2.0**-23, "float16": 2.0**-10, "bfloat16": 2.0**-7, "float64": 2.0**-52}


def max_gauge_cond(dtype: str) -> float:
    """The largest cond(A) a basis change may have on weights of ``dtype`` (``1 / (16 eps)``, as
    :func:`ipa_probe.gauge.transforms.max_condition_number`; float32: 5.2e5)."""
    return 1 / (16 * _DTYPE_EPS[dtype])


def check_gauge_ranges(specs: tuple, dtype: str, key: str = "--gauge-sweep") -> None:
    """Before torch loads: the named gauges ``specs`` (from :func:`parse_gauges`) against what weights of ``dtype``
    hold: a random SPREAD whose basis changes would pass ``max_gauge_cond`` for wide heads, an adversarial MAXCOND
    above it, a row-shift SCALE above :data:`ROW_SHIFT_SCALE_MAX`.

    Raises:
        ValueError: one line naming the spec as typed and the largest value that holds.
    """
    import math

    limit = max_gauge_cond(dtype)
    for spec in specs:
        if not isinstance(spec, str):
            continue
        kind, _, value = spec.split(":")
        number = float(value)
        if kind == "random" and number * _RANDOM_RANGE_SIGMAS > math.log(limit):
            most = math.log(limit) / _RANDOM_RANGE_SIGMAS
            raise ValueError(
                f"{key}: {spec}: a SPREAD of {value} makes basis changes with cond(A) up to about "
                f"exp({_RANDOM_RANGE_SIGMAS:g} x {value}) = {math.exp(number * _RANDOM_RANGE_SIGMAS):.3g} on wide "
                f"heads, beyond the {limit:.3g} that {dtype} weights hold; use a SPREAD of at most {most:.2f}"
            )
        if kind == "adversarial" and number > limit:
            raise ValueError(
                f"{key}: {spec}: {dtype} weights hold basis changes up to cond(A) {limit:.3g}; use a MAXCOND of at "
                f"most {limit:.3g}"
            )
        if kind == "shift" and number > ROW_SHIFT_SCALE_MAX:
            raise ValueError(
                f"{key}: {spec}: beyond a SCALE of {ROW_SHIFT_SCALE_MAX:g} float32 no longer keeps the outputs and "
                f"the query-frame statistics of a row shift within tolerance (docs/gauge.md); use a SCALE of at most "
                f"{ROW_SHIFT_SCALE_MAX:g}"
            )


def _number_text(value: float) -> str:
    """``value`` as short as it reads back exactly: ``10`` for 10.0, ``1.000001`` kept as typed."""
    short = f"{value:g}"
    return short if float(short) == value else repr(value)


def _gauge_token(token: str, key: str) -> str:
    """One named gauge, normalised to ``kind:a:b`` with its defaults filled in."""
    kind, *rest = token.split(":")
    defaults = {"random": ("0", "1"), "shift": ("0", "1"), "adversarial": ("down", "10")}[kind]
    if len(rest) > 2:
        raise ValueError(f"{key}: expected {kind}[:A[:B]] (two fields at most), got {token!r}")
    first, second = (*rest, *defaults[len(rest) :])
    if kind == "adversarial":
        if first not in ("up", "down"):
            raise ValueError(f"{key}: expected adversarial:up or adversarial:down, got {token!r}")
        bound = parse_float(second, key)
        if not ADVERSARIAL_MIN_COND <= bound <= 1e4:
            raise ValueError(
                f"{key}: expected the adversarial condition bound MAXCOND in [{ADVERSARIAL_MIN_COND:g}, 10000] "
                f"(float32 weights cannot be held to a bound closer to 1), got {token!r}"
            )
        return f"adversarial:{first}:{_number_text(bound)}"
    try:
        seed = int(first)
    except ValueError:
        raise ValueError(f"{key}: expected {kind}:SEED with an integer SEED, got {token!r}") from None
    if not 0 <= seed <= MAX_SEED:
        raise ValueError(f"{key}: expected a SEED in [0, {MAX_SEED}], got {token!r}")
    size = parse_float(second, key)
    high = 4.0 if kind == "random" else 1000.0
    if not 0 < size <= high:
        what = "SPREAD (sd of log singular values)" if kind == "random" else "SCALE (sd of the shift, key units)"
        raise ValueError(f"{key}: expected {what} in (0, {high:g}], got {token!r}")
    return f"{kind}:{seed}:{_number_text(size)}"


def parse_gauges(value: Any, key: str = "gauges", bounded: bool = True) -> tuple[float | str, ...]:
    """Gauge specs from a sequence or a comma-separated string (``"0.5,2,random:0:1,adversarial:down:10"``).

    Numbers are scalar gauge factors (> 0; with ``bounded``, within :data:`GAUGE_FACTOR_RANGE`); named gauges are
    returned as normalised strings ``random:SEED:SPREAD``, ``shift:SEED:SCALE``, ``adversarial:DIRECTION:MAXCOND``.
    Anything else (objects of :mod:`ipa_probe.gauge`) is passed through unchanged. Repeats are refused.
    """
    items = value.split(",") if isinstance(value, str) else value
    if isinstance(items, bytes) or not hasattr(items, "__iter__"):
        raise ValueError(f"{key}: expected {_GAUGE_FORMS}, e.g. 0.5,2,random:0:1, got {value!r}")
    low, high = GAUGE_FACTOR_RANGE
    specs: list[float | str] = []
    for item in items:
        text = item.strip() if isinstance(item, str) else None
        if text is not None and text.split(":")[0] in ("random", "shift", "adversarial"):
            specs.append(_gauge_token(text, key))
            continue
        if not (isinstance(item, str | int | float) and not isinstance(item, bool)):
            specs.append(item)
            continue
        try:
            factor = parse_float(item, key)
        except ValueError:
            raise ValueError(f"{key}: expected {_GAUGE_FORMS}, got {item!r}") from None
        if factor <= 0 or (bounded and not low <= factor <= high):
            limits = f"in [{low:g}, {high:g}] (2^-20 to 2^20)" if bounded else "> 0"
            raise ValueError(
                f"{key}: expected gauge factors {limits}: q -> c q, k -> k / c must keep the outputs "
                f"finite, got {item!r}"
            )
        specs.append(factor)
    if not specs:
        raise ValueError(f"{key}: expected at least one gauge, e.g. 0.5,1,2, got {value!r}")
    plain = [s for s in specs if isinstance(s, float | str)]
    if len(set(plain)) != len(plain):
        raise ValueError(f"{key}: expected distinct gauges, got {value!r}")
    return tuple(specs)


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


def check_device_name(name: str) -> None:
    """Raise unless ``name`` has the form of a device that can run a pipeline (``cpu``, ``cuda``, ``cuda:1``, ...).

    Imports no torch: whether the device is present is :func:`check_device`'s question.
    """
    kind, colon, index = name.partition(":")
    if kind not in PIPELINE_DEVICES or (colon and not index.isdigit()):
        raise ValueError(
            f"device {name!r} cannot run a pipeline (not a torch device that holds weights); use "
            f"{', '.join(PIPELINE_DEVICES)}, e.g. cuda:1"
        )


def check_device(name: str) -> None:
    """Raise unless ``name`` is a torch device that is present and can hold data (``meta`` cannot)."""
    import torch

    check_device_name(name)
    device = torch.device(name)
    present = {
        "cpu": lambda: True,
        "cuda": lambda: torch.cuda.is_available() and (device.index or 0) < torch.cuda.device_count(),
        "mps": lambda: torch.backends.mps.is_available(),
        "xpu": lambda: hasattr(torch, "xpu") and torch.xpu.is_available(),
    }
    if not present[device.type]():
        raise ValueError(f"device {name!r} is not present on this machine; use --device cpu")


class Timesteps:
    """``steps=`` by the scheduler's timestep (as the denoiser gets it), not the loop index, so that it holds under
    img2img ``strength`` and custom timesteps: the passes whose timestep is one of ``values``, or lies in
    ``[low, high]`` (``None``: open), e.g. ``Timesteps(low=500)``."""

    def __init__(self, values: Any = None, *, low: float | None = None, high: float | None = None) -> None:
        chosen = None if values is None else check_items(values, "Timesteps", "timesteps")
        given = [*(chosen or ()), low, high]
        if (values is None) == (low is None and high is None) or not all(_finite(v) for v in given if v is not None):
            raise ValueError(f"Timesteps: expected finite values=[...] or bounds low=, high=; got {given}")
        self.values = None if chosen is None else frozenset(map(float, chosen))
        self.low, self.high = low, high

    def __call__(self, step: int, timestep: float | None) -> bool:
        if timestep is None or self.values is not None:
            return timestep in (self.values or ())
        return (self.low is None or timestep >= self.low) and (self.high is None or timestep <= self.high)

    def __repr__(self) -> str:
        return f"Timesteps({sorted(self.values) if self.values is not None else f'low={self.low}, high={self.high}'})"


def _finite(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def parse_step_selection(steps: Any) -> frozenset[int] | slice | Any:
    """Denoising steps to act on: ``None`` (all), a list (or other iterable) of non-negative loop indices, a ``slice``
    with non-negative bounds and a positive step (negative indices cannot be resolved before the loop ends), a
    :class:`Timesteps` or a predicate ``fn(step, timestep) -> bool`` (``timestep`` a float).

    Returns:
        ``None``, the slice, the predicate, or the indices as a ``frozenset``.

    Raises:
        TypeError: not a list or a slice (e.g. ``5`` where ``[5]`` was meant).
        ValueError: a negative or non-integer index, or a slice with a negative bound or a non-positive step.
    """
    if steps is None or callable(steps):
        return steps
    if isinstance(steps, slice):
        s = steps
        if any(v is not None and (not isinstance(v, int) or v < 0) for v in (s.start, s.stop)) or (
            s.step is not None and (not isinstance(s.step, int) or s.step <= 0)
        ):
            raise ValueError(
                f"steps: expected a slice of non-negative loop indices with a positive step, got {s!r}; ipa_probe "
                "cannot resolve negative indices before the loop ends (Img2Img's strength, for one, shortens the "
                "loop): write slice(n - 3, None) for the last 3 of n steps, or select by timestep (Timesteps)"
            )
        return steps
    chosen = check_items(steps, "steps", "loop indices (ints), a slice, Timesteps(...) or fn(step, timestep)")
    if not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in chosen):
        raise ValueError(f"steps: expected non-negative loop indices (ints) or a slice, got {chosen!r}")
    return frozenset(chosen)


def step_selected(steps: Any, step: int, timestep: Any = None) -> bool:
    """Whether the pass at loop index ``step`` (scheduler ``timestep``, as the denoiser got it) is in a selection
    made by :func:`parse_step_selection`. A predicate reads the timestep as a float (a device tensor is read back)."""
    if steps is None:
        return True
    if callable(steps):
        if hasattr(timestep, "reshape"):
            timestep = timestep.reshape(-1)[0].item()
        return bool(steps(step, None if timestep is None else float(timestep)))
    if isinstance(steps, slice):
        start, stop, stride = steps.start or 0, steps.stop, steps.step or 1
        return step >= start and (stop is None or step < stop) and (step - start) % stride == 0
    return step in steps


def check_steps_ran(steps: Any, ran: int, name: str = "steps", selected: int | None = None) -> None:
    """Raise when a step selection (from :func:`parse_step_selection`) names loop indices a call that ran ``ran``
    denoising steps did not have, or when a timestep selection or predicate selected none of the ``selected`` passes
    it was asked about (``None``: not counted): acting on nothing would report a zero effect, not an error.
    ``ran == 0`` (no call yet) checks nothing.

    Raises:
        ValueError: naming the indices (or the slice) and the steps the call had.
    """
    if callable(steps):
        if ran > 0 and selected == 0:
            raise ValueError(f"{name}: {steps!r} selected no pass of the {ran} step(s) the calls ran; widen it")
        return
    if steps is None or ran <= 0:
        return
    if isinstance(steps, slice):
        missing = (steps.start or 0) >= ran
        given = repr(steps)
    else:
        outside = sorted(s for s in steps if s >= ran)
        missing, given = bool(outside), f"{outside}"
    if missing:
        raise ValueError(
            f"{name}: {given} selects loop indices the call did not have (it ran {ran} steps, indices 0 to "
            f"{ran - 1}); pass indices below {ran}"
        )
