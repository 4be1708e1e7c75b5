"""One recipe per request: the command line and :func:`embedq.quantize` build the same
:class:`QuantizeRecipe` for the same options, and the writers get it unchanged."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

import embedq
import embedq.jobs.quantize as jobs_quantize
import embedq.quality.select as select
from embedq.cli.app import app
from embedq.errors import EmbedqError
from embedq.format.scheme import DEFAULT_BITS, DEFAULT_SCHEMES, Scheme
from embedq.jobs.recipe import QuantizeRecipe, SchemeSearch


class _Report:
    extra: dict = {}

    def to_json(self) -> str:
        return "{}"

    def table(self) -> str:
        return ""


@pytest.fixture
def captured(monkeypatch):
    """The recipes that reach the writer (nothing is written)."""
    seen: list[QuantizeRecipe] = []

    def quantize_checkpoint(path, recipe):
        seen.append(recipe)
        return _Report()

    def quantize_auto(path, recipe, log=None):
        seen.append(recipe)
        return _Report(), _Report()

    monkeypatch.setattr(jobs_quantize, "quantize_checkpoint", quantize_checkpoint)
    monkeypatch.setattr(select, "quantize_auto", quantize_auto)
    return seen


def _cli(seen, *args) -> QuantizeRecipe:
    r = CliRunner().invoke(app, ["quantize", "model", *args])
    assert r.exit_code == 0, r.output
    return seen.pop()


CASES = [
    ([], {}),
    (["--bits", "4"], {"bits": 4}),
    (["--bits", "4", "--group-size", "64", "--asym", "--method", "mse", "--lm-head", "--head-bits", "8",
      "--targets", "model.embed_tokens.weight,lm_head.weight", "--output", "out", "--overlay-only",
      "--force", "--trust-tensors", "--scale-dtype", "float32", "--chunk-rows", "256", "-q"],
     {"bits": 4, "group_size": 64, "symmetric": False, "method": "mse", "lm_head": True, "head_bits": 8,
      "targets": ["model.embed_tokens.weight", "lm_head.weight"], "output": "out", "overlay_only": True,
      "force": True, "trust": "tensors", "scale_dtype": "float32", "chunk_rows": 256, "progress": False}),
    (["--bits", "8", "--group-size", "0", "--head-group-size", "32", "--format", "compressed-tensors",
      "-o", "ct", "--base-model", "org/m", "--base-revision", "main", "--eval", "eval.json", "--json"],
     {"bits": 8, "group_size": 0, "head_group_size": 32, "format": "compressed-tensors", "output": Path("ct"),
      "base_model": "org/m", "base_revision": "main", "eval_results": Path("eval.json"), "progress": False}),
    (["--auto"], {"auto": True}),
    (["--max-kld", "0.02", "--method", "rtn", "--lm-head", "--scale-dtype", "float16"],
     {"max_kld": 0.02, "method": "rtn", "lm_head": True, "scale_dtype": "float16"}),
    (["--bits", "4", "--max-kld", "0.05"], {"bits": 4, "max_kld": 0.05}),
    (["--bits", "8", "--auto"], {"bits": 8, "auto": True}),
]


@pytest.mark.parametrize("args,options", CASES, ids=lambda c: " ".join(c) if isinstance(c, list) else None)
def test_cli_and_api_build_the_same_recipe(captured, args, options):
    from_cli = _cli(captured, *args)
    embedq.quantize("model", **options)
    from_api = captured.pop()
    assert from_cli == from_api
    assert from_api == QuantizeRecipe.from_options(**options)


def test_defaults_come_from_the_one_table(captured):
    r = _cli(captured)
    group, symmetric = DEFAULT_SCHEMES[DEFAULT_BITS]
    assert r.scheme == Scheme(bits=DEFAULT_BITS, group_size=group, symmetric=symmetric)
    assert r.head_scheme is None and r.search is None and r == QuantizeRecipe()
    for bits, (group, symmetric) in DEFAULT_SCHEMES.items():
        s = QuantizeRecipe.from_options(bits).scheme
        assert (s.bits, s.group_size, s.symmetric, s.method) == (bits, group, symmetric, "rtn")
    assert QuantizeRecipe.from_options(auto=True).search == SchemeSearch()


def test_head_scheme_falls_back_to_the_table():
    r = QuantizeRecipe.from_options(4, group_size=64, symmetric=False, lm_head=True, head_bits=4)
    assert r.head_scheme == Scheme(bits=4, group_size=64, symmetric=False)
    r = QuantizeRecipe.from_options(4, lm_head=True, head_bits=8)  # other bits: their defaults
    assert r.head_scheme == Scheme.default(8, symmetric=True)


@pytest.mark.parametrize("options,message", [
    ({"auto": True, "group_size": 32}, "--max-kld/--auto choose bits"),
    ({"max_kld": 0.1, "format": "compressed-tensors", "output": "x"}, "embedq format only"),
    ({"format": "gguf"}, "--format 'gguf'"),
    ({"format": "compressed-tensors"}, "pass --output DIR"),
    ({"overlay_only": True}, "--overlay-only writes an overlay bundle to --output DIR"),  # not in place
    ({"format": "compressed-tensors", "output": "x", "symmetric": False}, "drop --asym"),
    ({"chunk_rows": 0}, "--chunk-rows 0"),
    ({"bits": 3}, "--bits 3"),
    ({"bits": 3, "auto": True}, "--bits 3"),
    ({"bits": 4, "max_kld": 0.1, "symmetric": False}, "--max-kld/--auto choose bits"),
])
def test_bad_options_fail_when_the_recipe_is_built(captured, options, message):
    with pytest.raises(EmbedqError, match=message.replace("(", r"\(")):
        embedq.quantize("model", **options)
    assert not captured


def test_compressed_tensors_format_takes_the_recipe(model_factory, tmp_path):
    """``format="compressed-tensors"`` goes through the one writer and gets a stock config."""
    import json
    src = model_factory("llama_untied_sharded")
    out = tmp_path / "ct"
    report = embedq.quantize(src, 8, format="compressed-tensors", output=out, lm_head=True,
                             head_bits=4, head_group_size=32, progress=False)
    assert report.mode == "derived (compressed-tensors)"
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors"
    tied = model_factory("qwen2_tied")
    with pytest.raises(EmbedqError, match="tied embeddings: stock vLLM"):
        embedq.quantize(tied, format="compressed-tensors", output=tmp_path / "t", progress=False)
    assert not (tmp_path / "t").exists()


def test_a_ready_recipe_reaches_the_writer_unchanged(captured):
    r = QuantizeRecipe.from_options(4, lm_head=True, progress=False)
    embedq.quantize("model", recipe=r)
    assert captured.pop() is r
    with pytest.raises(TypeError, match="not both"):
        embedq.quantize("model", 8, recipe=r)


def test_bits_narrows_the_search_to_that_width(monkeypatch, tmp_path):
    """``--bits B`` with ``--max-kld``/``--auto`` searches only B-bit candidates ("the smallest
    4-bit scheme under X"); without it (the CLI passes None, not the default 8) every width."""
    assert QuantizeRecipe.from_options(4, auto=True).search == SchemeSearch(bits=4)
    assert QuantizeRecipe.from_options(auto=True).search.bits is None
    assert QuantizeRecipe.from_options(max_kld=0.5).search.bits is None
    seen: list = []

    def select_scheme(path, max_kld, candidates=None, **kw):
        seen.append(candidates)
        return select.Selection(max_kld, None)

    monkeypatch.setattr(select, "select_scheme", select_scheme)
    monkeypatch.setattr("embedq.jobs.overlay.compile_min_bytes", lambda: 0)
    for bits in (4, 8, None):
        r = QuantizeRecipe.from_options(bits, max_kld=0.05, progress=False)
        with pytest.raises(select.SelectError) as e:
            select.quantize_auto(tmp_path, r)
        cands = seen.pop()
        assert cands and {c[0] for c in cands} == ({bits} if bits else {4, 8})
        assert [c for c in select.CANDIDATES if c in cands] == cands  # same order
        msg = str(e.value)
        if bits:
            assert msg == (f"no {bits}-bit candidate scheme has mean KLD <= 0.05 on the sample; "
                           f"drop --bits {bits} to try every width")
        else:
            assert msg == "no candidate scheme has mean KLD <= 0.05 on the sample"
    # the command line: --bits not given is not --bits 8
    r = CliRunner().invoke(app, ["quantize", str(tmp_path), "--max-kld", "0.05", "-q"])
    assert r.exit_code == 2 and seen.pop() == select.CANDIDATES, r.output
    r = CliRunner().invoke(app, ["quantize", str(tmp_path), "--bits", "4", "--auto", "-q"])
    assert r.exit_code == 2 and "no 4-bit candidate scheme has mean KLD <= 0.01" in r.output, r.output
    assert {c[0] for c in seen.pop()} == {4}


def test_bits_whose_schemes_fit_no_table_says_so(monkeypatch, tmp_path):
    """``--bits 4`` on a table whose width no 4-bit group divides: nothing was measured, so
    the error says the schemes do not fit (not that they failed the KLD bound)."""
    def select_scheme(path, max_kld, candidates=None, **kw):
        sel = select.Selection(max_kld, None)
        for bits, group, sym in candidates:
            note = f"does not fit: model.embed_tokens.weight: 48 columns are not divisible by group size {group}"
            sel.trials.append(select.Trial(f"q{bits}-g{group}", bits, group, sym, "mse", group, note=note))
        return sel

    monkeypatch.setattr(select, "select_scheme", select_scheme)
    monkeypatch.setattr("embedq.jobs.overlay.compile_min_bytes", lambda: 0)
    r = QuantizeRecipe.from_options(4, max_kld=0.05, progress=False)
    with pytest.raises(select.SelectError) as e:
        select.quantize_auto(tmp_path, r)
    assert str(e.value) == ("no 4-bit candidate scheme fits the table (model.embed_tokens.weight: 48 columns "
                            "are not divisible by group size 32); drop --bits 4 to try every width")


class _AutoReport:
    """What quantize_checkpoint returns, with its own ``extra`` (quantize_auto fills it)."""

    def __init__(self):
        self.extra: dict = {}

    def to_json(self) -> str:
        import json
        return json.dumps({"extra": self.extra})

    def table(self) -> str:
        return "report"


@pytest.mark.parametrize("bits", [4, 8, None], ids=["bits4", "bits8", "every-width"])
def test_a_narrowed_search_says_so(monkeypatch, tmp_path, bits):
    """``--bits B`` with ``--auto``/``--max-kld``: the selection table's header names the
    B-bit-only search and ``report.extra["auto"]["bits"]`` (``--json``) is B; without
    ``--bits`` the header claims no narrowing and the key is null."""
    import json

    def select_scheme(path, max_kld, candidates=None, **kw):
        sel = select.Selection(max_kld, None, sample="the sample", tokens=8)
        b, g, s = candidates[0]
        sel.trials.append(select.Trial(f"int{b}", b, g, s, "mse", 100, mean_kld=0.0, same_top1=100.0))
        sel.chosen = sel.trials[0]
        return sel

    monkeypatch.setattr(select, "select_scheme", select_scheme)
    monkeypatch.setattr("embedq.jobs.overlay.compile_min_bytes", lambda: 0)
    monkeypatch.setattr(jobs_quantize, "quantize_checkpoint", lambda path, recipe: _AutoReport())
    flags = ["--bits", str(bits)] if bits else []
    r = CliRunner().invoke(app, ["quantize", str(tmp_path), *flags, "--auto", "-q"])
    assert r.exit_code == 0, r.output
    header = r.output.splitlines()[0]
    assert header.startswith("auto: smallest overlay") and "KLD <= 0.01" in header, header
    if bits:
        assert f"among {bits}-bit schemes only (--bits {bits})" in header, header
    else:
        assert "schemes only" not in header and "--bits" not in header, header
    r = CliRunner().invoke(app, ["quantize", str(tmp_path), *flags, "--max-kld", "0.05", "--json"])
    assert r.exit_code == 0, r.output
    auto = json.loads(r.output)["extra"]["auto"]
    assert "bits" in auto and auto["bits"] == bits
    assert auto["max_kld"] == 0.05 and auto["chosen"]["bits"] == (bits or 4)
    # the Python API: the same key in report.extra["auto"]
    report = embedq.quantize(tmp_path, bits, auto=True, progress=False)
    assert report.extra["auto"]["bits"] == bits
