"""``ipa-probe probe``: generate once with the probe on and write the image, table, summary and plot."""

from __future__ import annotations

import argparse
import logging
from contextlib import ExitStack
from pathlib import Path

from .._checks import DEFAULT_GAUGE_FACTORS, GAUGE_FACTOR_RANGE, check_gauge_ranges, parse_gauges
from ..runfolder import MANIFEST_NAME
from ..statistics.schema import QUERY_FRAMES, ROW_KEY_BUDGET, SAMPLE_GROUPS
from ._common import (
    DIGITS_DEFAULTS,
    add_model_arguments,
    add_overwrite_argument,
    add_tracker_arguments,
    argument_type,
    bandwidth_type,
    check_model_arguments,
    check_output_dir,
    check_run_folder,
    check_tracker_arguments,
    claimed_output,
    images_type,
    load_pipeline,
    logging_dir,
    run_key,
)
from ._errors import CLIError, cli_errors

COMMAND = "ipa-probe probe"


logger = logging.getLogger(__name__)


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "probe",
        help="record IP-Adapter attention vs Gaussian NW weights during one generation",
        description="Generate with the probe on. With no model arguments it runs the trained digits organism shipped "
        "in the package (--kind digits), offline.",
    )
    add_model_arguments(parser, default_kind="digits")
    bandwidth = bandwidth_type("matched", "fit")
    parser.add_argument("--bandwidth", type=bandwidth, default="matched", help="'matched' (default), 'fit' or h > 0")
    parser.add_argument("--layers", action="append", help="regex selecting layer ids (repeatable; default: all)")
    parser.add_argument(
        "--query-frame",
        choices=QUERY_FRAMES,
        default="item",
        help="the pool of queries the query-frame key term is estimated over: one batch item's positions (default) "
        "or every item of one CFG branch (docs/gauge.md, 'The query frame')",
    )
    parser.add_argument(
        "--rows",
        type=_rows_type,
        default="auto",
        metavar="auto|none|N",
        help="query rows per cell for the per-row statistics: 'auto' (default: exact where a cell's rows x keys "
        f"<= {ROW_KEY_BUDGET:,}, a 64-256-row stratified sample with standard errors beyond), 'none' (exact "
        "everywhere) or N (exact up to N rows per cell, a sample of N beyond); docs/measured.md, 'The curve at "
        "every adapter size'",
    )
    parser.add_argument(
        "--compile",
        action="store_true",
        help="run the per-row statistics through torch.compile (one compile per process: 21 min on a loaded 2-core "
        "CPU, where it ran 0.81x as fast as eager; for long runs on a GPU; eager with a warning where torch cannot "
        "compile; the same numbers to 1e-6)",
    )
    parser.add_argument("--keep-maps", action="store_true", help="also save the full attention maps (fp16, .pt)")
    parser.add_argument("--maps", action="store_true", help="also write reference_maps.png and map_table.parquet")
    parser.add_argument(
        "--overlays",
        metavar="DIR",
        help="write each reference's map beside the first generated image, with a colorbar, into DIR (implies --maps)",
    )
    parser.add_argument(
        "--overlay-steps",
        action="store_true",
        help="with --overlays, also one overlay per layer group and step (DIR/refN/GROUP_stepSSS.png)",
    )
    parser.add_argument(
        "--num-images",
        type=images_type,
        default=None,
        help="images per prompt, one seeded batch (default: 8 on the digits organism, so that the demo shows a rate "
        "and not one lucky or unlucky draw; else 1)",
    )
    parser.add_argument(
        "--gauge-sweep",
        nargs="?",
        const=DEFAULT_GAUGE_FACTORS,
        type=_gauges_type,
        metavar="G,G,...",
        help="instead of one probed generation, rerun it with every IP layer reparametrised by each gauge (outputs "
        "unchanged) and write gauge_sweep.parquet / .csv / .png: what rho, its baseline and excess do per gauge. "
        f"A gauge is a factor c in [{GAUGE_FACTOR_RANGE[0]:g}, {GAUGE_FACTOR_RANGE[1]:g}] (q -> c q, k -> k/c), "
        "random[:SEED[:SPREAD]] (per-head orthogonal x diag(exp N(0, SPREAD))), adversarial[:up|down[:MAXCOND]] "
        "(a cond <= MAXCOND basis change searched to push rho up or down) or shift[:SEED[:SCALE]] (the same random "
        f"vector added to every image key) (default: {','.join(f'{c:g}' for c in DEFAULT_GAUGE_FACTORS)}; "
        "docs/gauge.md)",
    )
    parser.add_argument("--out", default="outputs/probe", help="output folder (default: outputs/probe)")
    add_overwrite_argument(parser)
    add_tracker_arguments(parser)
    parser.set_defaults(func=run, check=check, writes=_writes)


