"""Fuzz the CLI's argument parsing (issue #39): every verb, random option values.

For each verb (``demo`` excluded) hypothesis picks which options to pass and their values
(ints incl. negative / huge, floats incl. nan / inf, strings incl. empty / unicode /
path-like / ``..``, paths that exist / do not / are files instead of folders) and runs the
verb in-process on a tiny checkpoint built once per module. For every example:

- no traceback: ``result.exception`` is None or a ``SystemExit``;
- a non-zero exit that is not click's usage error (exit 2 with ``Usage:``) ends with one
  ``embedq: error: `` line, the last line of stderr, and there is exactly one;
- the shared inputs (source checkpoint, in-place overlay, derived checkpoint, overlay
  bundle, GGUF, ONNX, text files) are byte-identical afterwards; verbs that write in place
  (quantize without --output, remove, apply, card) get a fresh copy each example, which
  may change only on exit 0 (and not at all with --output / --stdout / on failure).

Slow success paths are kept out: ``onnx export`` only ever sees folders without an
overlay (it fails before exporting); eval / --max-kld / gptq (on a table a head reads)
fail for want of a tokenizer.
Relative paths resolve in a fresh scratch folder three levels deep, so at most three
``..`` never leave it. The Hub is offline (HF_HUB_OFFLINE=1): Hub-id-looking strings fail
without a network call. ``--profile`` is left out: it switches on a process-wide profiler.
"""

from __future__ import annotations

import os
import shutil
import sys
import traceback
from collections import Counter, defaultdict
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from ckptutil import snapshot

# (The Hub is made offline per example, with monkeypatch: a module-level os.environ change
# would leak into every later test of the session, the fake-Hub push tests included.)
from embedq.cli import app  # noqa: E402

runner = CliRunner()
# Every character, line breaks included: embedq.cli.common.one_line escapes what
# str.splitlines() would break an error line at (a path or value holding "\r").
CHARS = st.characters()
PREFIX = "embedq: error: "
FLAGS8 = ["--bits", "8", "--group-size", "32", "--scale-dtype", "float16"]


def _fuzz(n: int):
    return settings(max_examples=n, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture,
                                           HealthCheck.too_slow, HealthCheck.data_too_large])


# --- the world: inputs built once ----------------------------------------------------------

def _quantize(model: Path, *flags: str) -> None:
    r = runner.invoke(app, ["quantize", str(model), "-q", *flags])
    assert r.exit_code == 0, r.output


def _onnx_file(path: Path) -> Path:
    """A float graph with a [512, 64] Gather table that is not the overlay's source."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper
    table = numpy_helper.from_array(np.random.default_rng(1).standard_normal((512, 64), dtype=np.float32),
                                    "model.embed_tokens.weight")
    g = helper.make_graph(
        [helper.make_node("Gather", ["model.embed_tokens.weight", "input_ids"], ["h"]),
         helper.make_node("MatMul", ["h", "head_t"], ["logits"])],
        "tiny", [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["b", "s"])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["b", "s", 512])],
        [table, numpy_helper.from_array(np.ascontiguousarray(numpy_helper.to_array(table).T), "head_t")])
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


@pytest.fixture(scope="module")
def world(model_factory, tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz")
    w = {"src": model_factory("qwen2_tied"), "inplace": model_factory("qwen2_tied")}
    _quantize(w["inplace"], *FLAGS8)
    w["derived"] = root / "derived"
    _quantize(w["src"], "-o", str(w["derived"]))
    w["bundle"] = root / "bundle"
    _quantize(w["src"], "-o", str(w["bundle"]), "--overlay-only", *FLAGS8)
    sys.path.insert(0, str(Path(__file__).parent / "gguf"))
    try:
        from ggufutil import write_llama_gguf
    finally:
        sys.path.pop(0)
    w["gguf"] = write_llama_gguf(w["src"], root / "base.gguf")
    w["onnx"] = _onnx_file(root / "float.onnx")
    w["text"] = root / "notes.txt"
    w["text"].write_text("hello world, ünïcode\n" * 50)
    w["badjson"] = root / "eval.json"
    w["badjson"].write_text('{"kld": nan, ')
    w["empty"] = root / "empty"
    w["empty"].mkdir()
    w["config"] = w["src"] / "config.json"  # a file where a folder is expected
    w["shard"] = w["src"] / "model.safetensors"
    w["missing"] = root / "missing" / "nowhere"
    w["scratch"] = root / "scratch"
    pristine = {k: snapshot(p) if p.is_dir() else p.read_bytes() for k, p in w.items()
                if k not in ("config", "shard", "missing", "scratch")}
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        mp.setenv("HF_HOME", str(root / "hf-home"))  # no cached token, no cache of this machine
        mp.setenv("EMBEDQ_DEBUG", "0")
        mp.delenv("EMBEDQ_PROFILE", raising=False)
        mp.delenv("EMBEDQ_TEST_KILL_AT", raising=False)
        try:
            import huggingface_hub.constants as hc
            mp.setattr(hc, "HF_HUB_OFFLINE", True)
        except ImportError:
            pass
        cwd = os.getcwd()
        yield World(w, pristine)
        os.chdir(cwd)


OUTCOMES: dict[str, Counter] = defaultdict(Counter)  # verb -> outcome -> examples


class World(tuple):
    """(paths by name, their pristine snapshots); a short repr for hypothesis' reports."""

    def __new__(cls, w, pristine):
        return super().__new__(cls, (w, pristine))

    def __repr__(self) -> str:
        return "world"


