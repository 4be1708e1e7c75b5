"""Guarantees of docs/usage.md ("What a run guarantees") and docs/security.md that no other
test would catch breaking. Each test names the claim it holds the code to.

- streaming: memory is O(chunk), not O(table); only shards holding targets are opened;
- one-line errors: an unanticipated exception is one line, exit 1, ending
  "(unexpected: set EMBEDQ_DEBUG=1 ...)"; MemoryError says so; EMBEDQ_DEBUG=1 shows it;
  line breaks in a path are escaped;
- security.md 0: no unpickling, no trust_remote_code (pinned on the source);
- security.md 2: NaN/inf scales are refused by load_overlay and load, not only verify;
- security.md 3: ``apply`` replaces only the base's own embedding/head tables;
- security.md 9: ``verify`` holds each group to half a step (int8, symmetric, rtn), and its
  bound is the documented one for every scheme, scale dtype and method;
- security.md 10: ``push`` never uploads through a symlinked folder;
- security.md 11: the lock file is emptied on release;
- security.md 16 / usage.md Safety: a live pid's staging files are kept, a dead one's removed
  and announced on one line; every in-place commit is stage beside, fsync, rename, fsync the folder.
"""

from __future__ import annotations

import copy
import ctypes
import json
import os
import shutil
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

import embedq
from embedq.cli import app
from embedq.cli.common import UNEXPECTED
from security.secutil import read_qconfig as qconfig, tamper_overlay as rewrite_overlay, tree, write_qconfig

REPO = Path(__file__).resolve().parents[1]


# --- helpers -------------------------------------------------------------------------------

def cli(*args, **env):
    """``embedq ARGS`` in-process: (exit code, stdout + stderr, exception)."""
    res = CliRunner().invoke(app, [str(a) for a in args], env=env or None)
    out = res.stdout + (res.stderr if res.stderr_bytes is not None else "")
    return res.exit_code, out, res.exception


def error_line(out: str) -> str:
    errs = [ln for ln in out.splitlines() if ln.startswith("embedq: error:")]
    assert len(errs) == 1, out
    assert "Traceback" not in out, out
    return errs[0]


# --- usage.md, Streaming: "Only shards holding targets are opened." ---------------------------

IN_OPEN = 0x20


def _inotify_opens(folder: Path, fn) -> list[str]:
    """Names of the files in ``folder`` opened (by anyone, native code included) during ``fn()``."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
    if fd < 0 or libc.inotify_add_watch(fd, str(folder).encode(), IN_OPEN) < 0:
        pytest.skip(f"inotify unavailable: {os.strerror(ctypes.get_errno())}")
    try:
        fn()
        buf = b""
        while True:
            try:
                chunk = os.read(fd, 1 << 16)
            except BlockingIOError:
                break
            if not chunk:
                break
            buf += chunk
    finally:
        os.close(fd)
    names, i = [], 0
    while i < len(buf):
        _, _, _, n = struct.unpack_from("iIII", buf, i)
        names.append(buf[i + 16:i + 16 + n].rstrip(b"\0").decode())
        i += 16 + n
    return names


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="inotify is Linux's")
@pytest.mark.parametrize("lm_head", [False, True])
def test_streaming_opens_only_the_shards_holding_targets(model_factory, lm_head):
    model = model_factory("llama_untied_sharded")
    wm = json.loads((model / "model.safetensors.index.json").read_text())["weight_map"]
    holding = {wm["model.embed_tokens.weight"], wm["lm_head.weight"]}
    others = set(wm.values()) - holding
    assert others, "the fixture must have shards without a target"
    opened = set(_inotify_opens(model, lambda: embedq.quantize(model, 8, lm_head=lm_head, progress=False)))
    assert wm["model.embed_tokens.weight"] in opened  # the watch works
    assert not opened & others, f"shards without a target were opened: {sorted(opened & others)}"
    assert qconfig(model)["modules"]  # the quantize happened


# --- usage.md, Streaming: "memory is O(chunk), not O(table)" ----------------------------------

_MEASURE = textwrap.dedent("""
    import sys
    import embedq, embedq.jobs.quantize, embedq.jobs.overlay, embedq.jobs.targets  # imports done

    def kib(key):
        for line in open("/proc/self/status"):
            if line.startswith(key):
                return int(line.split()[1])

    # A first run pays what any quantize pays once per process (torch's lazy set-up, the
    # kernel's library, thread pools, allocator arenas: ~7-9 MiB on an idle Zen 4);
    # the second run's growth is what streaming the table costs.
    embedq.quantize(sys.argv[1], int(sys.argv[2]), progress=False)
    embedq.remove(sys.argv[1])
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak (VmHWM) to the current resident size
    start = kib("VmRSS:")
    embedq.quantize(sys.argv[1], int(sys.argv[2]), progress=False)
    print("PEAK_GROWTH_KIB", kib("VmHWM:") - start)
