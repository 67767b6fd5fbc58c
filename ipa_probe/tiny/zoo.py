"""A tiny, seeded, offline build of every diffusers pipeline class whose ``__call__`` takes ``ip_adapter_image``.

:func:`ip_adapter_pipeline_classes` finds the classes by introspecting the installed diffusers (every pipeline module,
so classes whose optional dependencies are missing, such as Kolors without ``sentencepiece``, are found too).
:class:`Zoo` builds each one from the tiny components of :mod:`ipa_probe.tiny.sd` and :mod:`ipa_probe.tiny.dit`
(shared through ``from_pipe`` where the class allows, seeded, no downloads) and says how to call it: one or more
*runs*, each with the keyword arguments of a 2-step call and the branch labels diffusers' source gives its batch.
:mod:`ipa_probe.devtools.compat` runs them plain and probed and writes ``docs/compatibility.md``.

Stand-ins, where a class needs a component that cannot be built offline: Kolors' ChatGLM tokenizer (a
``sentencepiece`` model) is the offline CLIP tokenizer returning ChatGLM's ``position_ids``; AltDiffusion's
XLM-RoBERTa tokenizer is the CLIP tokenizer (the RoBERTa-series text encoder is built from a config with CLIP's
vocabulary size).
"""

from __future__ import annotations

from .zoo_base import PROMPT, SIZE, STEPS, Run, ZooBases, ZooEntry, ip_adapter_pipeline_classes
from .zoo_builders import BUILDERS

__all__ = ["PROMPT", "SIZE", "STEPS", "Run", "Zoo", "ZooEntry", "ip_adapter_pipeline_classes"]


class Zoo(ZooBases):
    """Builds the tiny pipeline of each class by name (:meth:`build`); bases are built once per zoo.

    Args:
        seed: seed of every component's weights.
    """

    def build(self, name: str) -> ZooEntry:
        """The :class:`ZooEntry` of the pipeline class ``name``.

        Raises:
            KeyError: no builder for that class (a class diffusers added after this module was written).
        """
        builder = BUILDERS.get(name)
        if builder is None:
            raise KeyError(f"no tiny build for {name}: add one to ipa_probe.tiny.zoo_builders.BUILDERS")
        entry = builder(self)
        entry.pipe.set_progress_bar_config(disable=True)
        return entry
