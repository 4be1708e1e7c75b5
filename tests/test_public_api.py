"""The public API's typed signatures mirror the layers (and the CLI), and ``inspect`` returns a
typed result whose ``to_dict()`` is exactly what ``embedq inspect --json`` prints."""

from __future__ import annotations

import inspect as pyinspect
import json

import pytest
from typer.testing import CliRunner

import embedq
from embedq.cli import app
from embedq.jobs.inspect import InspectResult
from embedq.jobs.recipe import QuantizeRecipe


def _kw(f) -> dict[str, object]:
    return {n: p.default for n, p in pyinspect.signature(f).parameters.items()
            if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}


def test_no_loose_keywords():
    for f in (embedq.quantize, embedq.evaluate, embedq.plan, embedq.push, embedq.inspect):
        kinds = {p.kind for p in pyinspect.signature(f).parameters.values()}
        assert pyinspect.Parameter.VAR_KEYWORD not in kinds, f.__name__


def test_facades_mirror_the_layers():
    from embedq.capacity.plan import plan
    from embedq.hub.push import push
    from embedq.quality.evaluate import evaluate
    for facade, real in ((embedq.evaluate, evaluate), (embedq.plan, plan), (embedq.push, push)):
        assert _kw(facade) == _kw(real), facade.__name__


def test_quantize_keywords_are_the_recipe_options():
    fields = set(_kw(QuantizeRecipe.from_options)) | {f for f in QuantizeRecipe.__dataclass_fields__}
    mine = set(_kw(embedq.quantize)) - {"path", "recipe"}
    assert mine <= fields, mine - fields
    # every recipe field a user sets has its keyword (scheme/search are built from options)
    assert set(QuantizeRecipe.__dataclass_fields__) - {"scheme", "head_scheme", "fit_default", "search"} <= mine


def test_quantize_refuses_recipe_and_options():
    with pytest.raises(TypeError, match="recipe or options"):
        embedq.quantize(".", recipe=QuantizeRecipe(), group_size=32)


def test_inspect_result_is_typed_and_json_identical(model_factory):
    path = model_factory("qwen2_tied")
    res = embedq.inspect(path)
    assert isinstance(res, InspectResult)
    assert res.tensors[0].role == "embedding" and res["tensors"][0]["role"] == "embedding"
    out = CliRunner().invoke(app, ["inspect", str(path), "--json"])
    assert out.exit_code == 0
    assert out.output == json.dumps(res.to_dict(), indent=2) + "\n"


def test_inspect_decides_by_content(model_factory, tmp_path):
    """A file that is not GGUF is named for what it is (the API and the CLI alike), not
    sent to the GGUF reader; a GGUF file is read whatever its name."""
    from typer.testing import CliRunner

    from embedq.cli import app
    from embedq.errors import CheckpointError
    path = model_factory("qwen2_tied")
    for f, what in ((path / "config.json", "a JSON file"), (path / "model.safetensors", "a safetensors file")):
        with pytest.raises(CheckpointError, match=what):
            embedq.inspect(f)
        res = CliRunner().invoke(app, ["inspect", str(f)])
        assert res.exit_code == 2 and what in res.stderr and "gguf" not in res.stderr.split(":")[-1][:8]
    from tests.gguf.ggufutil import write_llama_gguf  # gguf: in the [test] extra
    g = write_llama_gguf(model_factory("llama_untied_fp32"), tmp_path / "renamed.bin")
    assert embedq.inspect(g)["format"] == "gguf"  # read by the magic, whatever the name
