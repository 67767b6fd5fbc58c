"""docs/layout.md is held to the tree: every module of the package is named there, and every module it names exists.
No module imports an underscore-private name from another subpackage (a scan of the package's imports).

The page's block gives each top-level module an entry of its own (``kernels.py ...``) and each folder one entry
(``capture/ ...``) whose text names its modules by their path inside the folder (``run.py``, ``taps/unet.py``), so
``capture/config.py`` and ``intervention/config.py`` are told apart by the entry they are named in."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXEMPT = {"__init__.py", "__main__.py"}


def named_modules() -> set[str]:
    """The ``.py`` paths the layout block names, relative to ``ipa_probe/`` (a folder entry's modules under it)."""
    text = (ROOT / "docs" / "layout.md").read_text()
    block = text.split("```", 2)[1]
    named, folder = set(), ""
    for line in block.splitlines()[2:]:  # after "ipa_probe/"
        entry = re.match(r"^  (\S+)", line)
        if entry:
            first = entry.group(1)
            folder = first if first.endswith("/") else ""
            if first.endswith(".py"):
                named.add(first)
        if re.match(r"^\S", line):  # hooks/, notebooks/ ...: outside the package
            break
        for path in re.findall(r"(?<![\w/.])((?:[a-z_]+/)*[a-z_0-9]+\.py)\b", line):
            if path == (entry.group(1) if entry else None):
                continue
            named.add(path if folder == "" or path.startswith(folder) else folder + path)
    return named


def package_modules() -> set[str]:
    package = ROOT / "ipa_probe"
    return {path.relative_to(package).as_posix() for path in package.rglob("*.py") if path.name not in EXEMPT}


def test_layout_names_every_module():
    missing = sorted(package_modules() - named_modules())
    assert not missing, f"docs/layout.md does not name: {missing}"


def test_layout_names_no_module_that_is_gone():
    gone = sorted(named_modules() - package_modules())
    assert not gone, f"docs/layout.md names modules that do not exist: {gone}"


#: Top-level modules that are the package's shared internals: their public names may be imported anywhere.
SHARED_INTERNALS = {"ipa_probe._checks", "ipa_probe._io", "ipa_probe._quiet", "ipa_probe._lazy"}


def _module_name(path: Path, package: Path) -> str:
    parts = list(path.relative_to(package.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _subpackage(module: str, package: Path) -> str:
    """``ipa_probe.capture.taps.unet`` -> ``capture``; a top-level module (``ipa_probe.compare``) -> ``""``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and (package / parts[1]).is_dir() else ""


def private_imports_across_subpackages(package: Path = ROOT / "ipa_probe") -> list[str]:
    """Every ``from ipa_probe.<a>... import _name`` (absolute or relative) in a module of another subpackage than
    ``<a>`` (top-level modules count as one subpackage of their own), as ``path:line: module._name``."""
    found = []
    for path in sorted(package.rglob("*.py")):
        module = _module_name(path, package)
        here = module if path.name == "__init__.py" else module.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.ImportFrom):
                continue
            if node.level:
                base = here.split(".")[: len(here.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != package.name:
                continue
            for alias in node.names:
                name = alias.name
                if not name.startswith("_") or name.startswith("__"):
                    continue
                if f"{target}.{name}" in SHARED_INTERNALS:  # the shared internal module itself
                    continue
                if _subpackage(target, package) != _subpackage(module, package):
                    found.append(f"{path.relative_to(package.parent)}:{node.lineno}: {target}.{name}")
    return found


def test_no_private_name_is_imported_across_subpackages():
    assert private_imports_across_subpackages() == []


def test_the_private_import_scan_finds_a_planted_violation(tmp_path):
    """The scan itself: a relative and an absolute import of a private name across subpackages are found; the same
    inside one subpackage, or of a shared internal module, is not."""
    package = tmp_path / "ipa_probe"
    for folder in ("capture", "devtools"):
        (package / folder).mkdir(parents=True)
        (package / folder / "__init__.py").write_text("")
    (package / "__init__.py").write_text("")
    (package / "capture" / "maps.py").write_text("from .report import _short\nfrom .. import _io\n")
    (package / "devtools" / "figures.py").write_text(
        "from ..capture.maps import _CODE, PUBLIC\nimport os\n\n\ndef f():\n    from ipa_probe.capture import _x\n"
    )
    (package / "probe_log.py").write_text("from ._io import write\nfrom .capture.report import _names\n")
    assert private_imports_across_subpackages(package) == [
        "ipa_probe/devtools/figures.py:1: ipa_probe.capture.maps._CODE",
        "ipa_probe/devtools/figures.py:6: ipa_probe.capture._x",
        "ipa_probe/probe_log.py:2: ipa_probe.capture.report._names",
    ]


#: Private names of other packages read on purpose, where no public route exists, and the package's own private names
#: on other packages' objects (``name: why``).
FOREIGN_PRIVATE = {
    "_run_key": "cli's own attribute on argparse's Namespace (underscored: no option's dest can clash with it)",
    "_exit": "os._exit: the documented way to end the process at once (cli, a second Ctrl-C)",
}


def _defined_names(trees: list[ast.Module]) -> set[str]:
    """Names the package defines: defs, classes, names assigned (module-level, class fields, dataclass fields,
    locals), ``self._x`` / ``cls._x`` targets, and its own module and folder names."""
    names = set()
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                names.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                    names.add(node.attr)
    return names


def foreign_private_reads(package: Path = ROOT / "ipa_probe") -> list[str]:
    """Every ``obj._name`` (and ``getattr(obj, "_name")``, ``hasattr``, ``setattr``, ``delattr``) in the package
    whose ``_name`` (not a dunder) the package does not define itself (:func:`_defined_names`) nor allow
    (:data:`FOREIGN_PRIVATE`), as ``path:line: _name``; and every import of another package's private module or name
    (``from torch.utils._python_dispatch import X``, ``from torch import _dynamo``), as ``path:line: dotted.name``."""
    paths = sorted(package.rglob("*.py"))
    trees = [ast.parse(path.read_text(), str(path)) for path in paths]
    own = _defined_names(trees) | {path.stem for path in paths} | {p.name for p in package.rglob("*") if p.is_dir()}
    found = []
    for path, tree in zip(paths, trees, strict=True):
        for node in ast.walk(tree):
            found += [f"{path.relative_to(package.parent)}:{node.lineno}: {name}" for name in _foreign_imports(node)]
            name = node.attr if isinstance(node, ast.Attribute) else None
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and len(node.args) > 1:
                reflective = node.func.id in ("getattr", "hasattr", "setattr", "delattr")
                if reflective and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str):
                    name = node.args[1].value
            if (
                name
                and name.startswith("_")
                and not name.startswith("__")
                and name not in own | FOREIGN_PRIVATE.keys()
            ):
                found.append(f"{path.relative_to(package.parent)}:{node.lineno}: {name}")
    return sorted(found)


def _foreign_imports(node: ast.AST) -> list[str]:
    """The dotted names an absolute import of another package than ipa_probe brings in with a private part."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
        names = [f"{node.module}.{alias.name}" for alias in node.names]
    else:
        return []
    private = [n for n in names if any(p.startswith("_") and not p.startswith("__") for p in n.split("."))]
    return [n for n in private if n.split(".")[0] != "ipa_probe"]


def test_no_module_reads_another_packages_private_attributes():
    assert foreign_private_reads() == []


def test_the_private_attribute_scan_finds_a_planted_read(tmp_path):
    """The scan itself: a foreign private attribute read directly or by ``getattr``/``hasattr`` is found; the
    package's own private names (a def, a class, a ``self._x`` target, a module-level name) are not; an import of a
    private module or name of another package is found, one of the package's own is not."""
    package = tmp_path / "ipa_probe"
    package.mkdir()
    (package / "_own.py").write_text("_LIMIT = 3\n")
    (package / "a.py").write_text(
        "class A:\n    def __init__(self):\n        self._kept = 1\n\n    def _helper(self):\n"
        "        return self._kept + self._helper() + _own._LIMIT\n\n\n"
        "def f(m, t):\n    return m._orig_mod, getattr(m, '_progress_bar_config'), hasattr(t, '_base'), t._version\n"
    )
    (package / "b.py").write_text(
        "import torch._dynamo\nfrom torch import _inductor, nn\nfrom torch.utils._python_dispatch import Mode\n"
        "from ipa_probe import _own\nfrom . import _own\nimport os.path\n"
    )
    assert foreign_private_reads(package) == [
        "ipa_probe/a.py:10: _base",
        "ipa_probe/a.py:10: _orig_mod",
        "ipa_probe/a.py:10: _progress_bar_config",
        "ipa_probe/a.py:10: _version",
        "ipa_probe/b.py:1: torch._dynamo",
        "ipa_probe/b.py:2: torch._inductor",
        "ipa_probe/b.py:3: torch.utils._python_dispatch.Mode",
    ]
