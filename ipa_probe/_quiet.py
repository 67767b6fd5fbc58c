"""Known-harmless log messages of the libraries ipa_probe drives, dropped where ipa_probe triggers them, only there.

A filter is added to the one logger that emits each message for the duration of a ``with`` block (or a decorated
call) and removed on exit; every other message of those loggers, and everything outside the block, passes as usual.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["HARMLESS", "quiet_known_messages"]

#: logger name -> the messages of that logger that say nothing a user can act on where ipa_probe triggers them.
HARMLESS: dict[str, re.Pattern] = {
    # ModelMixin.to(dtype) lists the modules that must stay in float32 on every cast with a dtype, even when there are
    # none; load_ip_adapter casts the UNet that way on every pipeline ipa_probe builds.
    "diffusers.models.modeling_utils": re.compile(r"should be kept in float32: \[\]"),
    # open_clip, asked for a model without a pretrained tag, logs on the root logger; ipa_probe.compare builds that
    # model on purpose offline and says "random weights" in every output it writes.
    "root": re.compile(r"^No pretrained weights loaded for model '[^']+'\. Model initialized randomly\.$"),
}


class _DropMatching(logging.Filter):
    def __init__(self, pattern: re.Pattern) -> None:
        super().__init__()
        self.pattern = pattern

    def filter(self, record: logging.LogRecord) -> bool:
        return not self.pattern.search(record.getMessage())


@contextmanager
def quiet_known_messages() -> Iterator[None]:
    """Inside the block, drop the messages of :data:`HARMLESS` (and nothing else); usable as a decorator too."""
    filters = []
    for name, pattern in HARMLESS.items():
        logger = logging.getLogger() if name == "root" else logging.getLogger(name)
        filters.append((logger, _DropMatching(pattern)))
        logger.addFilter(filters[-1][1])
    try:
        yield
    finally:
        for logger, f in filters:
            logger.removeFilter(f)