class Example:
    """One example: a fresh scratch cwd, fresh copies for in-place verbs, the checks."""

    counter = 0

    def __init__(self, world):
        self.w, self.pristine = world
        Example.counter += 1
        self.dir = self.w["scratch"] / str(Example.counter)
        self.cwd = self.dir / "a" / "b" / "c"
        self.cwd.mkdir(parents=True)
        os.chdir(self.cwd)
        self.copies: dict[str, Path] = {}

    def copy(self, name: str) -> Path:
        """A private copy of a shared checkpoint (for verbs that write in place)."""
        if name not in self.copies:
            dst = self.dir / f"copy-{name}"
            shutil.copytree(self.w[name], dst)
            self.copies[name] = dst
        return self.copies[name]

    # strategies ------------------------------------------------------------------------

    def path(self, *kinds: str, copies: tuple[str, ...] = ()):
        """A path argument: one of ``kinds`` (shared inputs), a fresh copy, or a relative
        path in the scratch folder (existing or not, ``..`` included)."""
        fixed = [str(self.w[k]) for k in kinds]
        opts = [st.sampled_from(fixed)] if fixed else []
        if copies:
            opts.append(st.sampled_from(copies).map(lambda c: str(self.copy(c))))
        seg = st.sampled_from(["..", ".", "x", "ü ñ", "", "config.json", "model.safetensors",
                               "-x", "a b", "out.onnx", "out.gguf", "c"])
        opts.append(st.lists(seg, min_size=1, max_size=3).map("/".join))
        opts.append(st.text(CHARS, max_size=8).map(lambda s: s.lstrip("/") or "."))
        opts.append(st.sampled_from(["file", "dir", "dir/"]).map(self._scratch_thing))
        return st.one_of(*opts)

    def _scratch_thing(self, kind: str) -> str:
        p = self.cwd / "thing"
        if not p.exists():
            if kind == "file":
                p.write_text("not a checkpoint\n")
            else:
                p.mkdir()
        return str(p) + ("/" if kind == "dir/" else "")

    # the run and its checks --------------------------------------------------------------

    def invoke(self, argv: list[str], may_write: dict[str, str] | None = None):
        """Run ``embedq argv``; ``may_write``: copy name -> "exit0" (may change on exit 0),
        "keep" (original files kept, new ones allowed on exit 0) or absent (unchanged)."""
        may_write = may_write or {}
        before = {n: snapshot(p) for n, p in self.copies.items()}
        r = runner.invoke(app, argv, catch_exceptions=True)
        OUTCOMES[" ".join(argv[:2] if argv[0] == "onnx" else argv[:1])][
            "usage" if r.exit_code == 2 and "Usage:" in r.stderr else f"exit {r.exit_code}"] += 1
        if os.environ.get("FUZZ_LOG"):  # FUZZ_LOG=file: one line per example (exit, argv, last stderr line)
            with open(os.environ["FUZZ_LOG"], "a") as f:
                f.write(f"{r.exit_code}\t{argv!r}\t{(r.stderr.strip().splitlines() or [''])[-1][:200]}\n")
        shown = f"embedq {argv!r}\nexit {r.exit_code}\nstdout: {r.stdout[-2000:]}\nstderr: {r.stderr[-2000:]}"
        if r.exception is not None and not isinstance(r.exception, SystemExit):
            tb = "".join(traceback.format_exception(*r.exc_info))
            raise AssertionError(f"traceback from {shown}\n{tb}")
        if r.exit_code != 0 and not (r.exit_code == 2 and "Usage:" in r.stderr):
            lines = r.stderr.rstrip("\n").splitlines()
            errors = [ln for ln in lines if ln.startswith(PREFIX)]
            assert lines and lines[-1].startswith(PREFIX), f"last stderr line is no error line: {shown}"
            assert len(errors) == 1, f"{len(errors)} error lines: {shown}"
            # bad input is an anticipated error (EmbedqError: exit 2, PublishError: 3), never
            # the catch-all "(unexpected: ...)" line of exit 1, which any exception would pass
            assert r.exit_code in (2, 3) and "(unexpected:" not in errors[0], f"not an anticipated error: {shown}"
        for k, want in self.pristine.items():
            p = self.w[k]
            got = snapshot(p) if p.is_dir() else p.read_bytes()
            assert got == want, f"shared input {k} changed by {shown}"
        for n, p in self.copies.items():
            rule = may_write.get(n)
            after = snapshot(p) if p.is_dir() else {}
            if r.exit_code == 0 and rule == "exit0":
                continue
            if r.exit_code == 0 and rule == "keep":
                changed = {f for f, h in before[n].items() if after.get(f) != h}
                assert not changed, f"copy of {n}: {sorted(changed)} changed by {shown}"
                continue
            assert after == before[n], f"copy of {n} changed by a failed / read-only {shown}"
        return r


