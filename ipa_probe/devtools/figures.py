"""Every figure of README.md and docs/ from one command, and a check that each is current.

``make figures`` (``python -m ipa_probe.devtools.figures``) runs the organism's commands into a temporary folder and
copies their PNGs (``docs/images/``), and redraws each experiment's figures from its committed ``record.json``
(``docs/results/``). Every PNG carries its provenance (:func:`ipa_probe._io.read_provenance`), and ``--check`` (with
``--rerun``: the commands rerun) says per figure whether it is current. What each provenance holds and why no file
time is compared: docs/figures.md.
"""

from __future__ import annotations

import argparse
import importlib
import json
import shutil
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

__all__ = ["FIGURES", "Figure", "check", "main", "make", "record_figures"]

#: experiment folder name -> module under ipa_probe.experiments with ``plot`` and ``redraw(record, folder)``
EXPERIMENT_MODULES = {
    "collapse": "collapse",
    "shells": "shells",
    "scarcity": "scarcity",
    "heads": "heads",
    "attention": "attention",
    "ip-adapter": "ip_adapter",
    "attribution": "attribution",
}


@dataclass(frozen=True)
class Figure:
    """One figure of the docs.

    Attributes:
        path: the PNG, relative to the repository root.
        command: the command that makes it (``OUT`` is any output folder).
        what: what it shows, in one line.
        source: ``"command"`` (made by running ``command``; its PNG ``produces`` is copied) or ``"record"`` (redrawn
            from ``record``, a ``record.json`` relative to the root).
        produces: for a command, the file it writes under ``OUT`` that becomes ``path``.
        record: for a record figure, its ``record.json``.
    """

    path: str
    command: str
    what: str
    source: str
    produces: str = ""
    record: str = ""


def _probe_code() -> dict[str, str]:
    from .._io import code_digest
    from ..capture.mapplots import REFERENCE_MAP_CODE
    from ..cli.probe import strip_code

    return {
        "reference_maps.png": code_digest(*REFERENCE_MAP_CODE),
        "references_and_output.png": code_digest(*strip_code()),
    }


def _compare_code() -> dict[str, str]:
    from .._io import code_digest
    from ..compare import GRID_CODE

    return {"grid.png": code_digest(*GRID_CODE)}


def _gauge_code() -> dict[str, str]:
    from .._io import code_digest
    from ..gauge import plot_gauge_sweep

    return {"gauge_sweep.png": code_digest(plot_gauge_sweep)}


#: command -> (argv of ``ipa-probe`` with OUT for the output folder, the digests of the code of what it draws)
COMMANDS: dict[str, tuple[list[str], Callable[[], dict[str, str]]]] = {
    "ipa-probe probe --maps --out OUT": (["probe", "--maps", "--out", "OUT"], _probe_code),
    "ipa-probe compare --out OUT": (["compare", "--out", "OUT"], _compare_code),
    "ipa-probe probe --gauge-sweep --out OUT": (["probe", "--gauge-sweep", "--out", "OUT"], _gauge_code),
}

#: The figures made by a command on the embedded organism.
FIGURES: tuple[Figure, ...] = (
    Figure(
        "docs/images/reference_maps.png",
        "ipa-probe probe --maps --out OUT",
        "where each reference goes: attention beside NW shares per reference at early / middle / late steps, "
        "as deviation from uniform, with the dominant reference where it leads by > 0.05",
        "command",
        produces="reference_maps.png",
    ),
    Figure(
        "docs/images/demo_digits.png",
        "ipa-probe probe --maps --out OUT",
        "the demo: three references of a 3, then the eight generated digits with the classifier's verdict",
        "command",
        produces="references_and_output.png",
    ),
    Figure(
        "docs/images/compare_grid.png",
        "ipa-probe compare --out OUT",
        "references, references through the VAE, then the learned IP-Adapter, the NW head and the exact NW "
        "denoiser from the same seeds",
        "command",
        produces="grid.png",
    ),
    Figure(
        "docs/images/gauge_sweep.png",
        "ipa-probe probe --gauge-sweep --out OUT",
        "the q/k gauge on the organism per factor c: the stored-frame rho with its baseline, the query-frame rho "
        "(exact, Gaussian), each rho minus its baseline, and the attention n_eff",
        "command",
        produces="gauge_sweep.png",
    ),
)


def record_figures(root: Path) -> list[Figure]:
    """The experiments' figures under ``root/docs/results``, one per figure named in each ``record.json``."""
    out = []
    for record in sorted((root / "docs" / "results").glob("**/record.json")):
        folder = record.parent
        data = json.loads(record.read_text())
        relative = record.relative_to(root).as_posix()
        if folder.name in EXPERIMENT_MODULES:
            tier = data.get("tier", {}).get("name", "TIER")
            command = f"ipa-probe experiments {folder.name} --tier {tier} --out {folder.parent.relative_to(root)}"
            if tier not in ("quick", "smoke", "full", "paper"):  # a tier made in Python (docs/results/README.md)
                command = f"the Python in docs/results/README.md (tier {tier})"
            for name in data.get("figures", []):
                what = f"{folder.name} experiment, {folder.parent.name} results"
                path = (folder / name).relative_to(root).as_posix()
                out.append(Figure(path, command, what, "record", record=relative))
        elif folder.name == "scarcity_steps":
            command = f"python -m ipa_probe.experiments.scarcity_steps --out {folder.relative_to(root)}"
            path = (folder / "scarcity_steps.png").relative_to(root).as_posix()
            what = "learned vs plug-in MMD² against training steps"
            out.append(Figure(path, command, what, "record", record=relative))
    return out


