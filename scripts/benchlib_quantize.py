"""The measuring half of scripts/bench_quantize.py: the synthetic checkpoint (made once,
cached), the plain-I/O copy baseline, child processes timed like ``/usr/bin/time``, and the
machine description and text tables printed with the results."""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this tree's embedq

MARKER = ".bench_complete"


def cache_root() -> Path:
    env = os.environ.get("EMBEDQ_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "embedq"


def log(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


# --- 1. the synthetic checkpoint ----------------------------------------------------

def synthesize(spec: dict, root: Path) -> Path:
    """A Qwen3-style checkpoint whose only large tensors are the two vocabulary tables."""
    import torch

    from embedq.format.writer import StreamingSafetensorsWriter
    path = root / spec["name"]
    if (path / MARKER).is_file():
        return path
    v, h, inter, layers = spec["vocab"], spec["hidden"], spec["intermediate"], spec["layers"]
    need = 2 * v * h * 2 + (256 << 20)
    free = shutil.disk_usage(root.parent if not root.exists() else root).free
    if free < need * 1.2:
        raise SystemExit(f"not enough disk for the synthetic checkpoint: {need / 1e9:.1f} GB needed, "
                         f"{free / 1e9:.1f} GB free under {root}")
    log(f"synthesizing {path} ({need / 1e9:.1f} GB; once, then cached)")
    tmp = root / f".{spec['name']}.{os.getpid()}.partial"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    heads, kv, hd = 8, 2, 128
    bf = torch.bfloat16
    layer_t = {}
    for i in range(layers):
        pre = f"model.layers.{i}."
        layer_t.update({
            pre + "input_layernorm.weight": (h,), pre + "post_attention_layernorm.weight": (h,),
            pre + "self_attn.q_proj.weight": (heads * hd, h), pre + "self_attn.k_proj.weight": (kv * hd, h),
            pre + "self_attn.v_proj.weight": (kv * hd, h), pre + "self_attn.o_proj.weight": (h, heads * hd),
            pre + "self_attn.q_norm.weight": (hd,), pre + "self_attn.k_norm.weight": (hd,),
            pre + "mlp.gate_proj.weight": (inter, h), pre + "mlp.up_proj.weight": (inter, h),
            pre + "mlp.down_proj.weight": (h, inter),
        })
    names = sorted(layer_t)
    shards = {
        "model-00001-of-00003.safetensors": {"model.embed_tokens.weight": (v, h),
                                             **{n: layer_t[n] for n in names[: len(names) // 2]}},
        "model-00002-of-00003.safetensors": {n: layer_t[n] for n in names[len(names) // 2:]},
        "model-00003-of-00003.safetensors": {"model.norm.weight": (h,), "lm_head.weight": (v, h)},
    }
    gen = torch.Generator().manual_seed(0)
    weight_map, total = {}, 0
    for fname, tensors in shards.items():
        decl = {n: (bf, s) for n, s in tensors.items()}
        with StreamingSafetensorsWriter(tmp / fname, decl, {"format": "pt"}) as w:
            for n, shape in tensors.items():
                rows = shape[0]
                cols = shape[1] if len(shape) > 1 else 1
                step = max(1, (32 << 20) // (cols * 4))
                for r0 in range(0, rows, step):
                    r1 = min(rows, r0 + step)
                    if len(shape) == 1:
                        x = torch.ones(r1 - r0, dtype=bf)
                    else:
                        # Embedding-like rows: N(0, 0.02) with a per-row spread and outliers.
                        x = torch.randn(r1 - r0, cols, generator=gen) * 0.02
                        x *= torch.rand(r1 - r0, 1, generator=gen) + 0.5
                        x[:, :: max(1, cols // 7)] *= 4
                        x = x.to(bf)
                    w.write(n, x, row=r0)
                weight_map[n] = fname
                total += rows * cols * 2
    (tmp / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, indent=2))
    config = {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "torch_dtype": "bfloat16",
        "vocab_size": v, "hidden_size": h, "intermediate_size": inter, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": hd,
        "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
        "tie_word_embeddings": False, "hidden_act": "silu",
        "_comment": "synthetic: only the vocabulary tables have the real model's shape",
    }
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    (tmp / MARKER).write_text(json.dumps({"spec": spec, "bytes": total}))
    shutil.rmtree(path, ignore_errors=True)
    os.replace(tmp, path)
    return path


def table_info(ckpt_dir: Path, names: list[str]) -> list[tuple[Path, int, int]]:
    """``(file, byte offset, nbytes)`` of each named tensor."""
    from embedq.format.checkpoint import Checkpoint
    ck = Checkpoint.open(ckpt_dir)
    out = []
    for n in names:
        t = ck.tensor(n)
        out.append((ckpt_dir / t.file, t.file_offset, t.nbytes))
    return out


def overlay_bytes(rows: int, cols: int, bits: int, group: int | None, n_tables: int) -> int:
    groups = 1 if not group else cols // group  # None or 0: one scale per row
    return n_tables * (rows * cols * bits // 8 + rows * groups * 2 + 8)


def warm(files: list[tuple[Path, int, int]]) -> None:
    """Read the tables once so the page cache is warm."""
    buf = bytearray(16 << 20)
    for f, off, n in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            pos = 0
            while pos < n:
                pos += os.preadv(fd, [memoryview(buf)[: min(len(buf), n - pos)]], off + pos)
        finally:
            os.close(fd)


# --- 2. the copy baseline ------------------------------------------------------------

def copy_baseline(files: list[tuple[Path, int, int]], out_bytes: int, dest_dir: Path,
                  fsync: bool, chunk: int = 8 << 20) -> float:
    """Read the tables, write ``out_bytes`` (spread evenly over the reads), optional fsync."""
    total_in = sum(n for _, _, n in files)
    buf = bytearray(chunk)
    mv = memoryview(buf)
    dest = dest_dir / f".bench-copy.{os.getpid()}.tmp"
    t0 = time.perf_counter()
    wfd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        written, read_so_far = 0, 0
        for f, off, n in files:
            fd = os.open(f, os.O_RDONLY)
            try:
                pos = 0
                while pos < n:
                    got = os.preadv(fd, [mv[: min(chunk, n - pos)]], off + pos)
                    pos += got
                    read_so_far += got
                    target = out_bytes * read_so_far // total_in
                    while written < target:
                        k = min(target - written, chunk)
                        written += os.pwrite(wfd, mv[:k], written)
            finally:
                os.close(fd)
        if fsync:
            os.fsync(wfd)
    finally:
        os.close(wfd)
    dt = time.perf_counter() - t0
    dest.unlink()
    return dt


# --- child processes with /usr/bin/time-style accounting -----------------------------

def run_measured(cmd: list[str], env: dict | None = None, cwd: Path | None = None) -> dict:
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=cwd)
    # wait4 gives this child's own rusage (and its waited-for descendants').
    out_chunks, err_chunks = [], []
    import threading

    def pump(src, dst):
        for line in iter(src.readline, b""):
            dst.append(line)
    ts = [threading.Thread(target=pump, args=(p.stdout, out_chunks)),
          threading.Thread(target=pump, args=(p.stderr, err_chunks))]
    for t in ts:
        t.start()
    _, status, ru = os.wait4(p.pid, 0)
    wall = time.perf_counter() - t0
    for t in ts:
        t.join()
    p.returncode = os.waitstatus_to_exitcode(status)
    return {"rc": p.returncode, "wall_s": wall, "user_s": ru.ru_utime, "sys_s": ru.ru_stime,
            "cpu_s": ru.ru_utime + ru.ru_stime, "peak_rss_mib": ru.ru_maxrss / 1024,
            "stdout": b"".join(out_chunks).decode(errors="replace"),
            "stderr": b"".join(err_chunks).decode(errors="replace")}


def dir_bytes(path: Path, suffix: str = ".safetensors") -> int:
    return sum(p.stat().st_size for p in path.rglob(f"*{suffix}") if p.is_file())


def machine() -> dict:
    import torch
    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return {"cpu": cpu, "cores": os.cpu_count(), "mem_gib": round(mem / 2**30, 1),
            "python": platform.python_version(), "torch": torch.__version__,
            "kernel": platform.release(), "load_avg_start": os.getloadavg()}


def fmt_table(rows: list[list], head: list[str]) -> str:
    cells = [head] + [[str(c) for c in r] for r in rows]
    w = [max(len(r[i]) for r in cells) for i in range(len(head))]
    lines = ["| " + " | ".join(c.ljust(w[i]) for i, c in enumerate(r)) + " |" for r in cells]
    lines.insert(1, "|" + "|".join("-" * (x + 2) for x in w) + "|")
    return "\n".join(lines)