# --- value strategies ----------------------------------------------------------------------

HUGE = [0, -1, -64, 2**31, 2**63, 10**40, -10**40]
_NUM = st.one_of(st.integers(-3, 130), st.sampled_from(HUGE), st.integers()).map(str)
INTS = st.one_of(_NUM, _NUM, _NUM, st.sampled_from(["", "1.5", "abc", "٣", "0x20", " 8", "1e3"]))
FLOATS = st.one_of(st.floats().map(repr), st.floats().map(repr),
                   st.sampled_from(["nan", "inf", "-inf", "-0", "1e400", "0.01", "1e-300", "0.5"]),
                   st.sampled_from(["", "x", "1,5"]))
TEXT = st.one_of(st.text(CHARS, max_size=12),
                 st.sampled_from(["", "..", ".", "../..", "a/b", "-", "ü", "\u202e", " ", "org/name",
                                  "main", "../../etc/passwd", "a" * 300]))
SIZES = st.one_of(st.sampled_from(["32GiB", "24GB", "80G", "256KiB", "0", "-1GiB", "1e400GiB", "nanGiB",
                                   "infGiB", "1.5MiB", "262144", "0x10", "1 GiB", "GiB", "-0"]),
                  TEXT, INTS)


def choice(*valid: str):
    return st.one_of(st.sampled_from(valid), TEXT)


def bits():
    return st.one_of(st.sampled_from(["4", "8"]), INTS)


def argv_for(data, verb: list[str], positional, spec: list[tuple[str, object]], extra=()):
    """``verb``, its positional (dropped now and then), a random selection of ``spec``'s
    options (repeats possible) with random values, then ``extra``."""
    argv = list(verb)
    if positional is not None and data.draw(st.integers(0, 15), label="drop positional") > 0:
        argv.append(data.draw(positional, label="positional"))
    picks = data.draw(st.lists(st.integers(0, len(spec) - 1), max_size=min(len(spec), 7)), label="options")
    for i in picks:
        flag, val = spec[i]
        argv.append(flag)
        if val is not None:
            argv.append(data.draw(val, label=flag))
    if data.draw(st.integers(0, 30), label="unknown option") == 0:
        argv.append("--no-such-option")
    return argv + list(extra)


# --- the verbs -----------------------------------------------------------------------------

def quantize_spec(ex: Example):
    return [
        ("--bits", bits()), ("--group-size", INTS), ("--asym", None), ("--sym", None),
        ("--method", choice("rtn", "mse", "gptq")), ("--max-kld", FLOATS), ("--auto", None),
        ("--lm-head", None), ("--head-bits", bits()), ("--head-group-size", INTS),
        ("--targets", choice("model.embed_tokens.weight", "lm_head.weight",
                             "model.embed_tokens.weight,lm_head.weight", ",", "a,b,c")),
        ("--overlay-only", None), ("--format", choice("embedq", "compressed-tensors")),
        ("--force", None), ("--trust-config", None), ("--trust-tensors", None),
        ("--scale-dtype", choice("bfloat16", "float16", "float32")), ("--chunk-rows", INTS),
        ("--base-model", TEXT), ("--base-revision", TEXT),
        ("--eval", ex.path("text", "badjson", "empty", "missing", "config")),
        ("--json", None), ("-q", None),
    ]


