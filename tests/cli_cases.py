"""Bad command lines that ``ipa-probe`` must refuse before torch, diffusers or pandas load: the cases, the files they
need, and a driver that runs them in a fresh process and reports what each printed and imported.

Shared by ``tests/test_cli_checks.py`` (which checks the answers and the imports) and ``benchmarks/cli_latency.py``
(which times each as a user would run it). Imports neither torch nor pandas: the fixture weights are written with
``safetensors.numpy``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

#: modules whose import a refusal must not wait for
HEAVY = ("torch", "diffusers", "transformers", "pandas", "pyarrow", "open_clip")


@dataclass(frozen=True)
class Case:
    """One command line (``{root}`` stands for the fixture folder), the exit code and a part of the one line."""

    name: str
    argv: tuple[str, ...]
    code: int
    message: str
    env: tuple[tuple[str, str], ...] = field(default=())  # extra environment (huggingface_hub reads it on import)


#: the hub cannot be reached: a local port nothing listens on refuses at once, with no network at all
UNREACHABLE = (("HF_ENDPOINT", "http://127.0.0.1:9"), ("HF_HUB_OFFLINE", "0"), ("TRANSFORMERS_OFFLINE", "0"))
OFFLINE = (("HF_HUB_OFFLINE", "1"),)
REAL = ("--image", "{root}/ref.png")  # a reference image: real weights need one

CASES = [
    # manifests
    Case("empty manifest", ("sweep", "{root}/empty.jsonl"), 2, "is empty"),
    Case("header-only CSV", ("sweep", "{root}/header.csv"), 2, "has a CSV header but no rows"),
    Case("non-UTF-8 manifest", ("sweep", "{root}/latin1.jsonl"), 2, "is not UTF-8"),
    Case("JSON array manifest", ("sweep", "{root}/array.jsonl"), 2, "a JSON array"),
    Case("unknown CSV columns", ("sweep", "{root}/unknown.csv"), 2, "unknown column(s) 'colour'"),
    Case("manifest is a folder", ("sweep", "{root}/refs"), 2, "is a folder"),
    Case("no row can run", ("sweep", "{root}/missing_images.jsonl"), 2, "none of its 2 rows can run"),
    Case("--maps-rows not in manifest", ("sweep", "{root}/ok.jsonl", "--maps-rows", "7"), 2, "--maps-rows 7: not"),
    Case(  # issue 39: the line listed every runnable row (129 KB for a large manifest)
        "--maps-rows in a large manifest",
        ("sweep", "{root}/many.jsonl", "--maps-rows", "9999", "9998", "1", "5001", "5002", "5003", "5004"),
        2,
        "--maps-rows 5001, 5002, 5003, 5004, 9998 and 1 more: not rows of the manifest that can run (rows that can: "
        "0-4999)",
    ),
    # paths and values
    Case("--out names a file", ("probe", "--out", "{root}/a_file"), 2, "is a file"),
    Case("--out under a file", ("compare", "--out", "{root}/a_file/sub"), 2, "is a file"),
    Case("--digit 11", ("probe", "--digit", "11"), 2, "--digit"),
    Case("--size 7 9", ("probe", "--size", "7", "9"), 2, "--size must be two multiples of 8"),
    Case("--device nonsense", ("probe", "--device", "nonsense"), 2, "torch device"),
    Case("--threads 0", ("probe", "--threads", "0"), 2, "--threads"),
    Case("--rows 8", ("probe", "--rows", "8"), 2, "--rows: expected auto, none or an int >= 16"),
    Case("--rows all", ("probe", "--rows", "all"), 2, "--rows: expected auto, none or an int >= 16"),
    Case("--image not an image", ("probe", "--image", "{root}/a_file"), 2, "not an image"),
    Case("--image missing", ("compare", "--image", "{root}/nope.png"), 2, "does not exist"),
    Case("sweep --seed -1", ("sweep", "{root}/ok.jsonl", "--seed", "-1"), 2, "--seed"),
    Case("compare --seeds 1 1", ("compare", "--seeds", "1", "1"), 2, "repeated values"),
    Case("compare --clip-pretrained missing", ("compare", "--clip-pretrained", "./nope.pt"), 2, "does not exist"),
    Case("compare --nw-frame bogus", ("compare", "--nw-frame", "bogus"), 2, "argument --nw-frame: invalid choice"),
    Case(
        "compare --nw-frame query --bandwidth 0.5",
        ("compare", "--nw-frame", "query", "--bandwidth", "0.5"),
        2,
        "does not apply to --nw-frame query",
    ),
    Case("train-digits --steps 0", ("train-digits", "--steps", "0"), 2, "--steps"),
    Case("train-digits --out a file", ("train-digits", "--out", "{root}/a_file"), 2, "is a file"),
    Case("bogus experiment", ("experiments", "bogus"), 2, "unknown experiment 'bogus'"),
    Case("bogus tier", ("experiments", "all", "--tier", "bogus"), 2, "unknown tier 'bogus'"),
    Case("experiments --dims 99", ("experiments", "collapse", "--dims", "99"), 2, "out of range"),
    Case(
        "bogus recipe",
        ("experiments", "attribution", "--recipe", "nope"),
        2,
        "argument --recipe: invalid choice: 'nope'",
    ),
    Case(
        "another tier's folder",
        ("experiments", "collapse", "--tier", "quick", "--out", "{root}/smoke_results"),
        2,
        "holds results of tier 'smoke'",
    ),
    Case(
        "--logging-dir without --log-with",
        ("sweep", "{root}/ok.jsonl", "--logging-dir", "{root}/logs"),
        2,
        "needs --log-with",
    ),
    Case("--overlay-steps without --overlays", ("probe", "--overlay-steps"), 2, "needs --overlays"),
    Case("--overlays names a file", ("probe", "--overlays", "{root}/a_file"), 2, "--overlays"),
    Case("--gauge-sweep 0,1", ("probe", "--gauge-sweep", "0,1"), 2, "--gauge-sweep: expected gauge factors in ["),
    Case("--gauge-sweep 1,x", ("probe", "--gauge-sweep", "1,x"), 2, "--gauge-sweep: expected numbers c > 0, random"),
    # issue 31: a factor whose outputs are not finite blamed an unseeded `call` after the run
    Case("--gauge-sweep 1e300", ("probe", "--gauge-sweep", "1e300"), 2, "gauge factors in [9.53674e-07, 1.04858e+06]"),
    Case("--gauge-sweep random:x", ("probe", "--gauge-sweep", "random:x"), 2, "integer SEED"),
    Case("--gauge-sweep random:0:9", ("probe", "--gauge-sweep", "random:0:9"), 2, "SPREAD"),
    Case("--gauge-sweep adversarial:left", ("probe", "--gauge-sweep", "adversarial:left"), 2, "adversarial:up or"),
    Case("--gauge-sweep adversarial:up:1", ("probe", "--gauge-sweep", "adversarial:up:1"), 2, "MAXCOND in [1.001"),
    # issue 39: bounds the generators cannot reach were refused after the work, naming gauges / matrices
    Case(
        "--gauge-sweep adversarial:down:1.000001",
        ("probe", "--gauge-sweep", "adversarial:down:1.000001"),
        2,
        "MAXCOND in [1.001, 10000] (float32 weights cannot be held to a bound closer to 1), got "
        "'adversarial:down:1.000001'",
    ),
    Case("--gauge-sweep random:0:4", ("probe", "--gauge-sweep", "random:0:4"), 2, "random:0:4: a SPREAD of 4 makes"),
    Case(
        "--gauge-sweep random:0:1 float16",
        ("probe", "--gauge-sweep", "random:0:1", "--dtype", "float16"),
        2,
        "beyond the 64 that float16 weights hold; use a SPREAD of at most 0.64",
    ),
    Case("--gauge-sweep shift:0:1000", ("probe", "--gauge-sweep", "shift:0:1000"), 2, "shift:0:1000: beyond a SCALE"),
    # issue 39: run manifests are read as untrusted input, before torch loads
    Case("--out manifest a FIFO", ("probe", "--out", "{root}/m_fifo"), 2, "FIFO (named pipe), not a regular file"),
    Case(
        "--overlays manifest a FIFO",
        ("probe", "--overlays", "{root}/m_fifo"),
        2,
        "is a FIFO (named pipe), not a regular file",
    ),
    Case("--out manifest links /dev/zero", ("probe", "--out", "{root}/m_zero"), 2, "is a symbolic link"),
    Case("manifest started_ns 'abc'", ("sweep", "{root}/ok.jsonl", "--out", "{root}/m_abc"), 2, "'started_ns' is"),
    Case("manifest [1]", ("compare", "--out", "{root}/m_list"), 2, "is list, not a JSON object"),
    Case("manifest foreign 5", ("probe", "--out", "{root}/m_foreign", "--overwrite"), 2, "field 'foreign' is"),
    Case("manifest nested deep", ("experiments", "collapse", "--out", "{root}/m_deep"), 2, "nests"),
    Case("manifest NUL in a name", ("train-digits", "--out", "{root}/m_nul"), 2, "not a plain relative path"),
    Case(
        "a hand-edited file and --overwrite",
        ("probe", "--seed", "1", "--overwrite", "--out", "{root}/m_edited"),
        2,
        "summary.json changed after run r1 wrote it",
    ),
    Case(  # issue 39: found only after the run
        "OUT/logs is a file",
        ("probe", "--log-with", "tensorboard", "--out", "{root}/logs_file"),
        2,
        "logs' is a file",
    ),
    Case("--gauge-sweep shift:0:0", ("probe", "--gauge-sweep", "shift:0:0"), 2, "SCALE"),
    Case("--gauge-sweep 2,2", ("probe", "--gauge-sweep", "2,2"), 2, "distinct gauges"),
    Case("--gauge-sweep with --maps", ("probe", "--gauge-sweep", "--maps"), 2, "drop --keep-maps"),
    Case("lock is a folder", ("sweep", "{root}/ok.jsonl", "--out", "{root}/locked"), 1, "Is a directory"),
    # issue 31: what is not ours, paths that mean what they say, bounds before work
    Case("--out empty", ("probe", "--out", ""), 2, "--out is empty"),
    Case("--out blank", ("sweep", "{root}/ok.jsonl", "--out", "  "), 2, "--out is empty"),
    Case("--image empty", ("probe", "--image", ""), 2, "--image is empty"),
    Case("--logging-dir blank", ("probe", "--log-with", "tensorboard", "--logging-dir", " "), 2, "--logging-dir is"),
    # issue 41: tracker files inside a run folder would be files no manifest lists there, refusing its next run
    Case(
        "--logging-dir in another run",
        ("probe", "--log-with", "tensorboard", "--logging-dir", "{root}/a_run/tb"),
        2,
        "is inside the run folder '{root}/a_run' (it holds ipa_probe_manifest.json)",
    ),
    Case(
        "--logging-dir in --out",
        ("probe", "--log-with", "tensorboard", "--out", "{root}/own", "--logging-dir", "{root}/own/tb"),
        2,
        "is inside --out",
    ),
    Case("--out undecodable", ("probe", "--out", "o\udcff"), 2, "holds bytes that are not text"),
    Case("--out ~ expanded", ("probe", "--out", "~/a_file"), 2, "'{root}/a_file' is a file", (("HOME", "{root}"),)),
    Case("lock is a symlink", ("sweep", "{root}/ok.jsonl", "--out", "{root}/linked"), 1, "a symbolic link stands"),
    Case("lock is a FIFO", ("experiments", "collapse", "--out", "{root}/fifo_lock"), 1, "a FIFO (named pipe) stands"),
    Case("train-digits lock is a symlink", ("train-digits", "--out", "{root}/linked"), 1, "a symbolic link stands"),
    Case("manifest image is a FIFO", ("sweep", "{root}/fifo_image.jsonl"), 2, "is a FIFO (named pipe), not a regular"),
    Case("manifest is a FIFO", ("sweep", "{root}/fifo.jsonl"), 2, "manifest '{root}/fifo.jsonl' is a FIFO"),
    Case("--image a FIFO", ("probe", "--image", "{root}/fifo.png"), 2, "is a FIFO (named pipe), not a regular file"),
    Case("--image a device", ("compare", "--image", "/dev/null"), 2, "is a character device, not a regular file"),
    Case(
        "--ip-adapter a FIFO",
        ("probe", "--model", "{root}/model", "--ip-adapter", "{root}/fifo.safetensors", *REAL),
        2,
        "is a FIFO (named pipe), not a regular file",
    ),
    Case("experiments --seeds 2**64", ("experiments", "collapse", "--seeds", str(2**64)), 2, "argument --seeds"),
    Case("experiments --seeds 0 0", ("experiments", "collapse", "--seeds", "0", "0"), 2, "--seeds has repeated"),
    Case("experiments --dims 2 2", ("experiments", "collapse", "--dims", "2", "2"), 2, "--dims has repeated"),
    Case("experiments --ms 3 3", ("experiments", "scarcity", "--ms", "3", "3"), 2, "--ms has repeated"),
    Case("sweep --resamples 1e9", ("sweep", "{root}/ok.jsonl", "--resamples", "1000000000"), 2, "<= 100000"),
    Case("train-digits --max-refs 100000", ("train-digits", "--max-refs", "100000"), 2, "use at most 145"),
    Case(
        "train-digits mixed --max-refs 146",
        ("train-digits", "--recipe", "mixed", "--max-refs", "146"),
        2,
        "the mixed training draws a target's references from its class, and the rarest digit has 146 training "
        "images; use at most 145",
    ),
    Case(
        "train-digits adapter --max-refs 147",
        ("train-digits", "--recipe", "ip-adapter", "--max-refs", "147"),
        2,
        "use at most 146",
    ),
    Case(
        "train-digits --base missing",
        ("train-digits", "--recipe", "ip-adapter", "--base", "{root}/nope"),
        2,
        "--base '{root}/nope' does not exist",
    ),
    Case(
        "train-digits --base a file",
        ("train-digits", "--recipe", "ip-adapter", "--base", "{root}/a_file"),
        2,
        "is not a folder",
    ),
    Case(
        "train-digits --base without weights",
        ("train-digits", "--recipe", "ip-adapter", "--base", "{root}/refs"),
        2,
        "does not exist",
    ),
    # models and weights
    Case("--model ./nope", ("probe", "--model", "./nope", "--ip-adapter", "./x", *REAL), 2, "does not exist"),
    Case("--model without --ip-adapter", ("probe", "--model", "{root}/model", *REAL), 2, "needs --ip-adapter"),
    Case("--model without --image", ("probe", "--model", "a/b", "--ip-adapter", "c/d"), 2, "needs at least one"),
    Case("--ip-adapter without --model", ("probe", "--ip-adapter", "{root}/weights"), 2, "needs --model"),
    Case("--model a file", ("probe", "--model", "{root}/a_file", "--ip-adapter", "x", *REAL), 2, "is a file"),
    Case("--model no model_index", ("probe", "--model", "{root}/refs", "--ip-adapter", "x", *REAL), 2, "model_index"),
    Case(
        "truncated IP-Adapter file",
        ("probe", "--model", "{root}/model", "--ip-adapter", "{root}/weights/truncated.safetensors", *REAL),
        2,
        "truncated",
    ),
    Case(
        "random-bytes IP-Adapter file",
        ("probe", "--model", "{root}/model", "--ip-adapter", "{root}/weights/random.safetensors", *REAL),
        2,
        "is not a whole safetensors file",
    ),
    Case(
        "not IP-Adapter weights",
        ("probe", "--model", "{root}/model", "--ip-adapter", "{root}/weights/other.safetensors", *REAL),
        2,
        "not IP-Adapter weights",
    ),
    Case(
        "folder of several weight files",
        ("probe", "--model", "{root}/model", "--ip-adapter", "{root}/weights", *REAL),
        2,
        "pass --weight-name",
    ),
    Case(
        "file and another --weight-name",
        ("sweep", "{root}/ok.jsonl", "--model", "{root}/model", "--ip-adapter", "{root}/weights/ok.safetensors")
        + ("--weight-name", "x.safetensors"),
        2,
        "is a file",
    ),
    Case("hub id not a repo id", ("probe", "--model", "a/b/c/d", "--ip-adapter", "x", *REAL), 2, "neither"),
    Case(
        "hub --ip-adapter without --weight-name",
        ("probe", "--model", "{root}/model", "--ip-adapter", "h9/IP", *REAL),
        2,
        "--weight-name",
    ),
    Case(
        "offline hub id",
        ("probe", "--model", "nobody/nothing", "--ip-adapter", "x", *REAL),
        2,
        "HF_HUB_OFFLINE",
        OFFLINE,
    ),
    Case(
        "unreachable hub id",
        ("probe", "--model", "nobody/nothing", "--ip-adapter", "x", *REAL),
        2,
        "cannot be reached",
        UNREACHABLE,
    ),
]


def make_fixtures(root: Path) -> Path:
    """Write the files the cases name under ``root``; returns ``root``."""
    import numpy as np
    from PIL import Image
    from safetensors.numpy import save_file

    root.mkdir(parents=True, exist_ok=True)
    (root / "refs").mkdir(exist_ok=True)
    Image.new("RGB", (32, 32), (200, 30, 30)).save(root / "ref.png")
    Image.new("RGB", (32, 32), (30, 30, 200)).save(root / "refs" / "0.png")
    (root / "a_file").write_text("not an image, not a folder\n")
    (root / "empty.jsonl").write_text("\n\n")
    (root / "header.csv").write_text("prompt,images\n")
    (root / "latin1.jsonl").write_bytes('{"prompt": "caf\xe9"}\n'.encode("latin-1"))
    (root / "array.jsonl").write_text('[{"prompt": "a"}]\n')
    (root / "unknown.csv").write_text("prompt,colour\na,red\n")
    (root / "missing_images.jsonl").write_text('{"images": "gone.png"}\n{"images": "also_gone.png"}\n')
    (root / "ok.jsonl").write_text('{"prompt": "a", "images": "ref.png", "seed": 1}\n')
    (root / "model").mkdir(exist_ok=True)
    (root / "model" / "model_index.json").write_text('{"_class_name": "StableDiffusionPipeline"}\n')
    weights = root / "weights"
    weights.mkdir(exist_ok=True)
    adapter = {"image_proj.proj.weight": np.zeros((8, 4), np.float32), "ip_adapter.1.to_k_ip.weight": np.ones(4)}
    save_file(adapter, str(weights / "ok.safetensors"))
    data = (weights / "ok.safetensors").read_bytes()
    (weights / "truncated.safetensors").write_bytes(data[: len(data) - 16])
    (weights / "random.safetensors").write_bytes(np.random.default_rng(0).bytes(4096))
    save_file({"text_model.weight": np.zeros(3, np.float32)}, str(weights / "other.safetensors"))
    (root / "a_run").mkdir(exist_ok=True)
    (root / "a_run" / "ipa_probe_manifest.json").write_text("{}\n")  # its presence marks a run folder
    (root / "locked").mkdir(exist_ok=True)
    (root / "locked" / ".ipa_probe.lock").mkdir(exist_ok=True)
    record = {"tier": {"name": "smoke", "d_model": 32}, "experiment": "collapse"}
    (root / "smoke_results" / "collapse").mkdir(parents=True, exist_ok=True)
    (root / "smoke_results" / "collapse" / "record.json").write_text(json.dumps(record))
    # issue 31: a lock that is a link to the user's notes, special files where images and locks belong
    (root / "notes").write_text("the user's notes: a lock must never truncate them\n")
    (root / "linked").mkdir(exist_ok=True)
    _replace(root / "linked" / ".ipa_probe.lock", lambda p: p.symlink_to(root / "notes"))
    (root / "fifo_lock").mkdir(exist_ok=True)
    for fifo in (root / "fifo_lock" / ".ipa_probe.lock", root / "fifo.png", root / "fifo.jsonl"):
        _replace(fifo, os.mkfifo)
    _replace(root / "fifo.safetensors", os.mkfifo)
    (root / "fifo_image.jsonl").write_text('{"images": "fifo.png"}\n')
    _manifest_fixtures(root)
    return root


def _manifest_fixtures(root: Path) -> None:
    """Output folders whose run manifest is not one to trust (issue 39), one hand-edited run, an OUT/logs file."""
    import hashlib

    (root / "many.jsonl").write_text("".join(f'{{"images": "ref.png", "seed": {i}}}\n' for i in range(5000)))
    good = {"run_id": "r1", "command": "ipa-probe probe", "status": "finished", "started_ns": 1, "files": {}}
    bodies = {
        "m_abc": json.dumps({**good, "started_ns": "abc"}),
        "m_list": "[1]",
        "m_foreign": json.dumps({**good, "foreign": 5}),
        "m_deep": "[" * 50000 + "]" * 50000,
        "m_nul": json.dumps({**good, "files": {"a\u0000b": {"size": 0, "sha256": "0" * 64}}}),
    }
    for name, body in bodies.items():
        (root / name).mkdir(exist_ok=True)
        (root / name / "ipa_probe_manifest.json").write_text(body)
    (root / "m_fifo").mkdir(exist_ok=True)
    _replace(root / "m_fifo" / "ipa_probe_manifest.json", os.mkfifo)
    (root / "m_zero").mkdir(exist_ok=True)
    _replace(root / "m_zero" / "ipa_probe_manifest.json", lambda p: p.symlink_to("/dev/zero"))
    edited = root / "m_edited"
    edited.mkdir(exist_ok=True)
    listed = {"size": 2, "sha256": hashlib.sha256(b"{}").hexdigest()}
    (edited / "ipa_probe_manifest.json").write_text(json.dumps({**good, "files": {"summary.json": listed}}))
    (edited / "summary.json").write_text('{"edited": "by hand"}')
    (root / "logs_file").mkdir(exist_ok=True)
    (root / "logs_file" / "logs").write_text("a file where the tracker's folder belongs\n")


def _replace(path: Path, make) -> None:
    """Make ``path`` anew with ``make(path)`` (a link or a FIFO: ``exist_ok`` has no meaning for them)."""
    if os.path.lexists(path):
        path.unlink()
    make(path)


def fixture_bytes(root: Path) -> dict[str, bytes | str]:
    """Every regular file under ``root`` (by relative path) with its bytes, and every link with its target: what a
    refused command must leave byte-identical. FIFOs are listed by kind, never opened."""
    import stat

    found: dict[str, bytes | str] = {}
    for path in sorted(root.rglob("*")):
        mode = path.lstat().st_mode
        name = str(path.relative_to(root))
        if stat.S_ISLNK(mode):
            found[name] = f"link -> {os.readlink(path)}"
        elif stat.S_ISREG(mode):
            found[name] = path.read_bytes()
        elif stat.S_ISFIFO(mode):
            found[name] = "fifo"
    return found


#: runs ``ipa_probe.cli.main`` for each case given on stdin and prints one JSON line per case
DRIVER = r"""
import contextlib, io, json, sys, time
from ipa_probe.cli import main
for argv in json.loads(sys.stdin.read()):
    err = io.StringIO()
    start = time.perf_counter()
    with contextlib.redirect_stderr(err):
        code = main(argv)
    heavy = [m for m in HEAVY if m in sys.modules]
    print(json.dumps({"code": code, "stderr": err.getvalue(), "heavy": heavy, "seconds": time.perf_counter() - start}))
