"""diffusers' own IP-Adapter tests under the probe: every pipeline call run plain, then probed, same random state.

    python benchmarks/diffusers_suite.py PATH/TO/DIFFUSERS [--standins] [--out suite.json] [-k ip_adapter]

``PATH/TO/DIFFUSERS`` is a source checkout of the installed diffusers version (its ``tests/`` folder; diffusers'
``tests/conftest.py`` puts the checkout's ``src`` first on ``sys.path``, so its source must be the installed one, or
absent). The script runs the IP-Adapter tests (``-k ip_adapter`` over the files of ``tests/pipelines`` that mention
IP-Adapters) twice, in separate pytest processes:

1. plain: diffusers' tests as they are;
2. probed: this file is loaded as a pytest plugin that wraps ``__call__`` of every diffusers pipeline class taking
   ``ip_adapter_image``. When the pipeline has an IP-Adapter loaded, a call runs plain (the random state of torch,
   numpy, ``random`` and every generator passed in saved first), then again from the same state inside
   ``ipa_probe.probe``; the test gets the probed output. Each such call is recorded: bit-identical or not, the branch
   labels, the table's rows, and how often the image branch's key projections ran (the plugin's own hooks).

It prints: tests, statuses with and without the probe (and every test whose status changed), calls, bit-identical
calls, calls whose image branch ran without rows, and the labels seen per pipeline class. ``--out`` writes the same as
JSON. CI does not run this (diffusers' tests download tiny tokenizers from the Hub); ``--standins`` serves offline
stand-ins for the two the IP-Adapter tests load (``hf-internal-testing/tiny-random-clip``: a CLIP BPE tokenizer cut
to 1,000 tokens; ``hf-internal-testing/tiny-random-t5``: ipa_probe's tiny T5 tokenizer and a T5 config of width 32),
in both runs alike: tests that compare outputs with numbers recorded on the real tokenizers fail in both runs then.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

_RECORD = "IPA_SUITE_RECORD"  # probed run: the JSON Lines file each wrapped call appends to
_STANDINS = "IPA_SUITE_STANDINS"  # both runs: serve offline stand-ins for the Hub's tiny tokenizers
_PATTERN = re.compile(r"ip_adapter|IPAdapterTesterMixin")


# --------------------------------------------------------------------------- the pytest plugin (probed run)


class _State:
    """The plugin's state in the pytest process: the running test and whether a wrapped call is running."""

    test = ""
    depth = 0


def _snapshot(kwargs: dict) -> tuple:
    import numpy as np
    import torch

    generators = kwargs.get("generator")
    generators = generators if isinstance(generators, list) else [generators]
    states = [g.get_state() for g in generators if isinstance(g, torch.Generator)]
    return torch.get_rng_state(), np.random.get_state(), random.getstate(), states


def _restore(snapshot: tuple, kwargs: dict) -> None:
    import numpy as np
    import torch

    torch_state, numpy_state, python_state, states = snapshot
    torch.set_rng_state(torch_state)
    np.random.set_state(numpy_state)
    random.setstate(python_state)
    generators = kwargs.get("generator")
    generators = generators if isinstance(generators, list) else [generators]
    for generator, state in zip([g for g in generators if isinstance(g, torch.Generator)], states, strict=True):
        generator.set_state(state)


