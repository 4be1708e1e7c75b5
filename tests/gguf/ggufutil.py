"""GGUF helpers for tests: a tiny llama GGUF written with gguf-py, the independent checks
(gguf-py's reader and dequantization), the node-llama-cpp runner."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[2]
HARNESS = REPO / "tests" / "js" / "llamacpp" / "generate.mjs"
FLAGS8 = ["--bits", "8", "--group-size", "32", "--scale-dtype", "float16"]
FLAGS4 = ["--bits", "4", "--group-size", "32", "--scale-dtype", "float16"]


def quantize_cli(model: Path, out: Path, *flags: str) -> Path:
    from typer.testing import CliRunner

    from embedq.cli import app
    res = CliRunner().invoke(app, ["quantize", str(model), *flags, "-o", str(out), "--overlay-only", "-q"])
    assert res.exit_code == 0, res.output
    return out


def tiny_vocab(n: int) -> tuple[list[str], list[float], list[int]]:
    """An SPM vocabulary llama.cpp accepts: <unk> <s> </s>, the 256 byte tokens (any text
    tokenizes by byte fallback), then plain pieces up to ``n``."""
    toks, types = ["<unk>", "<s>", "</s>"], [2, 3, 3]          # UNKNOWN, CONTROL
    toks += [f"<0x{i:02X}>" for i in range(256)]
    types += [6] * 256                                       # BYTE
    letters = "abcdefghijklmnopqrstuvwxyz"
    i = 0
    while len(toks) < n:
        toks.append("\u2581" + letters[i % 26] * (1 + i // 26))
        types.append(1)                                      # NORMAL
        i += 1
    return toks, [0.0] * 3 + [-1000.0] * 256 + [-float(k) for k in range(n - 259)], types


def write_llama_gguf(hf_dir: Path, out: Path, table_type: str = "Q8_0") -> Path:
    """A llama.cpp-loadable GGUF of a tiny HF llama checkpoint (weights as they are: the
    output is random text, the point is which tables llama.cpp reads). The embedding and
    head are stored as ``table_type`` (gguf-py's quantizer), the rest as F32."""
    import gguf
    from safetensors.torch import load_file
    cfg = json.loads((hf_dir / "config.json").read_text())
    sd = {}
    for f in sorted(hf_dir.glob("*.safetensors")):
        sd.update(load_file(f))
    w = gguf.GGUFWriter(str(out), "llama")
    w.add_context_length(256)
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_rope_dimension_count(cfg["hidden_size"] // cfg["num_attention_heads"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_freq_base(float(cfg.get("rope_theta", 10000.0)))
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
    toks, scores, types = tiny_vocab(cfg["vocab_size"])
    w.add_tokenizer_model("llama")
    w.add_token_list(toks)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(True)
    names = {"model.embed_tokens.weight": "token_embd.weight", "lm_head.weight": "output.weight",
             "model.norm.weight": "output_norm.weight"}
    per_layer = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q",
                 "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
                 "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
                 "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    for i in range(cfg["num_hidden_layers"]):
        for hf, gg in per_layer.items():
            names[f"model.layers.{i}.{hf}.weight"] = f"blk.{i}.{gg}.weight"
    qt = gguf.GGMLQuantizationType[table_type]
    for hf, gg in names.items():
        if hf not in sd:
            continue
        x = sd[hf].float().numpy()
        if gg in ("token_embd.weight", "output.weight") and qt != gguf.GGMLQuantizationType.F32:
            w.add_tensor(gg, gguf.quants.quantize(x, qt), raw_dtype=qt)
        else:
            w.add_tensor(gg, x)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


_READERS: dict = {}
_FIELDS: dict = {}


def _plain_reader():
    """gguf-py's GGUFReader, unchanged, over a plain ndarray view of its np.memmap.

    Parsing Gemma's 262k-token vocabulary slices the file ~6M times; each slice of an
    np.memmap runs memmap.__getitem__ / __array_finalize__ in Python (~2/3 of the parse:
    13 s -> 5 s per file here). The view maps the same pages (still lazy, no copy) and every
    parsed field and tensor is the same bytes; only the subclass overhead goes."""
    import numpy as np
    from gguf import GGUFReader

    class PlainReader(GGUFReader):
        @property
        def data(self):
            return self._data

        @data.setter
        def data(self, value):  # GGUFReader.__init__ assigns its np.memmap here
            self._data = value.view(np.ndarray)
    return PlainReader


def _key(path: Path) -> tuple:
    """(path, size, mtime, inode): a file rewritten in place (the nibble-swap test) is re-read."""
    st = os.stat(path)
    return (str(Path(path).resolve()), st.st_size, st.st_mtime_ns, st.st_ino)


def _reader(path: Path):
    """One gguf-py reader per file version: parsing Gemma's 262k-token vocabulary takes
    tens of seconds on a loaded 2-core machine, and each check reads BASE and OUT twice."""
    key = _key(path)
    if key not in _READERS:
        _READERS[key] = _plain_reader()(str(path))
    return _READERS[key]


def tensors(path: Path) -> dict:
    """name -> gguf-py ReaderTensor (memory-mapped)."""
    return {t.name: t for t in _reader(path).tensors}


def fields(path: Path) -> dict[str, list[bytes]]:
    """Every metadata entry's raw parts (key, type and value bytes), once per file version
    (BASE's 262k token strings are compared against every OUT)."""
    key = _key(path)
    if key not in _FIELDS:
        _FIELDS[key] = {k: [bytes(p) for p in f.parts] for k, f in _reader(path).fields.items()
                        if not k.startswith("GGUF.")}
    return _FIELDS[key]


def dequantized(t) -> np.ndarray:
    """gguf-py's own dequantization of a tensor (float32 [rows, cols])."""
    from gguf.quants import dequantize
    return dequantize(np.asarray(t.data), t.tensor_type).astype(np.float32, copy=False)


def same_bits(a: np.ndarray, b: torch.Tensor | np.ndarray) -> bool:
    b = b.numpy() if isinstance(b, torch.Tensor) else b
    return a.shape == b.shape and np.array_equal(np.ascontiguousarray(a).view(np.uint32),
                                                 np.ascontiguousarray(b, dtype=np.float32).view(np.uint32))


def assert_transcoded(base: Path, out: Path, overlay: Path, mapping: dict[str, str],
                      added: dict[str, str] | None = None) -> None:
    """OUT's ``mapping`` tensors (GGUF name -> overlay module) decode, by gguf-py, to the
    overlay's own decoding bit for bit; every other tensor's bytes and every metadata
    entry equal BASE's. ``added`` (new tensor -> the tensor it follows): tensors OUT adds
    (an output.weight over a tied BASE), in ``mapping`` too."""
    from embedq.format.reader import load_overlay
    ov = load_overlay(overlay)
    b, o = tensors(base), tensors(out)
    order = []
    for name in b:
        order.append(name)
        order += [n for n, after in (added or {}).items() if after == name]
    assert order == list(o)
    for name, after in (added or {}).items():
        ref = ov.table_for(mapping[name]).dequantize(torch.float32)
        assert list(o[name].shape) == list(b[after].shape), name
        assert same_bits(dequantized(o[name]), ref), f"{name} does not decode to the overlay's table"
    for name, t in b.items():
        if name in mapping:
            ref = ov.table_for(mapping[name]).dequantize(torch.float32)
            assert same_bits(dequantized(o[name]), ref), f"{name} does not decode to the overlay's table"
        else:
            assert (t.tensor_type, list(t.shape)) == (o[name].tensor_type, list(o[name].shape)), name
            assert np.asarray(t.data).tobytes() == np.asarray(o[name].data).tobytes(), name
    assert fields(base) == fields(out)


def swap_q4_0_nibbles(path: Path, tensor: str) -> None:
    """Re-pack a Q4_0 tensor in place the *wrong* way (embedq's even/odd order)."""
    t = tensors(path)[tensor]
    off, n = t.data_offset, t.n_bytes
    with open(path, "r+b") as f:
        f.seek(off)
        b = np.frombuffer(f.read(n), np.uint8).reshape(-1, 18)
        u = np.concatenate((b[:, 2:] & 0x0F, b[:, 2:] >> 4), axis=1)   # ggml order: q[0..31]
        wrong = u[:, 0::2] | (u[:, 1::2] << 4)
        f.seek(off)
        f.write(np.concatenate((b[:, :2], wrong), axis=1).tobytes())


def negate_q8_0(path: Path, tensor: str) -> None:
    """Flip the sign of every Q8_0 block's scale of ``tensor`` (the table, negated, exactly)."""
    t = tensors(path)[tensor]
    with open(path, "r+b") as f:
        f.seek(t.data_offset)
        b = np.frombuffer(f.read(t.n_bytes), np.uint8).reshape(-1, 34).copy()
        b[:, 1] ^= 0x80
        f.seek(t.data_offset)
        f.write(b.tobytes())


def llamacpp_entry() -> str | None:
    """node-llama-cpp's entry (file URL) when scripts/setup_llamacpp.sh has run, else None."""
    import hashlib
    src = REPO / "tests" / "js" / "llamacpp"
    h = hashlib.sha256((src / "package.json").read_bytes() + (src / "package-lock.json").read_bytes())
    cache = Path(os.environ.get("EMBEDQ_CACHE") or Path.home() / ".cache" / "embedq")
    d = cache / "llamacpp-node" / h.hexdigest()[:16]
    if not (d / ".embedq-ok").is_file():
        return None
    return "file://" + str(d / "node_modules" / "node-llama-cpp" / "dist" / "index.js")


def generate(entry: str, models: list[Path], prompts: list[str], max_tokens: int, tmp: Path,
             repeat: int = 1, threads: int = 1, timeout: int = 1800) -> list[dict]:
    """Greedy generation through llama.cpp: one run per (round, model), in order."""
    spec = tmp / "spec.json"
    spec.write_text(json.dumps({"entry": entry, "models": [str(m) for m in models], "prompts": prompts,
                                "max_tokens": max_tokens, "repeat": repeat, "threads": threads}))
    p = subprocess.run(["node", str(HARNESS), str(spec)], capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])["runs"]