"""


def argv_of(case: Case, root: Path) -> list[str]:
    """The case's command line with ``{root}`` filled in and an ``--out`` under ``root`` unless it names one."""
    argv = [a.replace("{root}", str(root)) for a in case.argv]
    if "--out" not in argv:
        argv += ["--out", str(root / "out" / case.name.replace(" ", "_"))]
    return argv


def run_in_fresh_process(cases: list[Case], root: Path, cwd: Path) -> dict[str, dict]:
    """Run the cases with ``ipa_probe.cli.main`` in fresh Python processes (one per environment), from ``cwd``.

    Returns:
        case name -> ``{"code", "stderr", "heavy" (heavy modules imported by then), "seconds"}``.
    """
    results: dict[str, dict] = {}
    groups: dict[tuple, list[Case]] = {}
    for case in cases:
        groups.setdefault(case.env, []).append(case)
    for env, group in groups.items():
        environ = {**os.environ, **{k: v.replace("{root}", str(root)) for k, v in env}, "PYTHONPATH": str(cwd)}
        environ.pop("OMP_NUM_THREADS", None)
        proc = subprocess.run(
            [sys.executable, "-c", f"HEAVY = {HEAVY!r}\n{DRIVER}"],
            input=json.dumps([argv_of(case, root) for case in group]),
            capture_output=True,
            text=True,
            cwd=cwd,
            env=environ,
            timeout=300,
        )
        if proc.returncode != 0:
            raise RuntimeError(f"the driver failed: {proc.stderr[-3000:]}")
        for case, line in zip(group, proc.stdout.splitlines(), strict=True):
            results[case.name] = json.loads(line)
            results[case.name]["message"] = case.message.replace("{root}", str(root))
    return results