""")


def _big_table_checkpoint(path: Path, rows: int, cols: int) -> int:
    """A tied Qwen2 checkpoint whose embedding is ``rows x cols`` bf16 (the rest tiny);
    returns the table's bytes."""
    import transformers as tf
    cfg = tf.Qwen2Config(vocab_size=rows, hidden_size=cols, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in tf.Qwen2ForCausalLM(cfg).state_dict().items()}
    g = torch.Generator().manual_seed(0)
    tensors = {k: (torch.randn(s, generator=g) * 0.02).to(torch.bfloat16)
               for k, s in shapes.items() if k != "lm_head.weight"}
    path.mkdir(parents=True)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    cfg.save_pretrained(path)
    return tensors["model.embed_tokens.weight"].nbytes


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux's VmHWM reset")
def test_streaming_peak_memory_is_a_chunk_not_the_table(tmp_path):
    """A 128 MiB table quantizes with the process' peak resident memory growing by a small
    fraction of it, once the process has quantized before (without the MADV_DONTNEED
    release it grows by the whole mapped table, ~140 MiB)."""
    model = tmp_path / "big"
    table = _big_table_checkpoint(model, 65536, 1024)
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    for bits in (8, 4):
        r = subprocess.run([sys.executable, "-c", _MEASURE, str(model), str(bits)], env=env,
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-3000:]
        growth = int(r.stdout.split("PEAK_GROWTH_KIB")[1]) * 1024
        assert growth < table / 3, (f"{bits}-bit: peak resident memory grew by {growth >> 20} MiB "
                                    f"for a {table >> 20} MiB table")
        embedq.remove(model)  # the next scheme starts from the float checkpoint
    shutil.rmtree(model)  # 134 MB: not kept among pytest's last three runs


# --- usage.md, Bad input: an error embedq did not anticipate ----------------------------------

@pytest.mark.parametrize("exc,words,code", [
    (RuntimeError("boom in a library\nsecond line"), ["RuntimeError: boom in a library", UNEXPECTED], 1),
    (MemoryError(), ["out of memory (MemoryError); free memory or use a machine with more"], 1),
])
def test_unanticipated_error_is_one_line_exit_1_source_unchanged(model_factory, monkeypatch, exc, words, code):
    import embedq.quant.stream as stream

    def explode(self):
        raise exc
    model = model_factory("qwen2_tied")
    before = tree(model)
    monkeypatch.delenv("EMBEDQ_DEBUG", raising=False)
    monkeypatch.setattr(stream.Pipeline, "run", explode)
    rc, out, e = cli("quantize", model, "-q")
    assert rc == code and (e is None or isinstance(e, SystemExit)), (rc, out, e)
    line = error_line(out)
    assert line.startswith(f"embedq: error: {model}: "), line  # names the folder
    for w in words:
        assert w in line, line
    assert "second line" not in out
    assert tree(model) == before  # the in-place commit was undone