def _writes(args: argparse.Namespace) -> list[Path]:
    """The folders this run writes, locked before torch loads: ``--out`` and a separate ``--overlays``."""
    return [Path(args.out)] + ([Path(args.overlays)] if _separate_overlays(args) else [])


def _rows_type(value: str) -> int | str | None:
    """``--rows``: ``auto``, ``none`` or an int >= 16 (ProbeConfig.rows)."""
    if value in ("auto", "none"):
        return None if value == "none" else value
    try:
        rows = int(value)
    except ValueError:
        rows = 0
    if rows < 2 * SAMPLE_GROUPS:
        raise argparse.ArgumentTypeError(f"expected auto, none or an int >= {2 * SAMPLE_GROUPS}, got {value!r}")
    return rows


_gauges_type = argument_type(lambda v: parse_gauges(v, "--gauge-sweep"), "gauges")


def check(args: argparse.Namespace) -> None:
    """Before torch loads: ``--out``, ``--overlays``, the tracker, the model arguments and the reference images."""
    if args.gauge_sweep is not None and (args.keep_maps or args.maps or args.overlays or args.log_with):
        raise CLIError(
            "--gauge-sweep writes its own table and figure; drop --keep-maps / --maps / --overlays / --log-with"
        )
    if args.gauge_sweep is not None:
        with cli_errors():  # what the weights' dtype holds, before torch loads
            check_gauge_ranges(args.gauge_sweep, args.dtype)
    check_output_dir(args.out)
    if args.overlay_steps and not args.overlays:
        raise CLIError("--overlay-steps needs --overlays DIR")
    if args.overlays:
        check_output_dir(args.overlays, "--overlays")
    check_tracker_arguments(args)
    check_model_arguments(args)
    check_run_folder(args.out, COMMAND, run_key(args), args.overwrite)
    if _separate_overlays(args):
        check_run_folder(args.overlays, COMMAND, run_key(args), args.overwrite, flag="--overlays")


def _separate_overlays(args: argparse.Namespace) -> bool:
    """``--overlays DIR`` names a folder outside ``--out``: it gets its own manifest."""
    if not args.overlays:
        return False
    out, overlays = Path(args.out).expanduser().resolve(), Path(args.overlays).expanduser().resolve()
    return out != overlays and out not in overlays.parents


def _claim(args: argparse.Namespace, stack: ExitStack) -> tuple[Path, Path | None]:
    """Hold ``--out`` (and a separate ``--overlays`` folder) for this run, before the work: returns the staging
    folders the run writes into (the overlays' is ``None`` when they go under ``--out``); they are renamed into place
    when the run is whole."""
    out = stack.enter_context(claimed_output(args.out, COMMAND, args, run_key(args))).staging
    overlays = None
    if _separate_overlays(args):
        overlays = stack.enter_context(
            claimed_output(args.overlays, COMMAND, args, run_key(args), flag="--overlays")
        ).staging
    return out, overlays


def run(args: argparse.Namespace) -> int:
    if args.gauge_sweep is not None:
        return _gauge_sweep(args)
    import torch

    from ..capture.run import probe

    with ExitStack() as stack:
        staging = _claim(args, stack)  # before the work: a conflict answers before the generation
        loaded = load_pipeline(args)
        generator = torch.Generator(device=loaded.pipe.device).manual_seed(args.seed)
        organism = args.model is None and args.kind == "digits"
        num_images = args.num_images or (DIGITS_DEFAULTS["images"] if organism else 1)
        loaded.description["num_images"] = num_images
        maps = args.maps or bool(args.overlays)
        try:
            options = {
                "layers": args.layers,
                "keep_maps": args.keep_maps,
                "maps": maps,
                "query_frame": args.query_frame,
                "rows": args.rows,
                "compile": args.compile,
            }
            with probe(loaded.pipe, bandwidth=args.bandwidth, **options) as run_:
                result = loaded.pipe(
                    ip_adapter_image=[loaded.references],
                    generator=generator,
                    num_images_per_prompt=num_images,
                    **loaded.call_kwargs,
                )
        except ValueError as err:
            raise CLIError(str(err)) from None
        line = _write(args, loaded, result, run_, staging, organism, maps)
    print(line)
    return 0


