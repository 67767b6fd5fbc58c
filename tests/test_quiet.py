"""Quiet by default: the known-harmless library messages are dropped where ipa_probe triggers them, and only there."""

from __future__ import annotations

import logging

import pytest
import torch

from ipa_probe._quiet import HARMLESS, quiet_known_messages
from ipa_probe.tiny.sd import tiny_pipeline

EMPTY_FP32 = "There are modules in UNet2DConditionModel that should be kept in float32: []. Casting directly ..."


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.fixture
def diffusers_records():
    """Every message of the diffusers logger that emits the float32 warning (diffusers' loggers do not propagate)."""
    logger = logging.getLogger("diffusers.models.modeling_utils")
    handler, level = _Records(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.WARNING)  # whatever verbosity diffusers was left at by code that ran before
    yield handler.messages
    logger.removeHandler(handler)
    logger.setLevel(level)


def test_building_a_pipeline_logs_no_float32_warning_but_the_filter_is_scoped(diffusers_records, monkeypatch):
    with monkeypatch.context() as m:
        m.setattr("ipa_probe._quiet.HARMLESS", {})  # without the filter, the build does warn (load_ip_adapter's cast)
        tiny_pipeline("sd15")
    assert any("kept in float32: []" in m for m in diffusers_records)
    diffusers_records.clear()
    pipe = tiny_pipeline("sd15")
    assert not any("kept in float32" in m for m in diffusers_records), diffusers_records
    # the same cast outside ipa_probe's builders still warns: the filter is not left behind
    pipe.unet.to(dtype=torch.float32)
    assert any("kept in float32: []" in m for m in diffusers_records)


def test_only_the_known_messages_are_dropped(diffusers_records):
    logger = logging.getLogger("diffusers.models.modeling_utils")
    filters_before = list(logger.filters)
    with quiet_known_messages():
        logger.warning(EMPTY_FP32)
        logger.warning("There are modules in X that should be kept in float32: ['norm']. Casting ...")  # a real one
        logger.warning("another diffusers warning")
    assert diffusers_records == [
        "There are modules in X that should be kept in float32: ['norm']. Casting ...",
        "another diffusers warning",
    ]
    assert logger.filters == filters_before
    assert set(HARMLESS) == {"diffusers.models.modeling_utils", "root"}


def test_the_command_line_leaves_the_libraries_logging_as_it_found_it(tmp_path, capsys):
    from diffusers.utils import logging as diffusers_logging

    from ipa_probe.cli import main

    loggers = [logging.getLogger(name if name != "root" else None) for name in HARMLESS]
    before = diffusers_logging.get_verbosity(), [list(logger.filters) for logger in loggers]
    assert main(["probe", "--kind", "sd15", "--steps", "1", "--size", "64", "64", "--out", str(tmp_path)]) == 0
    assert (diffusers_logging.get_verbosity(), [list(logger.filters) for logger in loggers]) == before
    assert "float32" not in capsys.readouterr().err


def test_open_clip_random_weights_warning_is_dropped_only_inside(caplog):
    message = "No pretrained weights loaded for model 'ViT-B-32'. Model initialized randomly."
    with caplog.at_level(logging.WARNING):
        with quiet_known_messages():
            logging.warning(message)
        assert caplog.messages == []
        logging.warning(message)
    assert caplog.messages == [message]