def test_embedq_debug_shows_the_traceback(model_factory):
    """EMBEDQ_DEBUG=1 lets the unanticipated exception out (a real process prints its
    traceback); EmbedqErrors stay one line."""
    model = model_factory("qwen2_tied")
    prog = textwrap.dedent("""
        import sys
        import embedq.quant.stream as s
        def explode(self):
            raise RuntimeError("boom in a library")
        s.Pipeline.run = explode
        from embedq.cli.app import main
        sys.argv = ["embedq", "quantize", sys.argv[1], "-q"]
        main()
    """)
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    for debug, want_tb in (("1", True), ("0", False)):
        r = subprocess.run([sys.executable, "-c", prog, str(model)], env={**env, "EMBEDQ_DEBUG": debug},
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 1, r.stderr[-3000:]
        assert ("Traceback" in r.stderr) == want_tb, r.stderr[-3000:]
        assert "RuntimeError: boom in a library" in r.stderr
        if not want_tb:
            assert r.stderr.strip().count("\n") == 0 and UNEXPECTED in r.stderr, r.stderr


# --- security.md 3: apply replaces only the base's own tables --------------------------------

def test_apply_refuses_a_module_that_is_not_one_of_the_bases_tables(model_factory, tmp_path):
    """A bundle carrying, besides the genuine embedding, a second embedding-named module whose
    source the base really has (same bytes, so its digest matches) but which is none of the
    base's embeddings/heads/MTP tables: refused, the base unchanged."""
    src = model_factory("qwen2_tied")
    bundle = tmp_path / "bundle"
    embedq.quantize(src, 8, output=bundle, overlay_only=True, progress=False)
    extra = "model.extra.embed_tokens"

    def add(t):
        for s in ("weight_packed", "weight_scale", "weight_shape"):
            t[f"{extra}.{s}"] = t[f"model.embed_tokens.{s}"].clone()
    rewrite_overlay(bundle, add)
    cfg = qconfig(bundle)
    e = copy.deepcopy(cfg["modules"]["model.embed_tokens"])
    e["source"]["tensor"] = extra + ".weight"
    e["checksums"] = {k.replace("model.embed_tokens", extra): v for k, v in e["checksums"].items()}
    cfg["modules"][extra] = e
    cfg.pop("onnx", None)
    write_qconfig(bundle, cfg)

    base = model_factory("qwen2_tied")
    f = base / "model.safetensors"
    with safe_open(str(f), framework="pt") as h:
        meta = h.metadata()
    t = load_file(str(f))
    t[extra + ".weight"] = t["model.embed_tokens.weight"].clone()
    f.unlink()
    save_file(t, str(f), metadata=meta)
    before = tree(base)
    rc, out, _ = cli("apply", base, "--overlay", bundle)
    assert rc == 2, out
    line = error_line(out)
    assert f"replaces {extra}.weight, which is not an embedding or head of" in line, line
    assert tree(base) == before


# --- security.md 9: verify's bound is half a step (int8, symmetric, rtn) ----------------------

def test_verify_fails_a_code_one_step_off(model_factory):
    """One code moved by one level, away from where it rounded from, at the element whose
    rounding was nearly exact: an error of about one step, over the half step (plus scale
    rounding) verify allows. A bound loosened to a whole step would let it through."""
    from embedq.format.codec import pack_int32, unpack_int32
    model = model_factory("qwen2_tied")
    embedq.quantize(model, 8, progress=False)  # int8, g64 = per row of 64 here, symmetric
    assert cli("verify", model)[0] == 0
    x = load_file(str(model / "model.safetensors"))["model.embed_tokens.weight"].float()
    k = "model.embed_tokens"
    ov = load_file(str(model / "embedq.safetensors"))
    codes = unpack_int32(ov[k + ".weight_packed"], 8, x.shape[1]).float()
    g = x.shape[1] // ov[k + ".weight_scale"].shape[1]
    scale = ov[k + ".weight_scale"].float().repeat_interleave(g, dim=1)
    r = x / scale - codes  # rounding residual, in steps
    r[(codes.abs() > 120) | (x == 0)] = 9  # room to move; a real value
    i = int(r.abs().argmin())
    row, col = divmod(i, x.shape[1])
    assert abs(float(r[row, col])) < 0.05
    step = -1 if float(r[row, col]) > 0 else 1  # away from the value: error 1 + |r| steps

    def shift(t):
        c = unpack_int32(t[k + ".weight_packed"], 8, x.shape[1])
        c[row, col] += step
        t[k + ".weight_packed"] = pack_int32(c, 8)
    rewrite_overlay(model, shift)
    rc, out, _ = cli("verify", model)
    assert rc == 2, out
    assert k in error_line(out)


@pytest.mark.parametrize("bits,symmetric,method,scale_dtype", [
    (8, True, "rtn", "bfloat16"), (8, True, "rtn", "float16"), (8, True, "rtn", "float32"),
    (4, True, "rtn", "bfloat16"), (8, False, "rtn", "bfloat16"), (4, False, "rtn", "float16"),
    (8, True, "mse", "bfloat16"), (4, False, "mse", "bfloat16"), (8, True, "gptq", "bfloat16"),
    (4, True, "gptq", "float32"),
])
def test_verify_error_bound_is_the_documented_one(bits, symmetric, method, scale_dtype):
    """security.md 9, number by number: half a step (a whole step asymmetric and symmetric
    4-bit), a step being amax/qmax (range/(2^b-1) asymmetric, amax/8 symmetric 4-bit), plus the
    scale's rounding (a unit or two of its dtype, at least its smallest value); mse +amax/2,
    gptq +2*amax. An oracle from the table's words, not from verify.py."""
    from embedq.format.config import ModuleEntry, SourceRef
    from embedq.format.scheme import Scheme
    from embedq.jobs.verify import error_bound
    eps = {"bfloat16": 2.0 ** -7, "float16": 2.0 ** -10, "float32": 2.0 ** -23}[scale_dtype]
    tiny = {"bfloat16": 2.0 ** -133, "float16": 2.0 ** -24, "float32": 2.0 ** -149}[scale_dtype]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 64, generator=g, dtype=torch.float64) * 0.02
    x[1] += 0.05  # all positive: the asymmetric range starts at 0
    x[2] = 0  # a zero group: only the smallest value is left
    entry = ModuleEntry("model.embed_tokens", Scheme(bits=bits, symmetric=symmetric, group_size=32, method=method,
                                                    scale_dtype=scale_dtype),
                        "embedding", (6, 64), SourceRef("model.embed_tokens.weight", None, None))
    got = error_bound(x.float(), entry).double()  # [rows, groups]
    xg = x.reshape(6, 2, 32)
    amax = xg.abs().amax(-1)
    if symmetric:
        step = amax / (8 if bits == 4 else 127)
    else:
        step = (xg.amax(-1).clamp(min=0) - xg.amin(-1).clamp(max=0)) / ((1 << bits) - 1)
    half = 1.0 if (bits == 4 or not symmetric) else 0.5
    extra = {"rtn": 0.0, "mse": 0.5, "gptq": 2.0}[method] * amax
    base = got - extra
    assert bool((base >= half * step * (1 + eps / 2) + half * tiny * 0.99).all()), (base, half * step)
    assert bool((base <= half * step * (1 + 4 * eps) + tiny + amax * 2.0 ** -18 + 1e-29).all()), (base, half * step)
    assert bool((got[2] > 0).all())


