"""The package's layering (docs/architecture.md): imports only downward, no cycles,
no private names across modules, and each format fact defined once."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parent.parent / "embedq"

# Lower number = lower layer. A module may import its own layer (no cycles) or lower ones.
LAYERS = {
    "embedq.errors": 0, "embedq.version": 0,
    "embedq.format": 1,
    "embedq.kernels": 1.5,  # serving kernels: read the stored layout, import only format
    "embedq.quant": 2,
    "embedq.jobs": 3,
    "embedq.backends": 4,
    "embedq.hub": 5, "embedq.quality": 5, "embedq.capacity": 5,
    "embedq.cli": 6,
    "embedq": 7,  # the public API facade (embedq/__init__.py)
}


def _module_name(path: Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _layer(mod: str) -> int:
    best = None
    for prefix, layer in LAYERS.items():
        if mod == prefix or mod.startswith(prefix + "."):
            if best is None or len(prefix) > len(best[0]):
                best = (prefix, layer)
    assert best is not None, f"{mod}: not in any layer of docs/architecture.md"
    return best[1]


def _imports(path: Path) -> list[tuple[str, list[str], int]]:
    """(module imported, names imported, line) of every embedq import in ``path``."""
    tree = ast.parse(path.read_text(), str(path))
    me = _module_name(path)
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, [], node.lineno) for a in node.names if a.name.split(".")[0] == "embedq"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = me.split(".")[: -node.level + (1 if path.name == "__init__.py" else 0) or None]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if mod.split(".")[0] == "embedq":
                out.append((mod, [a.name for a in node.names], node.lineno))
    return out


MODULES = sorted(PKG.rglob("*.py"))
KNOWN = {_module_name(p) for p in MODULES}


def _resolve(mod: str, names: list[str]) -> list[str]:
    """``from pkg import submodule`` imports the submodule."""
    subs = [f"{mod}.{n}" for n in names if f"{mod}.{n}" in KNOWN]
    return subs or [mod]


@pytest.mark.parametrize("path", MODULES, ids=lambda p: _module_name(p))
def test_imports_only_downward_and_no_private_names(path):
    me = _module_name(path)
    mine = _layer(me)
    for mod, names, line in _imports(path):
        for target in _resolve(mod, names):
            if target == "embedq" and me != "embedq":
                pytest.fail(f"{path}:{line}: imports the package facade `embedq` (import the module that defines the name)")
            assert _layer(target) <= mine, f"{path}:{line}: {me} (layer {mine}) imports {target} (layer {_layer(target)})"
        if mod.startswith("embedq") and mod != me:
            private = [n for n in names if n.startswith("_") and not n.startswith("__")
                       and f"{mod}.{n}" not in KNOWN]
            assert not private, f"{path}:{line}: uses private name(s) {private} of {mod}"


def test_no_import_cycles():
    graph: dict[str, set[str]] = {m: set() for m in KNOWN}
    for p in MODULES:
        me = _module_name(p)
        for mod, names, _ in _imports(p):
            for t in _resolve(mod, names):
                if t in KNOWN and t != me and t != "embedq":
                    graph[me].add(t)
    # a package's __init__ importing its own submodules is not a cycle of behaviour we care about
    seen, stack, cycles = set(), [], []

    def visit(n):
        if n in stack:
            cycles.append(stack[stack.index(n):] + [n])
            return
        if n in seen:
            return
        seen.add(n)
        stack.append(n)
        for m in sorted(graph[n]):
            if not (m.startswith(n + ".") or n.startswith(m + ".")):
                visit(m)
        stack.pop()

    for n in sorted(graph):
        visit(n)
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_no_module_tricks():
    for p in MODULES:
        src = p.read_text()
        for pat in (r"\.__class__\s*=", r"sys\.meta_path", r"__qualname__\s*=", r"importlib\.import_module\(f"):
            assert not re.search(pat, src), f"{p}: module trick `{pat}`"


@pytest.mark.parametrize("fact,pattern", [
    ("QUANT_METHOD", r"^QUANT_METHOD\s*="),
    ("FORMAT_VERSION", r"^FORMAT_VERSION\s*="),
    ("head names", r"\(\s*\"lm_head\",\s*\"embed_out\""),
    ("dtype tables", r"torch\.bfloat16\s*:\s*\"|\"bfloat16\"\s*:\s*torch\.|\"BF16\"\s*:\s*torch\."),
    ("the quant method literal", r"quant_method\"?\)?\s*[=!]=\s*\"embedq\""),
])
def test_each_format_fact_defined_once(fact, pattern):
    hits = [f"{p.relative_to(PKG.parent)}:{i}" for p in MODULES
            for i, line in enumerate(p.read_text().splitlines(), 1) if re.search(pattern, line)]
    allowed = {"QUANT_METHOD": 1, "FORMAT_VERSION": 1, "head names": 1, "dtype tables": 2,
               "the quant method literal": 0}[fact]
    assert len(hits) <= allowed, f"{fact} defined in {len(hits)} places: {hits}"


def test_one_decoder_for_every_reader():
    """verify and every back end read overlays through embedq.format (reader / codec)."""
    readers = {"transformers": "embedq/backends/transformers", "vllm": "embedq/backends/vllm",
               "onnx": "embedq/backends/onnx", "gguf": "embedq/backends/gguf",
               "verify": "embedq/jobs/verify.py"}
    for name, rel in readers.items():
        path = PKG.parent / rel
        srcs = [p.read_text() for p in (sorted(path.rglob("*.py")) if path.is_dir() else [path])]
        assert any(re.search(r"embedq\.(format\.(codec|reader)|kernels)", s) for s in srcs), \
            f"{rel} does not decode through embedq.format"
    # and nobody else unpacks bits: decoding lives in the scheme units (format/scheme_units.py)
    for p in MODULES:
        rel = str(p.relative_to(PKG.parent))
        if rel == UNIT_FILE or rel in FOREIGN_LAYOUTS:
            continue
        hits = _nibble_ops(p)
        assert not hits, (f"{rel}:{hits[0]} decodes packed codes itself (a mask or shift by a "
                          "code width): call embedq.format.scheme_units")


# The one place codes are packed and unpacked.
UNIT_FILE = "embedq/format/scheme_units.py"
# Another format's own nibble layout, never the overlay's bytes: GGUF's Q4_0 order (encoded
# from codes the unit decoded) and torch's CPU int4pack (discovered, decoded for the gather).
# Every embedq layout decodes through the unit (no kernel keeps a decoder twin).
FOREIGN_LAYOUTS = {"embedq/backends/gguf/blocks.py", "embedq/kernels/torch_int4.py"}
CODE_WIDTHS = (4,)  # shifts by a code width below a byte
CODE_MASKS = (0x0F,)


def _nibble_ops(path: Path) -> list[int]:
    """Lines of ``path`` that mask with a code mask (``& 15``, ``& 0x0F``, ``& 0xf`` ...) or shift
    by a code width, whatever their spelling (read from the syntax tree, not the text)."""
    lines = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.BinOp) and isinstance(node.right, ast.Constant):
            v = node.right.value
            if (isinstance(node.op, ast.BitAnd) and v in CODE_MASKS) or \
                    (isinstance(node.op, (ast.RShift, ast.LShift)) and v in CODE_WIDTHS):
                lines.append(node.lineno)
    return lines


def test_nibble_detector_matches_every_spelling(tmp_path):
    for src in ("b & 15", "b & 0x0F", "b & 0xf", "b >> 4", "(u << 4)"):
        f = tmp_path / "m.py"
        f.write_text(f"x = {src}\n")
        assert _nibble_ops(f) == [1], src
    f.write_text("x = b >> 8\ny = b & 0xFF\n")
    assert _nibble_ops(f) == []


def test_no_test_package_shadows_an_installed_module():
    """pytest puts ``tests/`` on sys.path for the packages under it (``tests/NAME/__init__.py``,
    no ``tests/__init__.py``): a test package named like a real module hides it. transformers
    5.25 imports the Hub's ``kernels`` package, which ``tests/kernels`` hid on a fresh install
    (42 collection errors); every name is checked against the installed distributions."""
    import importlib.metadata as md
    tests = Path(__file__).resolve().parent
    installed = set(md.packages_distributions())
    packages = {p.parent.name for p in tests.glob("*/__init__.py")}
    assert packages, "no test packages found"
    assert not packages & installed, f"test packages named like installed modules: {packages & installed}"


def test_package_data_ships_every_kernel_source_and_header():
    """A wheel carries what the kernels compile from: every ``.c`` and every header it
    ``#include``s beside it (build.c_source inlines them at run time; a header left out of
    package-data made every C kernel unavailable in a non-editable install)."""
    import fnmatch
    import tomllib
    root = Path(__file__).resolve().parents[1]
    data = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    globs = data.get("embedq.kernels", [])
    kdir = root / "embedq" / "kernels"
    needed = {p.name for p in kdir.glob("*.c")}
    for p in kdir.glob("*.[ch]"):
        needed |= set(re.findall(r'#include "([^"/]+)"', p.read_text()))
    missing = sorted(n for n in needed if not any(fnmatch.fnmatch(n, g) for g in globs))
    assert not missing, f"pyproject.toml [tool.setuptools.package-data] embedq.kernels lacks {missing}"
