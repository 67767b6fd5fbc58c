"""Refusals before torch: every bad command line of ``tests/cli_cases.py`` answers with one line and its exit code
while torch, diffusers and pandas are still unloaded (that is what makes it answer at once; the times themselves are
``benchmarks/cli_latency.py``'s to print). Also: the OpenMP wait policy and thread count the commands set, and hub ids
found in the cache."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from cli_cases import CASES, HEAVY, fixture_bytes, make_fixtures, run_in_fresh_process

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def fixtures(tmp_path_factory) -> tuple[Path, dict]:
    root = make_fixtures(tmp_path_factory.mktemp("cases"))
    return root, fixture_bytes(root)


@pytest.fixture(scope="module")
def answers(fixtures) -> tuple[Path, dict[str, dict]]:
    root, _ = fixtures
    return root, run_in_fresh_process(CASES, root, ROOT)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_a_bad_command_line_is_one_line_before_torch_loads(answers, case):
    root, results = answers
    result = results[case.name]
    lines = result["stderr"].strip().splitlines()
    assert result["code"] == case.code, result["stderr"]
    assert len(lines) == 1 and result["message"] in lines[0], lines  # one line, no traceback, no warning before it
    assert lines[0].startswith(f"ipa-probe {case.argv[0]}: error: ")
    assert result["heavy"] == [], f"{case.name} imported {result['heavy']} before answering"
    assert not (root / "out" / case.name.replace(" ", "_")).exists()  # nothing written
    # Not a speed test (speed is measured in benchmarks/): "before torch loads" is held by `heavy` above; the bound
    # only catches a hang or a client's retry loop (minutes), with room for a loaded machine (3 s was over at load 6).
    assert result["seconds"] < 30, f"{case.name} took {result['seconds']:.1f} s to answer"


def test_the_refusals_leave_every_file_byte_identical(fixtures, answers):
    """The lock linked to the user's notes, the FIFOs where images and locks belong: nothing truncated, opened or
    replaced; nothing new beside them but the commands' own empty output folders."""
    root, before = fixtures
    answers  # noqa: B018 - every case has run
    after = fixture_bytes(root)
    assert {name: after.get(name) for name in before} == before
    assert after["notes"] == b"the user's notes: a lock must never truncate them\n"


def test_the_hub_messages_name_every_remedy(answers):
    _, results = answers
    for name in ("offline hub id", "unreachable hub id"):
        line = results[name]["stderr"]
        assert "hf download nobody/nothing" in line and "huggingface-cli download" in line
        assert "local folder" in line and "HF_HUB_OFFLINE" in line


def test_help_of_every_command_imports_nothing_heavy():
    code = (
        "import sys, contextlib, io\nfrom ipa_probe.cli import SUBCOMMANDS, main\n"
        "for command in [None, *SUBCOMMANDS]:\n"
        "    with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):\n"
        "        main(['--help'] if command is None else [command, '--help'])\n"
        f"print([m for m in {HEAVY!r} if m in sys.modules])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.stdout.strip() == "[]", out.stderr


def test_every_command_has_threads_and_documents_the_wait_policy():
    from ipa_probe.cli import SUBCOMMANDS, build_parser

    parser = build_parser()
    assert "OMP_WAIT_POLICY=PASSIVE" in parser.format_help()
    sub = next(a for a in parser._actions if a.dest == "command")
    for command in SUBCOMMANDS:
        assert "--threads" in sub.choices[command].format_help(), command


def test_a_cached_hub_id_passes_the_check_offline(tmp_path):
    """The hub's cache layout: models--ORG--NAME/refs/main holds the commit, snapshots/COMMIT/ the files."""
    repo = tmp_path / "hub" / "models--org--cached"
    commit = "0" * 40
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    (repo / "snapshots" / commit / "models").mkdir(parents=True)
    (repo / "snapshots" / commit / "model_index.json").write_text("{}")
    (repo / "snapshots" / commit / "models" / "w.safetensors").write_bytes(b"")
    code = (
        "from ipa_probe.cli._sources import check_hub_file, ip_adapter_source\n"
        "check_hub_file('org/cached', 'model_index.json', '--model')\n"
        "print(ip_adapter_source('org/cached', 'models', 'w.safetensors'))\n"
        "try:\n    check_hub_file('org/cached', 'other.json', '--model')\nexcept Exception as err:\n    print(err)"
    )
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT, timeout=60)
    lines = out.stdout.strip().splitlines()
    source = "WeightSource(location='org/cached', subfolder='models', weight_name='w.safetensors')"
    assert lines[0] == source, out.stderr
    assert "other.json is not in the Hugging Face cache and HF_HUB_OFFLINE is set" in lines[1]