# --- security.md 10: push never uploads through a symlinked folder -----------------------------

def test_push_skips_a_symlinked_folder_even_when_included(model_factory, tmp_path):
    out = tmp_path / "derived"
    embedq.quantize(model_factory("qwen2_tied"), 8, output=out, progress=False)
    elsewhere = tmp_path / "other-model"
    elsewhere.mkdir()
    (elsewhere / "model.safetensors").write_bytes(b"someone else's weights")
    (elsewhere / "notes.txt").write_text("private")
    (out / "extra").symlink_to(elsewhere, target_is_directory=True)
    res = embedq.push(out, "me/model", dry_run=True, include=["*.txt", "extra/*"])
    names = {p for p, _ in res.files}
    assert not any(n.startswith("extra") for n in names), names
    assert "extra/ (symlinked folder)" in res.skipped, res.skipped
    assert "model.safetensors" in names  # the folder's own weights still go


# --- security.md 11: the lock file is emptied on release ----------------------------------------

def test_lock_file_is_emptied_on_release(model_factory):
    model = model_factory("qwen2_tied")
    embedq.quantize(model, 8, progress=False)
    lock = model / ".embedq" / "lock"
    assert not lock.exists() or lock.read_bytes() == b"", lock.read_bytes()
    embedq.remove(model)
    assert not (model / ".embedq").exists()


