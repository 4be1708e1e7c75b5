"""The docs cite only what exists: every script, test file (and test name), module and
``embedq/...`` path that README.md or docs/*.md names — in the numbers blocks above all,
where a figure is only as good as the command that printed it."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
# a repository path: scripts/…, tests/…, embedq/…, constraints/…, docs/… with a file suffix
PATH = re.compile(r"(?<![\w./-])((?:scripts|tests|embedq|constraints|docs|\.ci)/[\w./-]*\w)(?:::(\w+))?")
SUFFIXES = (".py", ".sh", ".c", ".md", ".txt", ".json", ".mjs", ".toml")


def _refs():
    for doc in DOCS:
        for n, line in enumerate(doc.read_text().splitlines(), 1):
            for m in PATH.finditer(line):
                path, test = m.group(1).rstrip("."), m.group(2)
                if path.endswith(SUFFIXES) or test or (REPO / path).is_dir() or "/" in path[len("x/"):]:
                    yield doc.relative_to(REPO), n, path, test


def _test_names(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {node.name for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.ClassDef))}


def test_docs_cite_existing_paths():
    missing = []
    for doc, n, path, test in _refs():
        p = REPO / path
        if not p.exists() and not p.with_suffix(".py").exists():  # `embedq/kernels/prepared` ⇒ .py
            missing.append(f"{doc}:{n}: {path}")
        elif test and p.suffix == ".py" and test not in _test_names(p):
            missing.append(f"{doc}:{n}: {path}::{test} (no such test)")
    assert not missing, "docs cite what does not exist:\n" + "\n".join(missing)


def test_the_check_sees_citations():
    """Positive control: the scan finds the README's test command and a docs script."""
    refs = {(str(d), p) for d, _, p, _ in _refs()}
    assert ("README.md", "scripts/test.sh") in refs
    assert any(p.startswith("scripts/bench_") for _, p in refs)


CMD = re.compile(r"(?:python3? |bash )?((?:scripts|tests)/[\w./-]+\.(?:py|sh))((?: +[^`|\s][^`|]*)?)")


def test_docs_cite_existing_options():
    """`python scripts/X.py --opt …` in the docs: X.py knows ``--opt`` (its source names it)."""
    unknown, seen = [], 0
    for doc in DOCS:
        fenced = False
        for n, line in enumerate(doc.read_text().splitlines(), 1):
            if line.lstrip().startswith("```"):
                fenced = not fenced
                continue
            for chunk in [line] if fenced else re.findall(r"`([^`]+)`", line):
                for m in CMD.finditer(chunk):
                    script = REPO / m.group(1)
                    if not script.is_file() or script.suffix != ".py" or script.parent.name == "tests":
                        continue
                    src = script.read_text()
                    for opt in re.findall(r"(?<![\w-])(--[a-z][\w-]*)", m.group(2).split("#")[0]):
                        seen += 1
                        if f'"{opt}"' not in src and f"'{opt}'" not in src:
                            unknown.append(f"{doc.relative_to(REPO)}:{n}: {m.group(1)} {opt}")
    assert seen > 20, seen  # the scan reads the docs' commands (positive control)
    assert not unknown, "docs cite options the script does not have:\n" + "\n".join(unknown)