@_fuzz(80)
@given(data=st.data())
def test_quantize_in_place(world, data):
    ex = Example(world)
    argv = argv_for(data, ["quantize"], ex.path("missing", "config", "empty", copies=("src", "inplace")),
                    quantize_spec(ex))
    ex.invoke(argv, {"src": "exit0", "inplace": "exit0"})


@_fuzz(60)
@given(data=st.data())
def test_quantize_output(world, data):
    ex = Example(world)
    model = str(ex.copy("src"))
    out = st.one_of(ex.path(),
                    st.sampled_from([model, model + "/sub", model + "/config.json", str(ex.dir)]))
    argv = argv_for(data, ["quantize"], st.just(model), quantize_spec(ex),
                    extra=["--output", data.draw(out, label="--output")])
    ex.invoke(argv, {"src": "keep"})


@_fuzz(40)
@given(data=st.data())
def test_inspect(world, data):
    ex = Example(world)
    model = st.one_of(ex.path("src", "inplace", "derived", "bundle", "gguf", "onnx", "text", "config",
                              "shard", "empty", "missing"), TEXT)
    ex.invoke(argv_for(data, ["inspect"], model, [("--revision", TEXT), ("--json", None)]))


@_fuzz(30)
@given(data=st.data())
def test_remove(world, data):
    ex = Example(world)
    model = ex.path("src", "derived", "bundle", "config", "empty", "missing", copies=("inplace", "src"))
    ex.invoke(argv_for(data, ["remove"], model, [("--json", None)]), {"inplace": "exit0"})


@_fuzz(30)
@given(data=st.data())
def test_verify(world, data):
    ex = Example(world)
    model = ex.path("src", "inplace", "derived", "bundle", "gguf", "config", "empty", "missing")
    ex.invoke(argv_for(data, ["verify"], model, [("--json", None)]))


ACCURACY = st.one_of(st.sampled_from(["0", "1", "2", "3", "4"]), INTS)
PROVIDERS = choice("cpu", "cuda", "webgpu", "dml")


@_fuzz(40)
@given(data=st.data())
def test_onnx_patch(world, data):
    ex = Example(world)
    spec = [("--overlay", ex.path("inplace", "bundle", "derived", "src", "empty", "missing", "config")),
            ("--external-data", None), ("--no-external-data", None), ("--accuracy-level", ACCURACY),
            ("--execution-provider", PROVIDERS), ("--max-tensor-bytes", SIZES),
            ("--target", choice("webgpu", "cpu")), ("--force", None), ("--json", None)]
    out = ex.path("onnx", "config")  # shared files that exist: refused without --force
    model = ex.path("onnx", "text", "gguf", "src", "empty", "missing")
    argv = argv_for(data, ["onnx", "patch"], model, spec)
    if data.draw(st.integers(0, 8), label="drop --output"):
        argv += ["--output", data.draw(out, label="--output")]
        if argv[-1] in (str(world[0]["onnx"]), str(world[0]["config"])):
            argv = [a for a in argv if a != "--force"]  # never replace a shared input
    if data.draw(st.integers(0, 8), label="drop --overlay") and "--overlay" not in argv:
        argv += ["--overlay", str(world[0]["bundle"])]
    ex.invoke(argv)


@_fuzz(30)
@given(data=st.data())
def test_onnx_export_invalid(world, data):
    """Only folders without an overlay (as MODEL and as --overlay): it fails before exporting."""
    ex = Example(world)
    no_overlay = ex.path("src", "empty", "missing", "config", "onnx")
    spec = [("--overlay", no_overlay), ("--dtype", choice("float32", "float16", "bfloat16")),
            ("--opset", INTS), ("--optimize", None), ("--no-optimize", None), ("--external-data", None),
            ("--no-external-data", None), ("--accuracy-level", ACCURACY), ("--max-tensor-bytes", SIZES),
            ("--target", choice("webgpu")), ("--force", None), ("--json", None)]
    argv = argv_for(data, ["onnx", "export"], no_overlay, spec)
    if data.draw(st.integers(0, 8), label="drop --output"):
        argv += ["--output", data.draw(ex.path(), label="--output")]
    ex.invoke(argv)


@_fuzz(40)
@given(data=st.data())
def test_gguf(world, data):
    ex = Example(world)
    spec = [("--overlay", ex.path("bundle", "inplace", "derived", "src", "empty", "missing", "config")),
            ("--force", None), ("--json", None)]
    argv = argv_for(data, ["gguf"], ex.path("gguf", "onnx", "text", "src", "empty", "missing"), spec)
    if data.draw(st.integers(0, 8), label="drop --output"):
        argv += ["--output", data.draw(ex.path(), label="--output")]
    if data.draw(st.integers(0, 8), label="drop --overlay") and "--overlay" not in argv:
        argv += ["--overlay", str(world[0]["bundle"])]
    ex.invoke(argv)


