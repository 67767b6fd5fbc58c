"""The reference maps of a probe run, read back after its ``with`` block: :class:`MapViews`, the
:class:`~.run.ProbeRun` methods that select and check a request and hand it to the run's
:class:`~.maps.MapAccumulator` (``probe(pipe, maps=True)``). Capture lives in :mod:`.run` and :mod:`.maps`;
tables and figures in :mod:`.map_tables` and :mod:`.mapplots`."""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from typing import Any

import torch

from ..layers import LayerSelection
from .map_tables import map_statistics, reference_mass
from .mapplots import plot_reference_maps
from .maps import MapAccumulator, check_size, select_layers
from .report import select_branch

__all__ = ["MapViews"]


class MapViews:
    """Reference-map accessors of :class:`~.run.ProbeRun` (it provides ``_finished``, ``_maps``, ``labels``,
    ``layers`` and ``num_adapters``)."""

    def _map_source(self) -> MapAccumulator:
        self._finished()
        if self._maps is None:
            raise ValueError("reference maps need probe(pipe, maps=True)")
        return self._maps

    def _map_call(self, call: int) -> dict[str, Any]:
        calls = self._finished()["calls"]
        if not isinstance(call, int) or not 0 <= call < len(calls):
            raise ValueError(f"call: expected an index below {len(calls)} (pipeline calls probed), got {call!r}")
        return calls[call]

    def map_steps(self, call: int = 0) -> list[int]:
        """The loop indices of ``call`` that have reference maps."""
        self._map_call(call)
        return sorted({key[1] for key in self._map_source().store if key[0] == call})

    def map_rows(self, *args: Any, **kwargs: Any) -> list[int]:
        """The former name of :meth:`map_items` (a DeprecationWarning)."""
        warnings.warn("map_rows is now map_items (batch items, not query rows)", DeprecationWarning, stacklevel=2)
        return self.map_items(*args, **kwargs)

    def map_items(self, call: int = 0, step: int = 0, branch: str = "cond", adapter: int = 0) -> list[int]:
        """The batch items (indices into the denoiser input's batch, not the query rows of ``probe(rows=...)``) of
        ``call`` at loop index ``step`` that the probe labelled ``branch``, in batch order (``item`` of
        :meth:`reference_maps` indexes them), read from the labels its maps were stored with; empty when no item had
        that label. Needs ``maps=True``."""
        self._map_call(call)
        if branch not in self.labels:
            raise ValueError(f"branch: expected one of {list(self.labels)}, got {branch!r}")
        label = self.labels.index(branch)
        store = self._map_source().store
        key = next((k for k in sorted(store) if k[0] == call and k[1] == step and k[3] == adapter), None)
        if key is None:
            raise ValueError(f"no maps recorded for call={call}, step={step}, adapter={adapter}")
        labels, _ = store[key][0]  # one pass: (items,) labels of the batch rows
        return [row for row, value in enumerate(labels.tolist()) if value == label]

    def map_timesteps(self, call: int = 0) -> list[float]:
        """The scheduler timestep of each loop index of ``call``."""
        return self._map_call(call)["timesteps"].double().tolist()

    def reference_maps(
        self,
        call: int = 0,
        item: int = 0,
        adapter: int = 0,
        kind: str = "attention",
        branch: str = "cond",
        layers: LayerSelection = None,
        steps: Iterable[int] | None = None,
        size: str | tuple[int, int] = "image",
        *,
        _per_token: bool = False,
    ) -> torch.Tensor:
        """Where each reference image of an adapter goes: its share of the image branch's weight per position.

        Args:
            call: index of the probed pipeline call.
            item: index of the generated image in that call (``num_images_per_prompt`` x prompts).
            adapter: the IP-Adapter.
            kind: ``"attention"`` (the softmax the processor uses) or ``"nw"`` (Gaussian NW weights, the table's
                bandwidth).
            branch: the CFG branch whose query rows to read (``"cond"``; ``"uncond"`` with CFG).
            layers: regex or list of them selecting layer ids; ``None`` for every probed layer.
            steps: loop indices to average; ``None`` for every recorded step.
            size: ``"image"`` (the output image's size), ``"latent"`` (the latent grid) or ``(H, W)``; each layer's
                grid is resized bilinearly to it.

        Returns:
            float32 CPU tensor ``(R, H, W)``, ``R`` the adapter's reference images: the weight on reference ``r``'s
            tokens, averaged over heads, then over the selected layers and steps. It sums to 1 over ``R`` (with
            masks: wherever some reference's mask reaches). One layer and one step at that layer's own grid give
            exactly that layer's softmax shares.
        """
        chosen, picked = self._map_selection(call, item, adapter, kind, branch, layers, steps)
        return self._maps.shares(call, item, adapter, kind, branch, chosen, picked, check_size(size), _per_token)

    def reference_weights(
        self,
        call: int = 0,
        item: int = 0,
        adapter: int = 0,
        kind: str = "attention",
        branch: str = "cond",
        layers: LayerSelection = None,
        steps: Iterable[int] | None = None,
    ) -> dict[tuple[int, str], torch.Tensor]:
        """Each recorded (step, layer)'s weights over the references at every query position, at the layer's own grid
        (arguments as in :meth:`reference_maps`).

        Returns:
            ``(step, layer id) -> (Q, R)`` float64 CPU tensors: per position, the weight on each reference's tokens,
            averaged over heads (renormalised over the references under masks; an edit's weights as it left them).
        """
        chosen, picked = self._map_selection(call, item, adapter, kind, branch, layers, steps)
        weights = self._maps.reference_weights(call, item, adapter, kind, branch, chosen, picked)
        return {(step, self.layers[index].name): value for (step, index), value in weights.items()}

    def _map_selection(self, call, item, adapter, kind, branch, layers, steps) -> tuple[list[int], list[int]]:
        """Check a reference-map request; return the chosen layer positions and recorded steps."""
        self._map_source()
        info = self._map_call(call)
        if kind not in ("attention", "nw"):
            raise ValueError(f'kind: expected "attention" or "nw", got {kind!r}')
        if branch not in info["branches"]:
            raise ValueError(f"branch: expected one of the labels {list(info['branches'])}, got {branch!r}")
        if not isinstance(adapter, int) or not 0 <= adapter < self.num_adapters:
            raise ValueError(f"adapter: expected an index below {self.num_adapters}, got {adapter!r}")
        if not isinstance(item, int) or item < 0:
            raise ValueError(f"item: expected a non-negative image index, got {item!r}")
        chosen = select_layers([layer.name for layer in self.layers], layers)
        recorded = self.map_steps(call)
        picked = recorded if steps is None else [s for s in recorded if s in set(steps)]
        if not picked:
            raise ValueError(f"steps={steps!r}: none recorded with maps in call {call} (recorded: {recorded})")
        return chosen, picked

    def token_maps(self, *args, **kwargs) -> torch.Tensor:
        """:meth:`reference_maps` per image token: ``(R, T, H, W)``, ``T`` tokens per reference (4 for a base
        IP-Adapter, 16 for Plus); summing over ``T`` gives :meth:`reference_maps`."""
        return self.reference_maps(*args, _per_token=True, **kwargs)

    def keep_head_maps(self) -> None:
        """Also keep the shares and contributions per head (call it inside the block, before the pipeline runs)."""
        if self._maps is None:
            raise ValueError("per-head maps need probe(pipe, maps=True)")
        self._maps.keep_heads()

    def contributions(self, call: int = 0, item: int = 0, adapter: int = 0, branch: str = "cond", heads=False):
        """Each (step, layer position)'s contributions per reference at every query position of ``call``'s
        ``item`` of ``branch``: ``{(step, layer index): (3, Q, R)}`` float64 CPU tensors (norm, share, projection;
        :meth:`~.maps.MapAccumulator.contribution_weights`), per head ``(3, H, Q, R)`` with ``heads=True`` (after
        :meth:`keep_head_maps`)."""
        layers, steps = range(len(self.layers)), self.map_steps(call)
        return self._map_source().contribution_weights(call, item, adapter, branch, layers, steps, heads)

    def head_shares(self, call: int = 0, item: int = 0, adapter: int = 0, branch: str = "cond"):
        """Each (step, layer position)'s attention weights over the references per head and query position,
        ``{(step, layer index): (H, Q, R)}`` float64 CPU tensors (after :meth:`keep_head_maps`)."""
        layers, steps = range(len(self.layers)), self.map_steps(call)
        return self._map_source().head_weights(call, item, adapter, branch, layers, steps)

    def map_table(self, branch: str | None = None):
        """Per (call, step, layer, adapter, branch, item): how often attention and NW pick the same dominant
        reference, and their mean total-variation distance (:data:`~.maps.MAP_TABLE_COLUMNS`), from reference shares
        averaged over heads (``attrs["mean_over"]``). ``branch``: one CFG branch (``"cond"``), or ``None`` for each on
        its own rows; never average across them: uncond rows are 1 and 0 by construction (equal reference tokens)."""
        table = map_statistics(self._map_source(), self._finished()["calls"], [layer.name for layer in self.layers])
        table = select_branch(table, branch, "map_table")
        table.attrs["mean_over"] = ("head",)
        return table

    def reference_mass(self, branch: str | None = None):
        """Per (call, step, layer, adapter, branch) and reference image: its mean share of the attention and of the NW
        weights over heads, query positions and the branch's items (``attrs["mean_over"]``;
        :data:`~.maps.REFERENCE_MASS_COLUMNS`). ``branch`` as in :meth:`map_table`."""
        table = reference_mass(self._map_source(), self._finished()["calls"], [layer.name for layer in self.layers])
        table = select_branch(table, branch, "reference_mass")
        table.attrs["mean_over"] = ("head", "position", "item")
        return table

    def plot_reference_maps(self, call: int = 0, item: int = 0, adapter: int = 0, **kwargs):
        """Figure of :meth:`reference_maps` at early / middle / late steps, attention beside NW (see
        :func:`~.mapplots.plot_reference_maps` for ``image``, ``references``, ``branch``, ``layers``, ``ranges``)."""
        return plot_reference_maps(self, call, item, adapter, **kwargs)
