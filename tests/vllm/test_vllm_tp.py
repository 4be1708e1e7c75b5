"""Tensor parallelism 2 on CPU (gloo, two processes): each rank loads only its vocab
shard of the packed table, scales and zero points and prepares only that shard for
serving; all-reduced embeddings and gathered logits equal the single-process result."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

from _harness import assert_logits_match, free_port, load_model, magnitude, vocab_layers

import embedq
import _ev as ev

HERE = Path(__file__).resolve().parent


def test_tp2_matches_single_process(builder, tmp_path):
    d = builder.quantized("qwen2", "q4asym_g16", bits=4, group_size=16, symmetric=False)
    port = free_port()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]))
    procs = [subprocess.Popen([sys.executable, str(HERE / "_tp_worker.py"), str(d), str(r), "2",
                               str(port), str(tmp_path / f"rank{r}.pt")], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(2)]
    logs = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=1800)  # a hang guard, not a timing check (loaded machines)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        logs.append(out)
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log[-4000:]
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]

    ov = embedq.load_overlay(d)
    table = ov.tables["model.embed_tokens"]
    vocab = table.rows
    full_zp = ev.pack_zero_point_rows(table.zero_point, table.bits, vocab)
    ref = table.dequantize(torch.bfloat16)
    for res in results:
        assert res["tp_size"] == 2 and res["head_shares"]
        start, end = res["shard"]
        # after loading, the on-disk-layout parameters are released ...
        assert all(p.numel() == 0 for n, p in res["params"].items() if n != "weight_shape")
        # ... and the prepared table holds this rank's rows only, padding after them
        per_part = res["prepared_rows"]
        assert per_part == 256  # 500 padded to 512, halved
        n = end - start
        served = res["table"]
        assert served.shape == (per_part, table.cols)
        torch.testing.assert_close(served[:n], ref[start:end], rtol=0, atol=0)
        assert not served[n:].any()
        # memory: half the table (plus padding), quantized (codes + int8 zero points + scales)
        codes = per_part * table.cols * table.bits // 8
        assert codes < res["prepared_bytes"] <= codes + per_part * (table.cols // 16) * 3
        # 4-bit groups of 16: the native kernel takes them; torch's int4 op does not
        from embedq.kernels import dispatch
        assert res["prepared_kind"] == ("native" if dispatch.layout_unavailable("native") is None else "chunked")
    assert results[0]["shard"] == (0, 256) and results[1]["shard"] == (256, vocab)
    assert full_zp.shape[0] * 32 // table.bits >= vocab

    # single-process result of the same checkpoint
    _, model = load_model(d)
    embed, _ = vocab_layers(model)
    ids = torch.arange(0, vocab).flip(0)
    single_emb = embed(ids)
    single_logits = model.compute_logits(results[0]["h"])
    for res in results:
        torch.testing.assert_close(res["embeddings"], single_emb, rtol=0, atol=0)
        torch.testing.assert_close(res["embeddings"], ref[ids], rtol=0, atol=0)
    mag = magnitude(d, "model.embed_tokens")
    logits = [r["logits"] for r in results if r["logits"] is not None]
    assert logits, "no rank returned gathered logits"
    for lg in logits:
        assert lg.shape == single_logits.shape == (5, vocab)
        # the same kernel over each rank's rows: the derived bound, not a loose 1e-2
        assert_logits_match(lg, single_logits, results[0]["h"], mag)