def _containers(value: Any) -> Any:
    """A copy of the lists, tuples and dicts in ``value`` (tensors, images and generators shared): pipelines write
    into argument lists (``ip_adapter_image_embeds``), so each run gets its own."""
    if isinstance(value, dict):
        return {key: _containers(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_containers(item) for item in value)
    return value


def _projections(pipe) -> tuple[list, list[int]]:
    """Forward hooks of our own counting the image branch's key projections."""
    import torch

    from ipa_probe.layers import find_ip_layers

    count = [0]
    handles = []
    for layer in find_ip_layers(pipe):
        to_k_ip = layer.processor.to_k_ip
        for module in to_k_ip if isinstance(to_k_ip, torch.nn.ModuleList) else [to_k_ip]:
            handles.append(module.register_forward_hook(lambda *args: count.__setitem__(0, count[0] + 1)))
    return handles, count


def _wrap(original):
    def call(self, *args, **kwargs):
        from ipa_probe.capture.run import probe
        from ipa_probe.devtools.compat import _same
        from ipa_probe.layers import find_ip_layers

        try:
            find_ip_layers(self)
            loaded = True
        except (TypeError, ValueError):
            loaded = False
        if _State.depth or not loaded:
            return original(self, *args, **kwargs)
        _State.depth += 1
        try:
            snapshot = _snapshot(kwargs)
            plain = original(self, *_containers(args), **_containers(kwargs))
            _restore(snapshot, kwargs)
            record: dict[str, Any] = {"test": _State.test, "class": type(self).__name__}
            handles, count = _projections(self)
            try:
                with probe(self) as run:
                    probed = original(self, *args, **kwargs)
            except Exception as err:
                _append({**record, "probe_error": f"{type(err).__name__}: {err}"[:300]}, count[0], None)
                raise
            finally:
                for handle in handles:
                    handle.remove()
            _append({**record, "identical": _same(plain, probed)}, count[0], run.to_dataframe())
            return probed
        finally:
            _State.depth -= 1

    call.__wrapped__ = original
    return call


def _append(record: dict, projections: int, table) -> None:
    """Append one call's record (``table``: the probe's, or ``None`` when the probed call raised)."""
    record["projections"] = projections
    if table is not None:
        record.update(
            rows=len(table),
            labels=sorted(set(table["branch"])),
            calls=int(table["call"].nunique()) if len(table) else 0,
            steps=int(table["step"].nunique()) if len(table) else 0,
        )
    with open(os.environ[_RECORD], "a") as stream:
        stream.write(json.dumps(record) + "\n")


def pytest_configure(config) -> None:
    if os.environ.get(_STANDINS):
        _install_standins()
    if os.environ.get(_RECORD):
        from ipa_probe.tiny.zoo import ip_adapter_pipeline_classes

        for cls in ip_adapter_pipeline_classes().values():
            if "__call__" in vars(cls):
                cls.__call__ = _wrap(vars(cls)["__call__"])


def pytest_runtest_setup(item) -> None:
    _State.test = item.nodeid


# --------------------------------------------------------------------------- offline stand-ins (both runs)


def _standin_clip(folder: Path, size: int = 1000):
    """A CLIP BPE tokenizer cut to ``size`` tokens (bytes, bytes at word ends, the first merges, then bos and eos)."""
    from transformers import CLIPTokenizer

    from ipa_probe.tiny.tokenizer import clip_vocab_and_merges

    vocab, merges = clip_vocab_and_merges()
    kept = size - 2 - 512
    tokens = [t for t, i in sorted(vocab.items(), key=lambda item: item[1]) if i < 512 + kept]
    tokens += ["<|startoftext|>", "<|endoftext|>"]
    (folder / "vocab.json").write_text(json.dumps({t: i for i, t in enumerate(tokens)}))
    (folder / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges[:kept]) + "\n")
    return CLIPTokenizer(str(folder / "vocab.json"), str(folder / "merges.txt"), model_max_length=77)


def _install_standins() -> None:
    import transformers

    from ipa_probe.tiny.dit import tiny_t5_tokenizer

    folder = Path(tempfile.mkdtemp(prefix="ipa_suite_tokenizer_"))
    clip = _standin_clip(folder)
    t5_config = transformers.T5Config(
        vocab_size=1103,
        d_model=32,
        d_ff=37,
        d_kv=8,
        num_heads=4,
        num_layers=5,
        relative_attention_num_buckets=8,
        decoder_start_token_id=0,
        eos_token_id=1,
        pad_token_id=0,
    )
    served = {
        ("tokenizer", "hf-internal-testing/tiny-random-clip"): lambda: copy.deepcopy(clip),
        ("tokenizer", "hf-internal-testing/tiny-random-t5"): lambda: tiny_t5_tokenizer(model_max_length=77),
        ("config", "hf-internal-testing/tiny-random-t5"): lambda: copy.deepcopy(t5_config),
    }

    def patch(cls, kind: str) -> None:
        original = cls.from_pretrained.__func__

        def from_pretrained(klass, name, *args, **kwargs):
            made = served.get((kind, str(name)))
            return made() if made is not None else original(klass, name, *args, **kwargs)

        cls.from_pretrained = classmethod(from_pretrained)

    for cls in (transformers.CLIPTokenizer, transformers.CLIPTokenizerFast, transformers.AutoTokenizer):
        patch(cls, "tokenizer")
    for cls in (transformers.AutoConfig, transformers.T5Config):
        patch(cls, "config")


# --------------------------------------------------------------------------- the driver


def _checkout_version(checkout: Path) -> str:
    for path, pattern in (
        (checkout / "src" / "diffusers" / "__init__.py", r'__version__ = "([^"]+)"'),
        (checkout / "setup.py", r'version="([^"]+)"'),
    ):
        if path.exists():
            match = re.search(pattern, path.read_text())
            if match:
                return match.group(1)
    return "unknown"


def _statuses(junit: Path) -> dict[str, str]:
    statuses = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        kinds = [child.tag for child in case]
        status = "passed"
        for tag in ("error", "failure", "skipped"):
            if tag in kinds:
                status = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                break
        statuses[name] = status
    return statuses