# ------------------------------------------------------------------------------------------------ threads

THREADS = """
import json, os, sys
import ipa_probe.cli.experiments as command
from ipa_probe.cli import main
seen, run = {}, command.run

def spy(args):  # the environment the command runs in, before torch loads
    seen.update(policy=os.environ.get("OMP_WAIT_POLICY"), omp=os.environ.get("OMP_NUM_THREADS"))
    return run(args)

command.run = spy
code = main(["experiments", "collapse", "--tier", "paper", "--out", sys.argv[1], *sys.argv[2:]])
import torch
print(json.dumps({"code": code, **seen, "torch": torch.get_num_threads()}))
"""


def _run_experiments_script(script: str, tmp_path: Path, environ: dict, flags: list) -> tuple:
    """Run ``script`` in a fresh interpreter with ``environ`` instead of the caller's OpenMP variables; its process
    and the JSON object of its last line."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "OMP_NUM_THREADS")}
    env.update(environ, PYTHONPATH=str(ROOT))
    out = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "out"), *flags],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=300,
    )
    return out, json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="the paper tier would start training on a GPU")
@pytest.mark.parametrize(
    "environ, flags, expected",
    [
        ({}, [], ("PASSIVE", None)),  # defaults: passive, and the CPUs this process may use
        ({}, ["--threads", "1"], ("PASSIVE", "1")),
        ({"OMP_WAIT_POLICY": "ACTIVE", "OMP_NUM_THREADS": "1"}, [], ("ACTIVE", "1")),  # the user's settings win
        ({"OMP_NUM_THREADS": "2"}, ["--threads", "1"], ("PASSIVE", "1")),  # the flag wins over the variable
    ],
)
def test_commands_set_the_wait_policy_and_threads_before_torch_loads(tmp_path, environ, flags, expected):
    """The paper tier stops after torch loaded (no GPU here): by then torch read the thread count from the
    environment the command set up."""
    from ipa_probe.cli._runtime import default_threads

    out, result = _run_experiments_script(THREADS, tmp_path, environ, flags)
    policy, threads = expected
    threads = threads or str(default_threads())
    assert result["code"] == 2 and "needs a CUDA GPU" in out.stderr
    assert (result["policy"], result["omp"], result["torch"]) == (policy, threads, int(threads))


CPU_TIER = """
import json, os, sys
import ipa_probe.cli.experiments as command
from ipa_probe.cli import main
seen = {}

def spy(args):  # records the environment the run would start in, and runs nothing
    import torch
    seen.update(omp=os.environ.get("OMP_NUM_THREADS"), torch=torch.get_num_threads())
    return 0