def _write(args: argparse.Namespace, loaded, result, run_, staging, organism: bool, maps: bool) -> str:
    """Write the probed generation's files into the staging folders; return the line that lists them."""
    import torch

    out, overlays = staging
    if args.overlays and overlays is None:  # under --out: into --out's staging folder
        overlays = out / Path(args.overlays).expanduser().resolve().relative_to(Path(args.out).expanduser().resolve())

    from .._io import atomic_path, write_image

    written = [f"{len(result.images)} image(s)", "references_and_output.png"]
    for i, image in enumerate(result.images):
        write_image(image, out / f"image_{i}.png")
    judged = _digit_verdict(result.images, args.digit, out) if organism and not args.image else None
    _write_strip(loaded.references, result.images, judged, args.digit, out / "references_and_output.png")
    paths = run_.save(out, extra={"run": loaded.description})
    written += [paths["table"].name, paths["summary"].name, paths["plot"].name]
    if args.keep_maps:
        with atomic_path(out / "maps.pt") as temp:
            torch.save({"|".join(map(str, key)): value for key, value in run_.maps.items()}, temp)
        written.append("maps.pt")
    if maps:
        from ..capture.mapplots import save_reference_maps
        from ..capture.overlays import save_overlays

        written += [p.name for p in save_reference_maps(run_, out, result.images[0], [loaded.references]).values()]
        if args.overlays:
            files = save_overlays(run_, result.images[0], overlays, per_layer_step=args.overlay_steps)
            written.append(f"{len(files)} overlay(s) in {args.overlays}")
    if judged is not None:
        written.append("digits.json")
    if args.log_with:
        readings = None
        if judged is not None:
            labels, probs = judged
            readings = [
                f"read as {v} (P({args.digit}) = {p[args.digit]:.2f})" for v, p in zip(labels, probs, strict=True)
            ]
        content = {"images": result.images, "references": loaded.references, "readings": readings}
        folder = run_.log(args.log_with, logging_dir(args, out), None, settings=loaded.description, **content)
        shown = Path(args.out) / folder.relative_to(out) if folder.is_relative_to(out) else folder
        written.append(f"{args.log_with} logs in {shown}")
    written.append(f"{MANIFEST_NAME} (which files are this run's)")
    summary = run_.summary()
    cond = summary[summary["branch"] == "cond"]
    last = cond.iloc[-1] if len(cond) else None
    line = f"wrote {args.out}: " + ", ".join(written)
    if last is not None:  # one short line per finding; the detail is in the files named
        line += (f"\nquery-frame rho at the last step (t={last['timestep']:g}): {last['qf_spearman']:.3f} against its "
                 f"baseline {last['qf_rho_baseline']:.3f} ({last['query_frame']} frame, gauge-invariant; every step: "
                 "rho_by_timestep.png, summary.json)")  # fmt: skip
        line += (f"\nstored-frame rho: {last['spearman']:.3f} against its baseline {last['rho_baseline']:.3f} "
                 "(gauge-dependent: docs/gauge.md)")  # fmt: skip
    if "qf_pool_shift" in summary and not summary["qf_pools_coincide"].all():
        shift = summary["qf_pool_shift"].abs().max()
        line += (f"\nquery pool: the other pool moves the query-frame rho by up to {shift:.3f} (in words: "
                 "summary.json's query_pool; docs/api.md)")  # fmt: skip
    if judged is not None:
        labels = judged[0]
        right = int((labels == args.digit).sum())
        listed = " ".join(map(str, labels.tolist()))
        line += f"\ndigit classifier: {right} of {len(labels)} images drawn as {args.digit} (read as: {listed})"
    return line


#: The columns the gauge-sweep figure draws per gauge and step (with ``neff_attn``), whose values its provenance
#: keeps: the stored frame's rho, baseline and excess, and the query frame's rho (both forms) and excess.
_GAUGE_FIGURE_COLUMNS = ("spearman", "rho_baseline", "rho_excess", "qf_spearman", "qf_gauss_spearman", "qf_rho_excess")


def _gauge_sweep(args: argparse.Namespace) -> int:
    """``--gauge-sweep``: :func:`ipa_probe.gauge.gauge_sweep` of the same generation; writes the table and figure."""
    from .._io import write_figure, write_table
    from ..gauge import plot_gauge_sweep

    with ExitStack() as stack:
        staging, _ = _claim(args, stack)  # before the work: a conflict answers before the generations
        table, image, stamp = _gauge_table(args)
        for suffix in (".parquet", ".csv"):
            write_table(table, staging / f"gauge_sweep{suffix}")
        write_figure(plot_gauge_sweep(table), staging / "gauge_sweep.png", provenance=stamp)
    out = Path(args.out)
    first = image[image["step"] == image["step"].min()]  # in the sweep's order of gauges
    gauges = "; ".join(first["gauge"])
    rho = "/".join(f"{v:.3f}" for v in first["spearman"])
    excess = "/".join(f"{v:+.3f}" for v in first["rho_excess"])
    where = f"t={first['timestep'].iloc[0]:g}, {first['branch'].iloc[0]}"
    query = ""
    if "qf_spearman" in first.columns:
        qf = "/".join(f"{v:.4f}" for v in first["qf_spearman"])
        qf_excess = "/".join(f"{v:+.4f}" for v in first["qf_rho_excess"])
        query = f"query-frame rho (exact b) {qf}, its excess {qf_excess}; "
    print(
        f"wrote {out}: gauge_sweep.parquet, gauge_sweep.csv, gauge_sweep.png, {MANIFEST_NAME}; first step ({where}) "
        f"under {gauges}: {query}stored-frame rho {rho}, rho_excess {excess}; outputs equal to the ungauged one "
        f"within {table['output_max_abs_diff'].max():.3g}"
    )
    return 0


