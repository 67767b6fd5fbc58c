"""The results of a probe run, read after its ``with`` block: :class:`RunViews`, the :class:`~.run.ProbeRun` methods
that turn its buffers into the tidy table, the per-timestep summary, the figure, a saved run folder and a tracker's
log. Capture lives in :mod:`.run`; the tables and figures themselves in :mod:`.report`; the reference maps' views in
:mod:`.map_views`."""

from __future__ import annotations

from typing import Any

from .config import rows_statement
from .report import plot_run, query_pool_note, run_table, save_run, select_branch, summarize

__all__ = ["RunViews"]


class RunViews:
    """Result accessors of :class:`~.run.ProbeRun` (it provides ``_result``, ``_row_plan``, ``config``, ``layers``
    and ``text_slot``)."""

    def _finished(self) -> dict[str, Any]:
        if self._result is None:
            raise RuntimeError("the probe is still running: read results after the `with ipa_probe.probe(...)` block")
        return self._result

    def to_dataframe(self):
        """The tidy table: one row per call × step × layer × head × CFG branch × adapter (see README for columns),
        with ``edits``: the interventions that acted at that step, in the order they act (``""`` for none)."""
        result = self._finished()
        table = run_table(result, [layer.name for layer in self.layers], self.config, self.text_slot)
        edits = {(c["index"], step): e for c in result["calls"] for step, e in c.get("edits", {}).items()}
        table["edits"] = [edits.get(key, "") for key in zip(table["call"], table["step"], strict=True)]
        return table

    def summary(self, branch: str | None = None):
        """Per-timestep means over layers x heads x adapters (``attrs["mean_over"]``) of :meth:`to_dataframe`, one row
        per call, step, kind and CFG branch (:func:`~ipa_probe.capture.report.summarize`). ``branch``: one CFG
        branch (``"cond"``, what the README reads), or ``None`` for each on its own rows. ``attrs["rows"]`` says which
        cells' per-row statistics were exact and which sampled, and why (:attr:`ProbeConfig.rows`).

        The query pool's effect is stated, in the last columns (:data:`~ipa_probe.capture.report.POOL_COLUMNS`) and
        in words in ``attrs["query_pool"]`` (:func:`~ipa_probe.capture.report.query_pool_note`): "the pools
        coincide" where each CFG branch held one item; otherwise how far the other ``query_frame`` would move each
        row's mean query-frame rho, and where that exceeds the mean's standard error over the row's cells
        (``qf_spearman_sem``: sd / sqrt(cells))."""
        table = select_branch(summarize(self.to_dataframe()), branch, "summary")
        table.attrs["mean_over"] = ("layer", "head", "adapter")
        table.attrs["rows"] = rows_statement(self.config.rows, self._row_plan)
        table.attrs["query_pool"] = query_pool_note(table)
        return table

    def plot(self, ax=None):
        """Matplotlib figure of the mean per-row Spearman against timestep, in the denoising direction."""
        return plot_run(self.to_dataframe(), ax=ax)

    def save(self, path, overwrite: bool = False, extra: dict | None = None):
        """Write ``probe.parquet``, ``summary.json`` (settings, versions, seeds) and ``rho_by_timestep.png`` into the
        folder ``path``, by the folder rules of the command line (:class:`ipa_probe.runfolder.RunFolder`): under the
        folder's lock, written aside and renamed into place when whole, with ``ipa_probe_manifest.json``. A folder
        holding another run's files, or files no manifest lists, raises ``ValueError`` unless ``overwrite`` (which
        replaces only the previous run's own files); a folder another process holds raises ``RuntimeError``.
        Returns ``{"table", "summary", "plot"}`` paths."""
        from ..runfolder import save_into

        settings = self.config.describe()

        def write(folder):
            return save_run(self.to_dataframe(), folder, settings=settings, extra=extra)

        return save_into(path, "ipa_probe ProbeRun.save", settings, write, overwrite=overwrite)

    def log(self, log_with: str, logging_dir="runs", run_name: str = "probe", **content):
        """Send the run to a tracker: rho with its baseline and null, per-layer rho, histograms, the overlays at every
        step, the settings with end-of-run metrics (see :mod:`ipa_probe.probe_log`). ``content``: ``images``,
        ``references``, ``readings``, ``settings`` of :func:`ipa_probe.trackers.log_probe_run`. Returns where the
        files are (TensorBoard: the folder of the event file)."""
        from ..trackers import log_probe_run

        self._finished()
        return log_probe_run(self, log_with, logging_dir, run_name, **content)