# --- security.md 16 / usage.md Safety: a live pid's staging files are kept ----------------------

def test_staging_of_a_live_pid_is_kept_a_dead_ones_removed_and_announced(model_factory):
    model = model_factory("qwen2_tied")
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    try:
        mine = model / f".embedq.safetensors.embedq-partial-{live.pid}-0a1b2c3d"
        gone = model / f".embedq.safetensors.embedq-partial-{dead.pid}-0a1b2c3d"
        for p in (mine, gone):
            p.write_bytes(b"half an overlay")
        rc, out, e = cli("quantize", model, "-q")
        assert rc == 0, (out, e)
        assert mine.read_bytes() == b"half an overlay", "a live run's staging file was touched"
        assert not gone.exists()
        lines = [ln for ln in out.splitlines() if "leftover(s) of an interrupted run" in ln]
        assert len(lines) == 1 and gone.name in lines[0] and mine.name not in lines[0], out
        assert cli("verify", model)[0] == 0
    finally:
        live.kill()
        live.wait()


# --- security.md 16: every in-place commit is stage, fsync, rename, fsync the folder ------------

def _commits(monkeypatch, fn) -> list[tuple]:
    """The renames and fsyncs ``fn()`` makes, in order: ("replace", src, dst, src_is_link)
    and ("fsync", path)."""
    import embedq.format.staging  # noqa: F401  (its os is the one patched)
    events: list[tuple] = []
    real_replace, real_fsync = os.replace, os.fsync

    def replace(src, dst, *a, **k):
        events.append(("replace", Path(src), Path(dst), os.path.islink(src)))
        return real_replace(src, dst, *a, **k)

    def fsync(fd):
        events.append(("fsync", Path(os.readlink(f"/proc/self/fd/{fd}"))))
        return real_fsync(fd)
    monkeypatch.setattr(os, "replace", replace)
    monkeypatch.setattr(os, "fsync", fsync)
    try:
        fn()
    finally:
        monkeypatch.undo()
    return events


def _hold_to_the_staging_commit(events, folder: Path) -> int:
    """Each rename into ``folder`` (or its .embedq/): from ``.<name>.embedq-partial-<pid>-<token>``
    beside the destination, the staged file fsynced before it, the folder fsynced after it
    (before the next rename). Returns how many renames were checked."""
    import re
    n = 0
    for i, e in enumerate(events):
        if e[0] != "replace" or e[2].parent.resolve() not in (folder.resolve(), (folder / ".embedq").resolve()):
            continue
        _, src, dst, link = e
        n += 1
        assert src.parent == dst.parent, e
        assert re.fullmatch(rf"\.{re.escape(dst.name)}\.embedq-partial-{os.getpid()}-[0-9a-f]+", src.name), e
        if not link:
            assert ("fsync", src.resolve()) in events[:i], f"{src.name} renamed to {dst.name} unsynced"
        later = events[i + 1:]
        nxt = next((j for j, x in enumerate(later) if x[0] == "replace"), len(later))
        assert ("fsync", dst.parent.resolve()) in later[:nxt], f"{dst}: folder not fsynced after the rename"
    return n