def _run(checkout: Path, files: list[str], keyword: str, junit: Path, env: dict[str, str], timeout: int) -> None:
    command = [sys.executable, "-m", "pytest", *files, "-k", keyword, "-q", "-p", "no:cacheprovider", "-p"]
    command += ["diffusers_suite", f"--junitxml={junit}", "-o", "junit_family=xunit1"]
    subprocess.run(command, cwd=checkout, env=env, timeout=timeout, check=False, stdout=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("checkout", type=Path, help="a diffusers source checkout (its tests/ folder)")
    parser.add_argument("-k", dest="keyword", default="ip_adapter", help="pytest -k expression (default ip_adapter)")
    parser.add_argument("--standins", action="store_true", help="offline stand-ins for the Hub's tiny tokenizers")
    parser.add_argument("--out", type=Path, help="also write the results as JSON here")
    parser.add_argument("--timeout", type=int, default=6 * 3600, help="seconds per pytest run")
    args = parser.parse_args(argv)
    import diffusers

    checkout = args.checkout.resolve()
    tests = checkout / "tests" / "pipelines"
    if not tests.is_dir():
        parser.error(f"expected a diffusers source checkout with tests/pipelines, got {checkout}")
    files = sorted(str(p.relative_to(checkout)) for p in tests.rglob("test_*.py") if _PATTERN.search(p.read_text()))
    here = Path(__file__).resolve().parent
    paths = [str(here), str(here.parent), os.environ.get("PYTHONPATH", "")]  # this plugin, then this ipa_probe
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path for path in paths if path)}
    if args.standins:
        env.update({_STANDINS: "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
    with tempfile.TemporaryDirectory(prefix="ipa_suite_") as work:
        work = Path(work)
        _run(checkout, files, args.keyword, work / "plain.xml", env, args.timeout)
        record = work / "calls.jsonl"
        record.touch()
        _run(checkout, files, args.keyword, work / "probed.xml", {**env, _RECORD: str(record)}, args.timeout)
        plain, probed = _statuses(work / "plain.xml"), _statuses(work / "probed.xml")
        calls = [json.loads(line) for line in record.read_text().splitlines() if line.strip()]
    result = summarize(plain, probed, calls, files)
    result.update(checkout=str(checkout), checkout_version=_checkout_version(checkout))
    result["installed_version"] = diffusers.__version__
    print(report(result))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    return 0 if not result["changed"] and result["identical"] == result["calls"] else 1


def summarize(plain: dict[str, str], probed: dict[str, str], calls: list[dict], files: list[str]) -> dict:
    """The numbers the script prints, from the two runs' statuses and the probed run's call records."""
    labels: dict[str, set] = defaultdict(set)
    for call in calls:
        labels[call["class"]].update(call.get("labels", []))
    return {
        "files": len(files),
        "tests": len(plain),
        "plain": dict(Counter(plain.values())),
        "probed": dict(Counter(probed.values())),
        "changed": {
            name: [plain.get(name), probed.get(name)]
            for name in plain.keys() | probed.keys()
            if plain.get(name) != probed.get(name)
        },
        "calls": len(calls),
        "classes": len(labels),
        "identical": sum(bool(call.get("identical")) for call in calls),
        "without_rows": sum(call.get("projections", 0) > 0 and call.get("rows", 0) == 0 for call in calls),
        "probe_errors": [call for call in calls if "probe_error" in call],
        "labels": {name: sorted(seen) for name, seen in sorted(labels.items())},
        "calls_per_class": dict(sorted(Counter(call["class"] for call in calls).items())),
    }


def report(result: dict) -> str:
    lines = [
        f"diffusers {result['installed_version']} installed; tests from {result['checkout']} "
        f"(version {result['checkout_version']})",
        f"tests: {result['tests']} in {result['files']} files",
        f"statuses without the probe: {result['plain']}",
        f"statuses with the probe:    {result['probed']}",
        f"tests whose status changed: {len(result['changed'])}",
        *[f"  {name}: {a} -> {b}" for name, (a, b) in sorted(result["changed"].items())],
        f"pipeline calls with an IP-Adapter loaded: {result['calls']} over {result['classes']} classes",
        f"bit-identical calls: {result['identical']}",
        f"calls whose image branch ran without rows: {result['without_rows']}",
        f"calls where the probe raised: {len(result['probe_errors'])}",
        "labels seen per class:",
        *[
            f"  {name} ({result['calls_per_class'][name]} calls): {', '.join(labels) or '-'}"
            for name, labels in result["labels"].items()
        ],
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
