"""The one bandwidth spec: parse, check, resolve (shape checked), describe; the probe and the NW head share it."""

from __future__ import annotations

import argparse
import math

import pytest
import torch

import ipa_probe
from ipa_probe.statistics import bandwidth


@pytest.mark.parametrize(
    "text, keywords, expected",
    [
        ("matched", ("matched",), "matched"),
        ("fit", ("matched", "fit"), "fit"),
        ("0.5", ("matched",), 0.5),
        ("2", ("matched",), 2.0),
    ],
)
def test_parse_accepts_keywords_and_positive_numbers(text, keywords, expected):
    assert bandwidth.parse(text, keywords) == expected


@pytest.mark.parametrize("text", ["fit", "wide", "0", "-1", "nan", "inf", ""])
def test_parse_refuses_everything_else_naming_the_accepted_forms(text):
    with pytest.raises(ValueError, match="'matched' or a positive number"):
        bandwidth.parse(text)
    parser = argparse.ArgumentParser()
    parser.add_argument("--bandwidth", type=bandwidth.argument_type("matched"))
    with pytest.raises(SystemExit):
        parser.parse_args(["--bandwidth", text])


def test_check_makes_ints_floats_and_keeps_callables():
    def fn(t):
        return 1.0

    assert bandwidth.check(2) == 2.0 and isinstance(bandwidth.check(2), float)
    assert bandwidth.check(fn) is fn
    assert bandwidth.check("fit", ("matched", "fit")) == "fit"
    with pytest.raises(ValueError, match="positive"):
        bandwidth.check(math.nan)
    with pytest.raises(TypeError, match="matched"):
        bandwidth.check(True)


def test_resolve_gives_the_matched_temperature_floats_and_one_value_per_timestep():
    assert bandwidth.resolve("matched", 16) == pytest.approx(2.0)  # h^2 = sqrt(16)
    assert bandwidth.resolve(0.7, 16) == 0.7
    h = bandwidth.resolve(lambda t: 0.5 + t / 1000, 16, torch.tensor(500.0))
    assert h.shape == () and h.dtype == torch.float32 and float(h) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="0-d"):
        bandwidth.resolve(lambda t: torch.ones(3), 16, torch.tensor(1.0))
    with pytest.raises(RuntimeError, match="no timestep was seen"):
        bandwidth.resolve(lambda t: 1.0, 16, None)
    with pytest.raises(ValueError, match="cannot resolve"):
        bandwidth.resolve("fit", 16)


def test_describe_names_callables():
    def schedule(t):
        return 1.0

    assert [bandwidth.describe(s) for s in ("matched", 0.5, schedule)] == ["matched", 0.5, "schedule"]


def test_the_probe_refuses_a_bandwidth_callable_with_several_values(sd15, refs):
    with pytest.raises(ValueError, match="0-d"), ipa_probe.probe(sd15, bandwidth=lambda t: torch.ones(2)):
        sd15("a photo", ip_adapter_image=[refs], num_inference_steps=1, output_type="latent")
    assert ipa_probe.list_hooks(sd15) == []


@pytest.mark.parametrize("h", [1e300, 1e-300, -1.0, math.nan, math.inf])
def test_numbers_outside_the_range_are_refused_by_the_python_api_too(h):
    with pytest.raises(ValueError, match="positive number h in"):
        bandwidth.check(h)


def test_a_callable_returning_a_bad_float_is_refused_when_resolved():
    spec = bandwidth.check(lambda t: -1.0)
    with pytest.raises(ValueError, match="positive number h in"):
        bandwidth.resolve(spec, 8, torch.tensor(999.0))


@pytest.mark.parametrize(
    "limit, error",
    [
        (math.nan, ValueError),
        (math.inf, ValueError),
        (0, ValueError),
        (-5, ValueError),
        (True, TypeError),
        ("1GB", TypeError),
    ],
)
def test_max_map_bytes_must_be_a_positive_finite_number(limit, error):
    # out of range: ValueError; the wrong type: TypeError (docs/failures.md, "The Python API")
    with pytest.raises(error, match="max_map_bytes"):
        ipa_probe.ProbeConfig(keep_maps=True, max_map_bytes=limit)
