"""Chunked, pipelined quantization writes exactly the bytes of whole-tensor quantization."""

from __future__ import annotations

import hashlib
import itertools
import json
import threading
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import embedq
from embedq.quant import fused as kernels
from embedq.format.codec import pack_int32, pack_zero_points
from embedq.quant.rtn import quantize_rtn
from embedq.format.scheme import Scheme
from embedq.quant.stream import ErrorStats, MappedRows, Pipeline, quantize_pack_chunk
from .test_kernels import table

SCHEMES = [(b, g, s) for b, g, s in itertools.product((4, 8), (None, 32, 128), (True, False))]
ROWS, COLS = 1000, 256  # 1000 rows: the last chunk is always partial


@pytest.fixture(scope="module")
def raw_table(tmp_path_factory) -> tuple[Path, int, torch.Tensor]:
    """A bf16 table stored raw at an odd-ish offset inside a file (like a shard)."""
    x = table(ROWS, COLS, torch.bfloat16, seed=11)
    path = tmp_path_factory.mktemp("raw") / "t.bin"
    offset = 4096 + 136  # not page aligned
    with open(path, "wb") as f:
        f.write(b"\xab" * offset)
        f.write(x.view(torch.uint8).numpy().tobytes())
        f.write(b"\xcd" * 100)
    return path, offset, x


