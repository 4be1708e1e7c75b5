"""``embedq plan org/model``: config.json and safetensors headers from the local fake Hub
(tests/fakehub.py), which logs every byte range it sends, so the tests can check that no
tensor data past the header region ever left the server."""

from __future__ import annotations

import json
import struct

import pytest
from typer.testing import CliRunner

import embedq
from embedq.cli import app
from embedq.capacity.plan import PlanError
from fakehub import FakeHub, point_at  # tests/fakehub.py

HEADER_READ = 100_000  # huggingface_hub reads bytes 0-100000 of each shard first


@pytest.fixture
def hub(monkeypatch, tmp_path):
    with FakeHub() as h:
        yield point_at(h, monkeypatch, tmp_path)


def _safetensors(tensors: dict[str, tuple[tuple[int, ...], str]], fill: bytes = b"\xee") -> bytes:
    """A safetensors file whose data region is ``fill`` bytes (recognisable if it leaks)."""
    isz = {"BF16": 2, "F32": 4}
    header, off = {}, 0
    for name, (shape, dt) in tensors.items():
        n = isz[dt]
        for d in shape:
            n *= d
        header[name] = {"dtype": dt, "shape": list(shape), "data_offsets": [off, off + n]}
        off += n
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    return struct.pack("<Q", len(h)) + h + fill * off


QWEN = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "num_hidden_layers": 4,
        "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 64, "hidden_size": 512,
        "intermediate_size": 1024, "vocab_size": 2048, "max_position_embeddings": 4096,
        "tie_word_embeddings": True, "dtype": "bfloat16"}


def _repo(hub, repo="org/tiny", sharded=False):
    emb = ("model.embed_tokens.weight", ((2048, 512), "BF16"))
    mlp = ("model.layers.0.mlp.down_proj.weight", ((512, 1024), "BF16"))
    files = {"config.json": json.dumps(QWEN).encode()}
    if sharded:
        files["model-00001-of-00002.safetensors"] = _safetensors(dict([emb]))
        files["model-00002-of-00002.safetensors"] = _safetensors(dict([mlp]))
        files["model.safetensors.index.json"] = json.dumps({"metadata": {}, "weight_map": {
            emb[0]: "model-00001-of-00002.safetensors", mlp[0]: "model-00002-of-00002.safetensors"}}).encode()
    else:
        files["model.safetensors"] = _safetensors(dict([emb, mlp]))
    hub.files[repo] = files
    return repo


W_FLOAT = 2048 * 512 * 2 + 512 * 1024 * 2


def _no_weight_bytes(hub):
    """Only header reads of .safetensors files: ranged, within the first 100 kB."""
    st = [s for s in hub.sent if s[1].endswith(".safetensors")]
    assert st, "the safetensors headers were not read"
    for _repo, name, first, last in st:
        size = len(next(f for r in hub.files.values() for n, f in r.items() if n == name))
        assert last <= HEADER_READ < size, (name, first, last, size)
    assert all(rng for m, n, rng in hub.reads if n.endswith(".safetensors") and m == "GET")


@pytest.mark.parametrize("sharded", [False, True])
def test_plan_hub_id_reads_config_and_headers_only(hub, sharded, tmp_path):
    repo = _repo(hub, sharded=sharded)
    r = embedq.plan(repo, "2GiB", kv_dtype="bf16", max_model_len=4096, reserve="0.5GiB")
    assert r.path == repo and r.before.weights == W_FLOAT
    overlay = 2048 * 512 + 2048 * 8 * 2 + 16  # int8 g64: 8 bf16 scales per row
    assert r.after.weights == 512 * 1024 * 2 + overlay
    assert r.overlay_source.startswith("estimate")
    _no_weight_bytes(hub)
    # the same plan from a local copy of the repo
    local = tmp_path / "local"
    local.mkdir()
    for n, data in hub.files[repo].items():
        (local / n).write_bytes(data)
    lr = embedq.plan(local, "2GiB", kv_dtype="bf16", max_model_len=4096, reserve="0.5GiB")
    assert (lr.before.kv_tokens, lr.after.kv_tokens) == (r.before.kv_tokens, r.after.kv_tokens)


def test_plan_hub_id_with_weights_gib_reads_config_only(hub):
    repo = _repo(hub)
    r = embedq.plan(repo, "2GiB", kv_dtype="bf16", max_model_len=4096, reserve="0.5GiB", weights_gib="1GiB")
    assert r.before.weights == 1 << 30
    assert {n for m, n, rng in hub.reads} == {"config.json"}
    assert not [s for s in hub.sent if s[1].endswith(".safetensors")]


def test_plan_hub_errors_are_one_line(hub):
    with pytest.raises(PlanError, match=r"^org/missing: no such directory or Hub model"):
        embedq.plan("org/missing", "2GiB")
    hub.files["org/noweights"] = {"config.json": json.dumps(QWEN).encode()}
    with pytest.raises(PlanError, match=r"org/noweights: no model.safetensors.*--weights-gib"):
        embedq.plan("org/noweights", "2GiB")
    res = CliRunner().invoke(app, ["plan", "org/missing"])
    assert res.exit_code == 2 and res.output.startswith("embedq: error: org/missing: ")
    assert len(res.output.strip().splitlines()) == 1


def test_cli_plan_hub_json(hub):
    repo = _repo(hub)
    res = CliRunner().invoke(app, ["plan", repo, "--gpu-mem", "2GiB", "--kv-dtype", "fp8",
                                   "--max-model-len", "4096", "--reserve", "0.5GiB", "--json"])
    assert res.exit_code == 0, res.output
    d = json.loads(res.stdout)
    assert d["vllm"]["version"] == "0.33.0" and d["before"]["weights"] == W_FLOAT
    _no_weight_bytes(hub)