def _gauge_table(args: argparse.Namespace):
    """The gauge sweep's table, the rows its figure draws, and the figure's provenance stamp."""
    import torch

    from .._io import code_digest
    from ..gauge import gauge_sweep, plot_gauge_sweep

    loaded = load_pipeline(args)
    pipe = loaded.pipe
    organism = args.model is None and args.kind == "digits"
    num_images = args.num_images or (DIGITS_DEFAULTS["images"] if organism else 1)

    def call():
        generator = torch.Generator(device=pipe.device).manual_seed(args.seed)
        return pipe(
            ip_adapter_image=[loaded.references],
            generator=generator,
            num_images_per_prompt=num_images,
            output_type="np",
            **loaded.call_kwargs,
        )

    with cli_errors(ValueError, RuntimeError):
        table = gauge_sweep(pipe, call, args.gauge_sweep, bandwidth=args.bandwidth, layers=args.layers)
    image = table[(table["kind"] == "image") & (table["branch"] == "cond")]
    if image.empty:
        image = table[table["kind"] == "image"]
    # the numbers the figure draws; they move by ~1e-6 between CPUs, 1e-3 is far below a visible change
    drawn = image[  # per gauge in the sweep's order, per step
        [c for c in (*_GAUGE_FIGURE_COLUMNS, "neff_attn") if c in image.columns]
    ]
    stamp = {"code": code_digest(plot_gauge_sweep), "data": drawn.round(6).to_numpy().ravel().tolist(), "atol": 1e-3}
    return table, image, stamp


def strip_code() -> tuple:
    """The code the references-and-output strip depends on (its provenance digest; :func:`_write_strip` stamps the
    same, its source unchanged so that the committed figure's digest holds)."""
    from ..images import plot_image_strip

    return (plot_image_strip, _write_strip)


def _write_strip(references: list, images: list, judged, digit: int, path) -> None:
    """The references and the generated images as one titled strip; on the organism with the classifier's verdict
    under each image. The PNG carries its provenance: the drawing code's digest and per-image fingerprints."""
    import numpy as np

    from .._io import code_digest, write_figure
    from ..figstyle import DOUBLE_COLUMN
    from ..images import plot_image_strip

    brightness = [round(float(np.asarray(im.convert("L"), dtype=np.float64).mean() / 255.0), 3) for im in images]
    if judged is None:
        title = f"{len(references)} reference(s), then the generated images"
        fig = plot_image_strip(references, images, title=title, width=DOUBLE_COLUMN)
        fingerprint = brightness
    else:
        labels, probs = judged
        captions = [f"reads {label}" for label in labels.tolist()]
        right = int((labels == digit).sum())
        title = (
            f"{len(references)} references of a {digit}, then {len(images)} generated images\n"
            f"the digit classifier reads {right} of {len(images)} as a {digit} (under each: green right, red wrong)"
        )
        fig = plot_image_strip(references, images, captions, [bool(v == digit) for v in labels], title=title,
                               width=DOUBLE_COLUMN)  # fmt: skip
        fingerprint = brightness + [round(float(p), 3) for p in probs[:, digit]]
    # tolerance: pixels and classifier probabilities move by ~1e-6 between CPUs; 0.02 is far below a visible change
    stamp = {"code": code_digest(plot_image_strip, _write_strip), "data": fingerprint, "atol": 0.02}
    write_figure(fig, path, provenance=stamp)


def _digit_verdict(images: list, digit: int, out):
    """Classify the organism's images with the digit classifier and write ``digits.json``; return
    ``(labels, probabilities)``."""
    from .._io import write_json
    from ..tiny.digits import classify_digit_images, digit_classifier
    from ..tiny.digits.evaluate import CLASSIFIER

    labels, probs = classify_digit_images(images)
    right = int((labels == digit).sum())
    write_json(
        out / "digits.json",
        {
            "digit": digit,
            "right": right,
            "images": len(labels),
            "predicted": labels.tolist(),
            "confidence_in_digit": probs[:, digit].tolist(),
            "classifier": f"{CLASSIFIER} (ipa_probe.tiny.digits.digit_classifier)",
            "classifier_held_out_accuracy": digit_classifier()[1],
        },
    )
    return labels, probs