def all_figures(root: Path) -> list[Figure]:
    return [*FIGURES, *record_figures(root)]


def _redraw(figure: Figure, root: Path, folder: Path) -> Path:
    """Redraw a record figure into ``folder``; returns the new PNG."""
    record = json.loads((root / figure.record).read_text())
    name = Path(figure.record).parent.name
    module = "scarcity_steps" if name == "scarcity_steps" else EXPERIMENT_MODULES[name]
    paths = importlib.import_module(f"ipa_probe.experiments.{module}").redraw(record, folder)
    wanted = Path(figure.path).name
    return next(p for p in paths if p.name == wanted)


def _record_stamp(figure: Figure, root: Path) -> dict:
    """The provenance a record figure drawn now would carry (code and inputs digests), drawn into a temp folder."""
    from .._io import read_provenance

    with tempfile.TemporaryDirectory() as temp:
        return read_provenance(_redraw(figure, root, Path(temp)))


def _run_command(command: str, folder: Path) -> None:
    from ..cli import main as cli

    argv = [str(folder) if arg == "OUT" else arg for arg in COMMANDS[command][0]]
    code = cli(argv)
    if code != 0:
        raise RuntimeError(f"`{command}` exited with code {code}")


def make(root: Path, only: list[str] | None = None, log=print) -> list[Path]:
    """Remake the figures (all, or those whose path contains one of ``only``); returns the paths written."""
    root = Path(root)
    chosen = [f for f in all_figures(root) if not only or any(o in f.path for o in only)]
    written = []
    commands = sorted({f.command for f in chosen if f.source == "command"})
    for command in commands:
        with tempfile.TemporaryDirectory() as temp:
            log(f"running {command}")
            _run_command(command, Path(temp) / "out")
            for figure in chosen:
                if figure.command == command:
                    shutil.copyfile(Path(temp) / "out" / figure.produces, root / figure.path)
                    written.append(root / figure.path)
    for figure in chosen:
        if figure.source == "record":
            with tempfile.TemporaryDirectory() as temp:
                shutil.copyfile(_redraw(figure, root, Path(temp)), root / figure.path)
            written.append(root / figure.path)
    for path in written:
        log(f"wrote {path.relative_to(root)}")
    return written


def check(root: Path, rerun: bool = False, only: list[str] | None = None) -> dict[str, list[str]]:
    """Per figure, what is wrong with it (an empty list when it is current).

    A figure is current when it exists, carries provenance, its code digest is the current code's, and: for a
    record figure, its inputs digest is that of its ``record.json`` (which must name the versions it ran with); for
    a command figure with ``rerun``, its data match what the command makes today within the stored tolerance.
    ``only``: check just the figures whose path contains one of these.
    """
    import numpy as np

    from .._io import read_provenance

    root = Path(root)
    problems: dict[str, list[str]] = {}
    fresh: dict[str, Path] = {}
    temps = []
    try:
        for figure in all_figures(root):
            if only and not any(o in figure.path for o in only):
                continue
            issues = problems.setdefault(figure.path, [])
            path = root / figure.path
            if not path.exists():
                issues.append("missing")
                continue
            stamp = read_provenance(path)
            if stamp is None:
                issues.append("carries no provenance (made before `make figures`)")
                continue
            if figure.source == "record":
                record = json.loads((root / figure.record).read_text())
                if "versions" not in record:
                    issues.append(f"{figure.record} names no versions")
                now = _record_stamp(figure, root)
                if stamp.get("code") != now["code"]:
                    issues.append("drawn by other code than today's (run `make figures`)")
                if stamp.get("inputs") != now["inputs"]:
                    issues.append(f"drawn from other numbers than {figure.record} holds (run `make figures`)")
                continue
            if stamp.get("code") != COMMANDS[figure.command][1]()[figure.produces]:
                issues.append("drawn by other code than today's (run `make figures`)")
            if not rerun:
                continue
            if figure.command not in fresh:
                temp = tempfile.TemporaryDirectory()
                temps.append(temp)
                _run_command(figure.command, Path(temp.name) / "out")
                fresh[figure.command] = Path(temp.name) / "out"
            now = read_provenance(fresh[figure.command] / figure.produces)
            old, new = np.asarray(stamp.get("data", []), float), np.asarray(now["data"], float)
            if old.shape != new.shape or not np.allclose(old, new, atol=float(stamp.get("atol", 0.0)), rtol=0):
                issues.append(f"its data differ from what `{figure.command}` makes today (run `make figures`)")
    finally:
        for temp in temps:
            temp.cleanup()
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ipa_probe.devtools.figures", description=__doc__.split("\n")[0])
    parser.add_argument("--root", default=".", help="the repository root (default: the current folder)")
    parser.add_argument("--only", nargs="+", help="remake only the figures whose path contains one of these")
    parser.add_argument("--check", action="store_true", help="check instead of remaking (exit code 1 if stale)")
    parser.add_argument("--rerun", action="store_true", help="with --check, rerun the commands and compare data")
    parser.add_argument("--list", action="store_true", help="list the figures and their commands")
    args = parser.parse_args(argv)
    root = Path(args.root)
    if args.list:
        for figure in all_figures(root):
            print(f"{figure.path}\t{figure.command}")
        return 0
    if args.check:
        problems = {k: v for k, v in check(root, args.rerun).items() if v}
        for path, issues in problems.items():
            print(f"{path}: {'; '.join(issues)}")
        print("all figures current" if not problems else f"{len(problems)} figure(s) not current")
        return 1 if problems else 0
    make(root, args.only)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
