"""``embedq plan org/model``: config.json and safetensors headers from a local fake Hub.

The fake serves what huggingface_hub 2.4's ``hf_hub_download`` and
``get_safetensors_metadata`` call (read from its file_download.py / hf_api.py):

* ``HEAD /{repo}/resolve/{rev}/{file}`` -> X-Repo-Commit, ETag, Content-Length (404 +
  X-Error-Code EntryNotFound / RepoNotFound)
* ``GET /{repo}/resolve/{rev}/{file}`` -> the bytes, honouring ``Range: bytes=a-b``
  (206) as the safetensors header read does (first 100 kB, then the rest of the header)
* ``GET /api/models/{repo}/revision/{rev}`` -> id, sha, siblings

Every byte range it sends is logged, so the tests can check that no tensor data past
the header region ever left the server.
"""

from __future__ import annotations

import hashlib
import json
import re
import struct
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from typer.testing import CliRunner

import embedq
from embedq.cli import app
from embedq.capacity.plan import PlanError

SHA = "a" * 40
HEADER_READ = 100_000  # huggingface_hub reads bytes 0-100000 of each shard first


class ReadHub:
    """A read-only fake Hub: ``repos[repo_id][filename] = bytes``."""

    def __init__(self):
        self.repos: dict[str, dict[str, bytes]] = {}
        self.sent: list[tuple[str, str, int, int]] = []  # (method, file, first byte, last byte)
        self.log: list[tuple[str, str, str | None]] = []
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._server.shutdown()
        self._server.server_close()


def _handler(hub: ReadHub):
    class H(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *a):
            pass

        def _json(self, code, obj, headers=None):
            data = json.dumps(obj).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            for k, v in (headers or {}).items():
                self.send_header(k, v)
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(data)

        def _file(self, head: bool):
            m = re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", self.path.split("?")[0])
            if not m:
                return self._json(404, {"error": "no route"})
            repo, _rev, name = m.groups()
            if repo not in hub.repos:
                return self._json(404, {"error": "Repository not found"}, {"X-Error-Code": "RepoNotFound"})
            data = hub.repos[repo].get(name)
            if data is None:
                return self._json(404, {"error": "Entry not found"}, {"X-Error-Code": "EntryNotFound"})
            rng = self.headers.get("Range")
            hub.log.append((self.command, name, rng))
            first, last, code = 0, len(data) - 1, 200
            if rng:
                a, b = re.fullmatch(r"bytes=(\d+)-(\d*)", rng.strip()).groups()
                first, last, code = int(a), min(int(b) if b else len(data) - 1, len(data) - 1), 206
            body = data[first:last + 1]
            self.send_response(code)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("X-Repo-Commit", SHA)
            self.send_header("ETag", '"' + hashlib.sha256(data).hexdigest() + '"')
            self.send_header("Accept-Ranges", "bytes")
            if code == 206:
                self.send_header("Content-Range", f"bytes {first}-{last}/{len(data)}")
            self.end_headers()
            if not head:
                hub.sent.append((self.command, name, first, last))
                self.wfile.write(body)

        def do_HEAD(self):  # noqa: N802
            self._file(head=True)

        def do_GET(self):  # noqa: N802
            m = re.fullmatch(r"/api/models/([^/]+/[^/]+)/revision/([^/?]+).*", self.path)
            if m:
                repo = m.group(1)
                if repo not in hub.repos:
                    return self._json(404, {"error": "Repository not found"}, {"X-Error-Code": "RepoNotFound"})
                return self._json(200, {"id": repo, "sha": SHA,
                                        "siblings": [{"rfilename": f} for f in sorted(hub.repos[repo])]})
            self._file(head=False)

    return H


@pytest.fixture
def hub(monkeypatch, tmp_path):
    import time
    import types

    import huggingface_hub.utils._http as hf_http
    from huggingface_hub import constants
    with ReadHub() as h:
        # no backoff sleeps when a request fails on purpose
        fast = types.SimpleNamespace(**{k: getattr(time, k) for k in dir(time) if not k.startswith("__")})
        fast.sleep = lambda s: None
        monkeypatch.setattr(hf_http, "time", fast)
        monkeypatch.setenv("HF_ENDPOINT", h.url)
        monkeypatch.setenv("HF_HUB_OFFLINE", "0")
        # huggingface_hub reads HF_ENDPOINT at import: point the already imported module here
        monkeypatch.setattr(constants, "ENDPOINT", h.url)
        monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE",
                            h.url + "/{repo_id}/resolve/{revision}/{filename}")
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
        monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", True)
        monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf-cache"))
        monkeypatch.setenv("HF_TOKEN", "")
        yield h


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
    hub.repos[repo] = files
    return repo


W_FLOAT = 2048 * 512 * 2 + 512 * 1024 * 2


def _no_weight_bytes(hub):
    """Only header reads of .safetensors files: ranged, within the first 100 kB."""
    st = [s for s in hub.sent if s[1].endswith(".safetensors")]
    assert st, "the safetensors headers were not read"
    for method, name, first, last in st:
        size = len(next(f for r in hub.repos.values() for n, f in r.items() if n == name))
        assert last <= HEADER_READ < size, (name, first, last, size)
    assert all(rng for m, n, rng in hub.log if n.endswith(".safetensors") and m == "GET")


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
    for n, data in hub.repos[repo].items():
        (local / n).write_bytes(data)
    lr = embedq.plan(local, "2GiB", kv_dtype="bf16", max_model_len=4096, reserve="0.5GiB")
    assert (lr.before.kv_tokens, lr.after.kv_tokens) == (r.before.kv_tokens, r.after.kv_tokens)


def test_plan_hub_id_with_weights_gib_reads_config_only(hub):
    repo = _repo(hub)
    r = embedq.plan(repo, "2GiB", kv_dtype="bf16", max_model_len=4096, reserve="0.5GiB", weights_gib="1GiB")
    assert r.before.weights == 1 << 30
    assert {n for m, n, rng in hub.log} == {"config.json"}
    assert not [s for s in hub.sent if s[1].endswith(".safetensors")]


def test_plan_hub_errors_are_one_line(hub):
    with pytest.raises(PlanError, match=r"^org/missing: no such directory or Hub model"):
        embedq.plan("org/missing", "2GiB")
    hub.repos["org/noweights"] = {"config.json": json.dumps(QWEN).encode()}
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
    d = json.loads(res.output)
    assert d["vllm"]["version"] == "0.33.0" and d["before"]["weights"] == W_FLOAT
    _no_weight_bytes(hub)
