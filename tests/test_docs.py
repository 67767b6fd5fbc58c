"""Every ```python block of README.md and docs/*.md runs as written: offline, in a temporary working folder.

The blocks of one page run in order in one fresh process, as a reader pasting them one after the other would run
them: forked from an interpreter that has imported only torch, diffusers and other third-party libraries
(tests/forked.py), so that each page does not pay their import again; what a page imports, it imports itself.
The line before a block may carry a mark:

- ``<!-- snippet: slow -->``: the block takes more than about 20 s; its page's test is marked slow (still part of
  ``make test``).
- ``<!-- snippet: skip (REASON) -->``: the block is not run (it is still compiled). Only for code that needs weights
  from a hub or a GPU, and the reason must say which; :data:`SKIPPED` counts them per page, so a new skip is a
  visible change to this file.
"""

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

#: page (relative to the repository) -> how many of its blocks are marked skip; every other page has none.
SKIPPED = {"README.md": 1}

_BLOCK = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.S | re.M)
_MARK = re.compile(r"<!--\s*snippet:\s*(?P<kind>\w+)(?P<reason>.*?)-->")
_SKIP_REASON = re.compile(r"\b(hub|GPU|CUDA)\b", re.I)


@dataclass(frozen=True)
class Snippet:
    page: str  # path relative to the repository root
    line: int  # 1-based line of the code's first line
    code: str
    mark: str | None  # "slow", "skip" or None
    reason: str


def snippets(page: Path) -> list[Snippet]:
    """The ```python blocks of one markdown page, in order, with the mark on the line before each."""
    text = page.read_text(encoding="utf-8")
    found = []
    for match in _BLOCK.finditer(text):
        before = text[: match.start()].rstrip("\n").rsplit("\n", 1)[-1].strip()
        mark = _MARK.fullmatch(before)
        found.append(
            Snippet(
                page=str(page.relative_to(ROOT)),
                line=text.count("\n", 0, match.start(1)) + 1,
                code=match.group(1),
                mark=mark.group("kind") if mark else None,
                reason=mark.group("reason").strip(" ():") if mark else "",
            )
        )
    return found


def _page_param(page: Path):
    marks = [pytest.mark.slow] if any(s.mark == "slow" for s in snippets(page)) else []
    return pytest.param(page, marks=marks, id=str(page.relative_to(ROOT)))


RUNNABLE = [_page_param(p) for p in PAGES if any(s.mark != "skip" for s in snippets(p))]

# Runs the blocks given as JSON on stdin in one namespace; a traceback names the page and line of the failing block.
_DRIVER = """
import json, os, sys
import torch
torch.set_num_threads(int(os.environ.get("IPA_PROBE_TEST_THREADS", "1")))
namespace = {"__name__": "__main__"}
for block in json.load(sys.stdin):
    exec(compile(block["code"], block["where"], "exec"), namespace)
"""


def test_pages_have_python_blocks():
    # the extraction itself: if the pattern stopped matching, every page test below would pass vacuously
    assert any(snippets(ROOT / "README.md")), "no ```python block found in README.md"
    assert RUNNABLE, "no runnable ```python block found in README.md or docs/"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_marks_are_known_and_skips_give_a_reason(page):
    text = page.read_text(encoding="utf-8")
    marks = [_MARK.fullmatch(line.strip()).groups() for line in text.splitlines() if _MARK.fullmatch(line.strip())]
    unknown = [kind for kind, _ in marks if kind not in ("slow", "skip")]
    assert not unknown, f"{page.name}: unknown snippet mark(s) {unknown}; use 'slow' or 'skip (REASON)'"
    found = snippets(page)
    assert len(marks) == sum(s.mark is not None for s in found), (
        f"{page.name}: a '<!-- snippet: ... -->' mark must sit on the line right before a ```python block"
    )
    skipped = [s for s in found if s.mark == "skip"]
    for s in skipped:
        assert _SKIP_REASON.search(s.reason), (
            f"{s.page}:{s.line}: a skipped snippet must say why, and only hub or GPU code may be skipped "
            f"(got reason {s.reason!r}); write '<!-- snippet: skip (downloads ... from the hub) -->'"
        )
    expected = SKIPPED.get(str(page.relative_to(ROOT)), 0)
    assert len(skipped) == expected, (
        f"{page.name}: {len(skipped)} skipped snippet(s), expected {expected}; make the block run offline "
        "(ipa_probe.digits_pipeline() or a tiny pipeline) or, for hub/GPU code only, update SKIPPED in this test"
    )


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_block_compiles(page):
    for s in snippets(page):
        compile(s.code, f"{s.page}:{s.line}", "exec")


@pytest.mark.parametrize("page", RUNNABLE)
def test_page_snippets_run(page, tmp_path, zygote):
    blocks = [{"code": "\n" * (s.line - 1) + s.code, "where": s.page} for s in snippets(page) if s.mark != "skip"]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "MPLBACKEND": "Agg",
    }
    done = zygote.start(_DRIVER, cwd=tmp_path, env=env, stdin=json.dumps(blocks))
    _, stderr = done.communicate(timeout=900)
    assert done.returncode == 0, f"a ```python block of {page.name} failed:\n{stderr[-6000:]}"
