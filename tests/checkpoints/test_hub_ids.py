"""``embedq inspect org/model`` and ``embedq.inspect``: config.json and safetensors headers
through huggingface_hub against a local HF_ENDPOINT; not one byte of tensor data served."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from archs import build_tiny  # noqa: E402
from fakehub import FakeHub, point_at  # noqa: E402  (tests/fakehub.py)

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def neox(tmp_path_factory) -> Path:
    return build_tiny("GPTNeoXForCausalLM", "gpt_neox", tmp_path_factory.mktemp("hub") / "neox", tie=False)


@pytest.fixture(scope="module")
def sharded(model_factory) -> Path:
    return model_factory("llama_untied_sharded")


def test_open_hub_header_only(neox, sharded, tmp_path, monkeypatch):
    from embedq.format.checkpoint import HubCheckpoint, open_checkpoint
    with FakeHub({"org/neox": neox, "org/sharded": sharded}) as hub:
        point_at(hub, monkeypatch, tmp_path)
        ck = open_checkpoint("org/neox")
        assert isinstance(ck, HubCheckpoint)
        assert ck.tensor("embed_out.weight").shape == (256, 64)
        import embedq
        d = embedq.inspect("org/neox")
        assert d["hub"] and d["head_tensor"] == "embed_out.weight"
        assert [r["tensor"] for r in d["tensors"]] == ["gpt_neox.embed_in.weight", "embed_out.weight"]
        assert d["head_identical"] is None  # would need the data
        d2 = embedq.inspect("org/sharded")
        assert d2["sharded"] and d2["files"] >= 3
        assert {r["role"] for r in d2["tensors"]} == {"embedding", "head"}
        assert hub.sent, "nothing was read"
        assert hub.tensor_bytes_sent() == 0, hub.sent
        weights = [f for _, f, _, _ in hub.sent if f.endswith(".safetensors")]
        assert weights  # headers were read, by Range
    assert not list(tmp_path.rglob("*.safetensors"))


def test_cli_inspect_hub_id(neox, tmp_path):
    with FakeHub({"org/neox": neox}) as hub:
        env = dict(os.environ, HF_ENDPOINT=hub.url, HF_HOME=str(tmp_path / "hf"), HF_HUB_OFFLINE="0",
                   PYTHONPATH=str(REPO), HF_HUB_DISABLE_TELEMETRY="1")
        exe = Path(sys.executable).with_name("embedq")
        r = subprocess.run([str(exe), "inspect", "org/neox", "--json"], cwd=tmp_path, env=env,
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr
        d = json.loads(r.stdout)
        assert d["head_tensor"] == "embed_out.weight" and d["hub"]
        assert hub.tensor_bytes_sent() == 0
        r = subprocess.run([str(exe), "inspect", "org/missing"], cwd=tmp_path, env=env,
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 2 and "org/missing" in r.stderr