@_fuzz(40)
@given(data=st.data())
def test_apply(world, data):
    ex = Example(world)
    base = ex.path("config", "empty", "missing", copies=("src", "inplace"))
    spec = [("--overlay", ex.path("bundle", "inplace", "derived", "src", "empty", "missing", "config")),
            ("--force", None), ("--json", None)]
    argv = argv_for(data, ["apply"], base, spec)
    if data.draw(st.integers(0, 8), label="drop --overlay") and "--overlay" not in argv:
        argv += ["--overlay", str(world[0]["bundle"])]
    ex.invoke(argv, {"src": "exit0", "inplace": "exit0"})


@_fuzz(30)
@given(data=st.data())
def test_push_dry_run(world, data):
    ex = Example(world)
    folder = ex.path("derived", "bundle", "inplace", "src", "empty", "missing", "config")
    spec = [("--private", None), ("--revision", TEXT), ("--token", TEXT), ("--message", TEXT),
            ("-m", TEXT), ("--no-card-update", None), ("--include", choice("*.txt", "**", "../*", "*")),
            ("--json", None)]
    repo = data.draw(choice("user/name", "name", "a/b/c", "-bad/x", "user/" + "n" * 120), label="--repo-id")
    ex.invoke(argv_for(data, ["push"], folder, spec, extra=["--dry-run", "--repo-id", repo]))


@_fuzz(30)
@given(data=st.data())
def test_card(world, data):
    ex = Example(world)
    folder = ex.path("empty", "missing", "config", copies=("derived", "bundle", "src"))
    spec = [("--eval", ex.path("text", "badjson", "empty", "missing", "config")), ("--base-model", TEXT),
            ("--base-revision", TEXT), ("--repo-id", choice("user/name", "x")), ("--license", TEXT),
            ("--stdout", None)]
    argv = argv_for(data, ["card"], folder, spec)
    rule = None if "--stdout" in argv else "exit0"
    ex.invoke(argv, {"derived": rule, "bundle": rule, "src": rule})


@_fuzz(30)
@given(data=st.data())
def test_eval(world, data):
    ex = Example(world)
    model = ex.path("inplace", "derived", "bundle", "src", "empty", "missing", "config")
    spec = [("--text", ex.path("text", "badjson", "empty", "missing", "shard")), ("--contexts", INTS),
            ("--length", INTS), ("--reference", ex.path("src", "inplace", "empty", "missing", "config")),
            ("--dtype", choice("float32", "bfloat16", "float16")), ("--float-head", None), ("--seed", INTS),
            ("--floor", None), ("--no-floor", None), ("--device", choice("cpu", "cuda", "cuda:1", "meta")),
            ("--json", None), ("-q", None)]
    ex.invoke(argv_for(data, ["eval"], model, spec))


@_fuzz(60)
@given(data=st.data())
def test_plan(world, data):
    ex = Example(world)
    model = st.one_of(ex.path("src", "inplace", "derived", "bundle", "empty", "missing", "config", "gguf"),
                      TEXT)
    spec = [("--gpu-mem", SIZES), ("--kv-dtype", choice("fp8", "bf16", "fp16", "auto")),
            ("--max-model-len", INTS), ("--gpu-memory-utilization", FLOATS), ("--reserve", SIZES),
            ("--max-num-batched-tokens", INTS), ("--max-num-seqs", INTS), ("--weights-gib", SIZES),
            ("--revision", TEXT), ("--block-size", INTS), ("--prefix-caching", None),
            ("--no-prefix-caching", None), ("--async-scheduling", None), ("--no-async-scheduling", None),
            ("--gdn-checkpoints", None),
            ("--mamba-ssm-cache-dtype", choice("auto", "bfloat16", "float16", "float32")),
            ("--bits", bits()), ("--group-size", INTS), ("--asym", None), ("--sym", None), ("--json", None)]
    ex.invoke(argv_for(data, ["plan"], model, spec))


def test_outcomes():
    """The fuzz reached past click: every verb fuzzed above had examples that ran the verb."""
    for verb, seen in OUTCOMES.items():
        ran = sum(n for k, n in seen.items() if k != "usage")
        assert ran >= sum(seen.values()) // 4, f"{verb}: {dict(seen)}"
