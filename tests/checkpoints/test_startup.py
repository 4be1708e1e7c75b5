"""Start-up: no meta-device skeleton and no torch / transformers / accelerate import for a
run that does not need them (class facts come from embedq's packaged or cached table)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

PROBE = r"""
import json, sys
job = sys.argv[1]
if job == "inspect":
    from embedq.jobs.inspect import inspect_checkpoint
    d = inspect_checkpoint(sys.argv[2])
    src = d["targets_from"]
else:
    from embedq.jobs.quantize import quantize_checkpoint
    from embedq.jobs.recipe import QuantizeRecipe
    quantize_checkpoint(sys.argv[2], QuantizeRecipe.from_options(8, progress=False))
    src = None
print(json.dumps({"source": src, "mods": sorted(m for m in ("torch", "transformers", "accelerate")
                                                if m in sys.modules)}))
"""


def _probe(job: str, path: Path, cache: Path) -> dict:
    env = dict(os.environ, PYTHONPATH=str(REPO), EMBEDQ_NO_TRANSFORMERS="1", EMBEDQ_CACHE=str(cache))
    r = subprocess.run([sys.executable, "-c", PROBE, job, str(path)], env=env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


def _warm(job: str, path: Path, cache: Path) -> None:
    """The packaged table (embedq/jobs/archfacts.json) covers the transformers version it was
    generated for. Under another version (a fresh venv takes the newest one the ranges
    admit) the first run reads the facts from transformers and keeps them in the cache:
    then it is that first run that imports transformers, and every later one must not."""
    from embedq.jobs import archfacts
    if json.loads(archfacts.PACKAGED.read_text())["transformers"] == archfacts.transformers_version():
        return
    first = _probe(job, path, cache)
    assert "transformers" in first["mods"], first
    assert list(cache.glob("archfacts-*.json")), "the computed facts were not cached"


def test_inspect_imports_neither_torch_nor_transformers(model_factory, tmp_path):
    for kind in ("gemma3_tied", "llama_untied_sharded"):
        path, cache = model_factory(kind), tmp_path / f"cache-{kind}"
        _warm("inspect", path, cache)
        d = _probe("inspect", path, cache)
        assert d == {"source": "transformers", "mods": []}, (kind, d)


def test_quantize_imports_no_transformers(model_factory, tmp_path):
    path, cache = model_factory("qwen2_tied"), tmp_path / "cache"
    _warm("inspect", path, cache)  # quantize would write the overlay: inspect caches the same facts
    d = _probe("quantize", path, cache)
    assert d["mods"] == ["torch"]


def test_unknown_class_is_computed_once_and_cached(model_factory, tmp_path):
    """A class the packaged table lacks: the first run asks transformers, the next reads the cache."""
    p = model_factory("gemma3_tied")
    cfg = json.loads((p / "config.json").read_text())
    cache = tmp_path / "cache"
    # an architecture name the table lacks: facts come from the model type's auto class
    cfg["architectures"] = ["NotATransformersClass"]
    (p / "config.json").write_text(json.dumps(cfg))
    first = _probe("inspect", p, cache)
    assert "transformers" in first["mods"]
    assert list(cache.glob("archfacts-*.json"))
    second = _probe("inspect", p, cache)
    assert second["mods"] == [] and second["source"] == first["source"]