command.run = spy
code = main(["experiments", "collapse", "--tier", "quick", "--out", sys.argv[1], *sys.argv[2:]])
print(json.dumps({"code": code, **seen}))
"""


@pytest.mark.parametrize(
    "environ, flags, expected",
    [
        ({}, [], "1"),  # the CPU tiers' tiny models: one thread unless asked otherwise
        ({}, ["--threads", "2"], "2"),
        ({"OMP_NUM_THREADS": "2"}, [], "2"),  # the user's variable wins over the tier's default
    ],
)
def test_cpu_tiers_default_to_one_thread(tmp_path, environ, flags, expected):
    out, result = _run_experiments_script(CPU_TIER, tmp_path, environ, flags)
    assert result["code"] == 0, out.stderr
    assert (result["omp"], result["torch"]) == (expected, int(expected))


def test_configure_threads_keeps_what_the_user_set():
    from ipa_probe.cli._runtime import configure_threads, default_threads

    env: dict[str, str] = {}
    assert configure_threads(None, env) == default_threads()
    assert env == {"OMP_WAIT_POLICY": "PASSIVE", "OMP_NUM_THREADS": str(default_threads())}
    env = {"OMP_WAIT_POLICY": "active", "OMP_NUM_THREADS": "3"}
    assert configure_threads(None, env) == 3 and env == {"OMP_WAIT_POLICY": "active", "OMP_NUM_THREADS": "3"}
    assert configure_threads(5, env) == 5 and env["OMP_NUM_THREADS"] == "5"
    env = {"OMP_NUM_THREADS": "garbage"}
    assert configure_threads(None, env) == default_threads() and env["OMP_NUM_THREADS"] == str(default_threads())


def test_the_default_thread_count_respects_a_container_quota(tmp_path):
    from ipa_probe.cli._runtime import _cgroup_cpus

    assert _cgroup_cpus(str(tmp_path)) is None  # no cgroup files: no quota
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert _cgroup_cpus(str(tmp_path)) is None
    (tmp_path / "cpu.max").write_text("150000 100000\n")  # one and a half CPUs: two threads
    assert _cgroup_cpus(str(tmp_path)) == 2
    (tmp_path / "cpu.max").unlink()
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("300000\n")
    (tmp_path / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert _cgroup_cpus(str(tmp_path)) == 3


def test_thread_scope_restores_the_callers_threads_and_environment(monkeypatch):
    import torch

    from ipa_probe.cli._runtime import thread_scope

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    before = torch.get_num_threads()
    wanted = 2 if before != 2 else 1
    with thread_scope(wanted):
        assert torch.get_num_threads() == wanted and os.environ["OMP_NUM_THREADS"] == str(wanted)
        assert os.environ["OMP_WAIT_POLICY"] == "ACTIVE"  # the user's policy is kept
    assert torch.get_num_threads() == before and "OMP_NUM_THREADS" not in os.environ
    assert os.environ["OMP_WAIT_POLICY"] == "ACTIVE"


def test_a_name_the_c_locale_cannot_decode_is_refused_before_the_run(tmp_path):
    """``LC_ALL=C PYTHONUTF8=0 ipa-probe probe --out ûñï``: the bytes reach Python undecodable (surrogate escapes),
    which would fail only when summary.json or the last line is written, after the run."""
    env = {**os.environ, "LC_ALL": "C", "PYTHONUTF8": "0", "PYTHONPATH": str(ROOT)}
    env.pop("LANG", None)
    out = os.fsencode(tmp_path) + b"/\xc3\xbb\xc3\xb1\xc3\xaf"  # ûñï in UTF-8
    proc = subprocess.run(
        [sys.executable, "-m", "ipa_probe", "probe", "--out", out], capture_output=True, env=env, timeout=60, cwd=ROOT
    )
    lines = proc.stderr.decode("ascii", "backslashreplace").strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, lines
    assert "holds bytes that are not text in this locale's encoding" in lines[0] and "LC_ALL=C.UTF-8" in lines[0]
    assert list(tmp_path.iterdir()) == []


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (Linux)")
def test_help_to_a_full_device_is_exit_1_with_one_line():
    """Issue 39: argparse swallowed the write error, so `--help > /dev/full` ended silently with exit code 0."""
    for argv in (["--help"], ["probe", "--help"]):
        with open("/dev/full", "w") as full:
            proc = subprocess.run(
                [sys.executable, "-m", "ipa_probe", *argv], stdout=full, stderr=subprocess.PIPE, text=True, cwd=ROOT
            )
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 1 and len(lines) == 1, proc.stderr
        assert "'<standard output>': No space left on device" in lines[0]


def test_the_cache_outside_out_is_documented_where_it_is(tmp_path, monkeypatch):
    """Issue 39: the tiny pipelines write a tokenizer cache the docs did not mention."""
    from ipa_probe.tiny.tokenizer import cache_root, clip_tokenizer_dir

    text = (ROOT / "docs" / "failures.md").read_text()
    for where in ("$IPA_PROBE_CACHE", "$XDG_CACHE_HOME/ipa_probe", "~/.cache/ipa_probe", "clip-tokenizer-"):
        assert where in text, where
    monkeypatch.delenv("IPA_PROBE_CACHE", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert cache_root() == Path.home() / ".cache" / "ipa_probe"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root() == tmp_path / "xdg" / "ipa_probe"
    monkeypatch.setenv("IPA_PROBE_CACHE", str(tmp_path / "mine"))
    assert clip_tokenizer_dir().parent == tmp_path / "mine" and clip_tokenizer_dir().name.startswith("clip-tokenizer-")