def test_in_place_verbs_commit_through_the_staging_protocol(model_factory, tmp_path, monkeypatch):
    """quantize, apply and remove in place (and remove in a Hugging Face cache snapshot,
    whose config.json and index come back as links): every file they put in the model folder
    is staged beside it, fsynced, renamed, and the folder fsynced."""
    src = model_factory("llama_untied_sharded")
    bundle = tmp_path / "bundle"
    embedq.quantize(src, 8, output=bundle, overlay_only=True, progress=False)
    model = tmp_path / "m"
    shutil.copytree(src, model)
    for fn in (lambda: embedq.quantize(model, 8, progress=False), lambda: embedq.remove(model),
               lambda: embedq.apply(model, bundle), lambda: embedq.quantize(model, 4, force=True, progress=False),
               lambda: embedq.remove(model)):
        assert _hold_to_the_staging_commit(_commits(monkeypatch, fn), model) >= 2
    repo = tmp_path / "hub" / "models--me--m"
    snap = repo / "snapshots" / ("c" * 40)
    (repo / "blobs").mkdir(parents=True)
    snap.mkdir(parents=True)
    for f in src.iterdir():
        shutil.copy(f, repo / "blobs" / f.name)
        (snap / f.name).symlink_to(Path("../..") / "blobs" / f.name)
    embedq.quantize(snap, 8, progress=False)
    events = _commits(monkeypatch, lambda: embedq.remove(snap))
    assert sum(1 for e in events if e[0] == "replace" and e[3]) == 2  # config.json, the index: links
    assert _hold_to_the_staging_commit(events, snap) == 2
    assert (snap / "config.json").is_symlink() and (snap / "model.safetensors.index.json").is_symlink()


# --- usage.md, Bad input: "line breaks in a path are escaped" ---------------------------------

@pytest.mark.parametrize("brk", ["\n", "\r", "\u2028", "\x85"])
def test_line_breaks_in_a_path_are_escaped(model_factory, tmp_path, brk):
    missing = tmp_path / f"no{brk}such"
    rc, out, _ = cli("quantize", missing, "-q")
    assert rc == 2, out
    line = error_line(out)
    assert brk.encode("unicode_escape").decode() in line and brk not in line, repr(line)
    model = model_factory("qwen2_tied").rename(tmp_path / f"my{brk}model")  # an existing folder
    (model / "config.json").write_text("{")  # an error naming a file inside it
    rc, out, _ = cli("quantize", model, "-q")
    assert rc == 2 and len(out.strip().splitlines()) == 1, repr(out)
    assert brk.encode("unicode_escape").decode() in error_line(out), repr(out)


# --- security.md 0: no code execution from a checkpoint ---------------------------------------

def test_no_unpickling_and_no_remote_code_anywhere_in_embedq():
    """embedq never unpickles (torch.load, pickle) and never passes trust_remote_code: pinned
    on the source, so adding either fails here first."""
    bad = ("trust_remote_code", "torch.load(", "pickle", "weights_only", "from_pretrained_keras")
    hits = [f"{p.relative_to(REPO)}: {w}" for p in sorted((REPO / "embedq").rglob("*.py"))
            for w in bad if w in p.read_text()]
    assert not hits, hits


# --- security.md 2: NaN/inf scales refused by the loaders, not only by verify -------------------

@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_scales_are_refused_by_load_overlay_and_load(model_factory, value):
    from embedq.errors import OverlayError
    model = model_factory("qwen2_tied")
    embedq.quantize(model, 8, progress=False)

    def poison(t):
        t["model.embed_tokens.weight_scale"][5, 0] = value
    rewrite_overlay(model, poison)  # checksums updated: only the header check can catch it
    with pytest.raises(OverlayError, match="NaN or infinite scales"):
        embedq.load_overlay(model)
    with pytest.raises(OverlayError, match="NaN or infinite scales"):
        embedq.load(model)