def run_pipeline(path, offset, scheme, chunk_rows, threads, compiled=False):
    packed = torch.empty((ROWS, COLS * scheme.bits // 32), dtype=torch.int32)
    scale = torch.empty((ROWS, scheme.groups(COLS)), dtype=torch.bfloat16)
    zp = torch.empty((ROWS, scheme.groups(COLS)), dtype=torch.int8)
    stats = ErrorStats()
    order = []

    def compute(r0, x):
        p, s, z, st = quantize_pack_chunk(x.clone(), scheme, torch.bfloat16, pad_rows=chunk_rows,
                                          compiled=compiled)
        if z is not None:
            zp[r0:r0 + x.shape[0]] = z
        stats.add(*st, x.numel())
        return p, s

    def write(r0, out):
        order.append(r0)
        packed[r0:r0 + out[0].shape[0]] = out[0]
        scale[r0:r0 + out[1].shape[0]] = out[1]

    with MappedRows(path, offset, (ROWS, COLS), torch.bfloat16) as src:
        digest = Pipeline(src, chunk_rows, compute, write, threads=threads).run()
    assert order == sorted(order)  # written in row order
    return packed, scale, None if scheme.symmetric else zp, digest, stats


@pytest.mark.parametrize("bits,group,sym", SCHEMES)
def test_chunked_equals_whole_tensor(raw_table, bits, group, sym):
    path, offset, x = raw_table
    scheme = Scheme.default(bits, sym, group if group else 0)
    q, s, zp = quantize_rtn(x, scheme, torch.bfloat16)
    whole = pack_int32(q, bits)
    digest = hashlib.sha256(x.view(torch.uint8).numpy()).hexdigest()
    for chunk_rows, threads in [(64, True), (128, False), (192, True), (320, True), (1024, False)]:
        p2, s2, zp2, d2, st = run_pipeline(path, offset, scheme, chunk_rows, threads)
        assert torch.equal(p2, whole), chunk_rows
        assert torch.equal(s2.view(torch.int16), s.view(torch.int16)), chunk_rows
        if not sym:
            assert torch.equal(pack_zero_points(zp2, bits), pack_zero_points(zp, bits))
        assert d2 == digest
        assert st.count == x.numel()


@pytest.mark.skipif(not kernels._have_compiler() or not kernels.compile_enabled(),
                    reason="no C++ compiler / compilation disabled")
@pytest.mark.parametrize("bits,group", [(8, None), (4, 32)])
def test_chunked_compiled_equals_whole_tensor(raw_table, bits, group):
    path, offset, x = raw_table
    scheme = Scheme.default(bits, True, group if group else 0)
    q, s, _ = quantize_rtn(x, scheme, torch.bfloat16)
    p2, s2, _, _, _ = run_pipeline(path, offset, scheme, 192, True, compiled=True)
    assert torch.equal(p2, pack_int32(q, bits))
    assert torch.equal(s2.view(torch.int16), s.view(torch.int16))


class _JoinSeen(threading.Thread):
    """A Thread whose join() is observable: the pipeline's stages are joined before run() raises."""
    joining = threading.Event()

    def join(self, timeout=None):
        _JoinSeen.joining.set()
        return super().join(timeout)


@pytest.mark.parametrize("where", ["compute", "write"])
def test_pipeline_errors_propagate_and_stop(raw_table, monkeypatch, where):
    """An error in any stage stops every stage before run() raises: chunks still queued
    are never written, and no write happens after run() raised (no timing involved: the
    first write waits until run() joins its threads, or, were they not joined, until the
    test has seen run() raise)."""
    import embedq.quant.stream as stream
    path, offset, _ = raw_table
    scheme = Scheme.default(8)
    before = threading.active_count()
    _JoinSeen.joining = threading.Event()
    monkeypatch.setattr(stream.threading, "Thread", _JoinSeen)
    writing, raised = threading.Event(), threading.Event()
    calls = []

    def compute(r0, x):
        if where == "compute" and r0 >= 128:
            writing.wait()  # the writer holds chunk 0 and chunk 64 is queued (depth 2)
            raise ValueError("boom")
        return quantize_pack_chunk(x, scheme, torch.bfloat16, compiled=False)[:2]

    def write(r0, out):
        if where == "compute" and r0 == 0:
            writing.set()
            while not (_JoinSeen.joining.is_set() or raised.is_set()):
                _JoinSeen.joining.wait(0.05)
        calls.append((r0, raised.is_set()))
        if where == "write" and r0 >= 128:
            raise OSError("disk full")

    with MappedRows(path, offset, (ROWS, COLS), torch.bfloat16) as src:
        with pytest.raises(ValueError if where == "compute" else OSError):
            Pipeline(src, 64, compute, write, threads=True).run()
        raised.set()
        for t in threading.enumerate():  # a stage left running (a bug) finishes before we look
            if t.name.startswith("embedq-"):
                t.join(30)
    assert not any(after for _, after in calls), calls  # nothing written after run() raised
    # the failing stage stopped the others: no chunk after the failure was written
    assert [r0 for r0, _ in calls] == ([0] if where == "compute" else [0, 64, 128])
    assert threading.active_count() == before  # every stage joined


def test_mapped_rows_refuses_truncated_file(tmp_path):
    p = tmp_path / "short.bin"
    p.write_bytes(b"\0" * 1000)
    with pytest.raises(OSError, match="truncated"):
        MappedRows(p, 8, (10, 64), torch.bfloat16)


# --- end to end: the overlay file does not depend on the chunk size -----------------

def _checkpoint(path: Path, rows: int, cols: int) -> Path:
    path.mkdir(parents=True)
    emb = table(rows, cols, torch.bfloat16, seed=5)
    head = table(rows, cols, torch.bfloat16, seed=6)
    save_file({"model.embed_tokens.weight": emb, "lm_head.weight": head,
               "model.norm.weight": torch.ones(cols, dtype=torch.bfloat16)},
              str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps({
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": rows,
        "hidden_size": cols, "intermediate_size": 64, "num_hidden_layers": 1,
        "num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": False}))
    return path


@pytest.mark.parametrize("bits,group,sym", [(8, None, True), (8, 128, False), (4, 32, True), (4, None, False)])
def test_overlay_bytes_independent_of_chunk_rows(tmp_path, monkeypatch, bits, group, sym):
    ck = _checkpoint(tmp_path / "m", 700, 256)
    digests = set()
    configs = set()
    for chunk_rows, compile_min in [(64, None), (192, None), (640, None), (None, None), (128, "0")]:
        if compile_min is not None:
            if not kernels._have_compiler():
                continue
            monkeypatch.setenv("EMBEDQ_COMPILE_MIN_BYTES", compile_min)
        embedq.quantize(ck, bits, group_size=group if group else 0, symmetric=sym, lm_head=True,
                        chunk_rows=chunk_rows, force=True, progress=False)
        digests.add(hashlib.sha256((ck / "embedq.safetensors").read_bytes()).hexdigest())
        configs.add((ck / "quantization_config.json").read_text())
        monkeypatch.delenv("EMBEDQ_COMPILE_MIN_BYTES", raising=False)
    assert len(digests) == 1 and len(configs) == 1
    # and the whole-tensor reference agrees with what is on disk
    scheme = Scheme.default(bits, sym, group if group else 0)
    with safe_open(str(ck / "model.safetensors"), "pt") as f:
        x = f.get_tensor("model.embed_tokens.weight")
    q, s, zp = quantize_rtn(x, scheme, torch.bfloat16)
    with safe_open(str(ck / "embedq.safetensors"), "pt") as f:
        assert torch.equal(f.get_tensor("model.embed_tokens.weight_packed"), pack_int32(q, bits))
        assert torch.equal(f.get_tensor("model.embed_tokens.weight_scale").view(torch.int16), s.view(torch.int16))
        if not sym:
            assert torch.equal(f.get_tensor("model.embed_tokens.weight_zero_point"), pack_zero_points(zp, bits))
    assert embedq.verify(ck).modules
