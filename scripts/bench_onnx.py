"""Benchmarks of embedq's ONNX back end on a real model (default: Gemma 3 270M fixture).

    python scripts/bench_onnx.py q4     # 4-bit table accuracy: embedq RTN vs builder-style RTN
    python scripts/bench_onnx.py speed  # decode tokens/s, session memory, greedy agreement
    python scripts/bench_onnx.py tables # tied table at run time: one copy or two? (synthetic)

``q4`` (issue #14 item 3, a measurement for the quantizer's owner): the tied table is
quantized 4-bit g32 symmetric by (A) embedq's RTN (absmax/7, codes -7..7, bf16 scales
rounded up), (B) onnxruntime's/the genai builder's RTN (the group's signed max maps to
-8: scale = signed_max / -8 in float32, codes -8..7), and, to tell the two changes
apart, (C) B with bf16 scales and (D) A with float32 scales. Each table is dequantized
into transformers (tied: embedding and head) and compared teacher-forced with the float
model on ``--contexts`` x ``--length`` tokens of evaluate's default text: same-top-1 and
mean KLD (embedq.quality.evaluate.token_stats). Codes -8..7 (+8) fit the same 4-bit bytes.

``speed`` builds (cached under --work) the onnxruntime-genai builder's fp32 CPU folder
(default layout: tied, Transpose), patches it with embedq int8 (per row) and int4 (g32
sym) overlays at accuracy_level 4 (and int8 at level 0, the old default, for a few
tokens), builds the builder's own int4 folder, and runs each with onnxruntime_genai in
its own process: prompt + ``--new`` greedy tokens, decode tokens/s (best of
``--repeat``), RSS added by loading the model, and greedy agreement with the fp32 graph.
Needs scripts/setup_genai_onnx.sh. Prints a markdown table and JSON.

``tables`` (issue #14 item 4): a Gemma-sized tied table (262144 x 640, random bytes) as
GatherBlockQuantized + MatMulNBits, (a) embedq's layout: one 2-D uint8 initializer that
MatMulNBits reads through a Reshape, and (b) one 3-D ``[V, blocks, blob]`` initializer
read by both (GatherBlockQuantized with quantize_axis=2 and [V, blocks, 1] scales, then
a Reshape of the gathered rows), at accuracy_level 0 and 4, inline (no mmap). Reports
the anonymous memory a session adds, and one gather + head call's time.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CACHE = Path(os.environ.get("EMBEDQ_CACHE", Path.home() / ".cache" / "embedq"))
DEFAULT_MODEL = CACHE / "gemma3-270m"
PROMPTS = ["The capital of France is", "def fibonacci(n):",
           "In 1905, Albert Einstein published", "The three primary colors are"]


# ------------------------------------------------------------------------------ q4

def builder_rtn(x, group: int = 32):
    """onnxruntime's MatMulNBits RTN (symmetric): scale = signed max / -8, codes -8..7."""
    import torch
    rows, cols = x.shape
    xg = x.float().reshape(rows, cols // group, group)
    idx = xg.abs().argmax(-1, keepdim=True)
    m = xg.gather(-1, idx).squeeze(-1)
    scale = torch.where(m != 0, m / -8.0, torch.ones_like(m))
    q = torch.round(xg / scale.unsqueeze(-1)).clamp_(-8, 7)
    return q, scale


def q4_tables(w):
    """name -> dequantized float32 table of each variant."""
    import torch

    from embedq.format.codec import dequantize_codes
    from embedq.quant.rtn import quantize_rtn, round_scale_up
    from embedq.format.scheme import Scheme
    rows, cols = w.shape
    out = {}
    s = Scheme(bits=4, group_size=32, symmetric=True)
    q, sc, _ = quantize_rtn(w, s, torch.bfloat16)
    out["A embedq RTN (absmax/7, -7..7, bf16 scales)"] = dequantize_codes(q, sc, None, 32)
    q, sc, _ = quantize_rtn(w, s, torch.float32)
    out["D embedq RTN, f32 scales"] = dequantize_codes(q, sc, None, 32)
    q, sc = builder_rtn(w)
    out["B builder RTN (signed max/-8, -8..7, f32 scales)"] = (q * sc.unsqueeze(-1)).reshape(rows, cols)
    # bf16 scale: |scale| rounded up so the signed max still maps inside -8..7
    sb = round_scale_up(sc.abs(), torch.bfloat16).float() * torch.sign(sc)
    q = torch.round(w.float().reshape(rows, cols // 32, 32) / sb.unsqueeze(-1)).clamp_(-8, 7)
    out["C builder RTN, bf16 scales"] = (q * sb.unsqueeze(-1)).reshape(rows, cols)
    return out


def cmd_q4(args) -> dict:
    import torch
    import transformers as tf

    from embedq.quality.evaluate import default_text, load_tokenizer, text_contexts, token_stats
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    model = tf.AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    emb = model.get_input_embeddings().weight
    assert model.get_output_embeddings().weight.data_ptr() == emb.data_ptr(), "expects a tied model"
    src = emb.detach().to(torch.bfloat16)  # the checkpoint's values
    tables = q4_tables(src)
    tok = load_tokenizer(Path(args.model))
    text, desc = default_text()
    ctx = text_contexts(tok, text, args.contexts, args.length, tok.bos_token_id)
    orig = emb.detach().clone()
    acc = {k: {"kld": 0.0, "same": 0, "n": 0} for k in tables}
    t0 = time.perf_counter()
    for i in range(ctx.shape[0]):
        ids = ctx[i:i + 1]
        with torch.inference_mode():
            emb.data.copy_(orig)
            ref = model(input_ids=ids, use_cache=False).logits[0, :-1].float()
            for name, t in tables.items():
                emb.data.copy_(t)
                lq = model(input_ids=ids, use_cache=False).logits[0, :-1].float()
                kld, same, _, _ = token_stats(ref, lq, ids[0, 1:])
                acc[name]["kld"] += float(kld.sum())
                acc[name]["same"] += int(same.sum())
                acc[name]["n"] += kld.numel()
        print(f"  context {i + 1}/{ctx.shape[0]} ({time.perf_counter() - t0:.0f}s)", file=sys.stderr)
    rows = []
    for name, a in acc.items():
        err = (tables[name] - src.float()).pow(2).mean().sqrt()
        rows.append({"variant": name, "positions": a["n"], "same_top1": 100 * a["same"] / a["n"],
                     "mean_kld": a["kld"] / a["n"], "table_rmse": float(err)})
    print(f"\n{args.contexts} contexts x {args.length} tokens ({rows[0]['positions']} positions), "
          f"text: {desc}\n")
    print("| variant | same-top-1 % | mean KLD | table RMSE |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['variant']} | {r['same_top1']:.2f} | {r['mean_kld']:.4f} | {r['table_rmse']:.3e} |")
    return {"q4": rows, "text": desc}


# ---------------------------------------------------------------------------- speed

def genai_site() -> Path:
    out = subprocess.run(["bash", str(REPO / "scripts" / "setup_genai_onnx.sh")], check=True,
                         capture_output=True, text=True).stdout.strip().splitlines()[-1]
    return Path(out)


def _env(site: Path) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(site), str(REPO)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    return env


def build_folders(args, site: Path) -> dict[str, Path]:
    """name -> onnxruntime-genai folder (cached under --work)."""
    import embedq
    from embedq.backends.onnx import patch_model
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    py = sys.executable

    def builder(out: Path, precision: str, *extra: str) -> Path:
        if not (out / "genai_config.json").exists():
            t0 = time.perf_counter()
            cmd = [py, str(REPO / "scripts" / "genai_build.py"), "-i", str(args.model), "-o", str(out),
                   "-p", precision, "-e", "cpu", "-c", str(work / "builder-cache")]
            if extra:
                cmd += ["--extra_options", *extra]
            subprocess.run(cmd, check=True, env=_env(site), stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)
            print(f"  built {out.name} in {time.perf_counter() - t0:.0f}s", file=sys.stderr)
        return out

    folders = {"fp32 (builder)": builder(work / "fp32", "fp32")}
    folders["int4 (builder default, whole model)"] = builder(work / "builder-int4", "int4")
    for name, bits, group in (("int8", 8, None), ("int4", 4, 32)):
        ov = work / f"overlay-{name}"
        if not (ov / "quantization_config.json").exists():
            embedq.quantize(args.model, bits=bits, group_size=0 if group is None else group,
                            output=ov, overlay_only=True, progress=False)
        for level in (4, 0):
            out = work / f"embedq-{name}-level{level}"
            if not (out / "genai_config.json").exists():
                patch_model(folders["fp32 (builder)"], ov, out, accuracy_level=level, force=True)
            folders[f"{name} embedq (level {level})"] = out
    return folders


RUNNER = r"""
import json, sys, time, resource
import onnxruntime_genai as og
def rss():
    for l in open('/proc/self/status'):
        if l.startswith('VmRSS'): return int(l.split()[1]) / 1024
folder, prompts, new, repeat = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
r0 = rss(); t = time.perf_counter()
model = og.Model(folder)
load_s = time.perf_counter() - t; r1 = rss()
tok = og.Tokenizer(model)
res = {"load_s": load_s, "rss_model_mib": r1 - r0, "tokens": [], "decode_tps": [], "prefill_s": [], "ids": []}
for p in prompts:
    ids = tok.encode(p)
    res["ids"].append([int(i) for i in ids])
    best = None
    for _ in range(repeat):
        params = og.GeneratorParams(model)
        # max_length >= the sliding window (Gemma 3: 512): GQA sizes its cache by it
        params.set_search_options(do_sample=False, max_length=max(1024, len(ids) + new))
        g = og.Generator(model, params)
        t = time.perf_counter(); g.append_tokens(ids); t1 = time.perf_counter()
        out = []
        while not g.is_done() and len(out) < new:
            g.generate_next_token(); out.append(int(g.get_next_tokens()[0]))
        t2 = time.perf_counter()
        tps = (len(out) - 1) / (t2 - t1) if len(out) > 1 else 0.0
        if best is None or tps > best[0]: best = (tps, t1 - t, out)
        del g
    res["decode_tps"].append(best[0]); res["prefill_s"].append(best[1]); res["tokens"].append(best[2])
res["rss_end_mib"] = rss() - r0
res["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print(json.dumps(res))
"""


def _prefix(refs: list[list[int]], got: list[list[int]]) -> tuple[int, int]:
    """Tokens generated before the first difference, summed over prompts; and the total."""
    agree = total = 0
    for a, b in zip(refs, got):
        n = min(len(a), len(b))
        agree += next((i for i in range(n) if a[i] != b[i]), n)
        total += n
    return agree, total


def reference_tokens(args, folders: dict, results: dict) -> dict[str, list[list[int]]]:
    """transformers greedy tokens (float32) with the table each ONNX variant computes with:
    the float table for fp32, the overlay's dequantized table for embedq's patches."""
    import torch
    import transformers as tf

    import embedq
    model = tf.AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    emb = model.get_input_embeddings().weight
    orig = emb.detach().clone()
    out = {}
    for name, r in results.items():
        if name.startswith("fp32"):
            table = orig
        elif "embedq" in name:
            ov = embedq.load_overlay(Path(args.work) / f"overlay-{name.split()[0]}")
            table = ov.tables["model.embed_tokens"].dequantize(torch.float32)
        else:
            continue
        toks = []
        with torch.inference_mode():
            emb.data.copy_(table)
            for ids, got in zip(r["ids"], r["tokens"]):
                x = torch.tensor([ids])
                g = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=len(got),
                                   do_sample=False)
                toks.append(g[0, len(ids):].tolist())
        out[name] = toks
    return out


def cmd_speed(args) -> dict:
    site = genai_site()
    folders = build_folders(args, site)
    results = {}
    for name, folder in folders.items():
        slow = name.startswith("int8") and "level 0" in name  # ~1 s per token
        new = 4 if slow else args.new
        prompts = PROMPTS[:1] if slow else PROMPTS
        p = subprocess.run([sys.executable, "-c", RUNNER, str(folder), json.dumps(prompts), str(new),
                            str(1 if slow else args.repeat)],
                           env=_env(site), capture_output=True, text=True)
        if p.returncode:
            print(f"{name}: failed\n{p.stderr[-2000:]}", file=sys.stderr)
            continue
        results[name] = json.loads(p.stdout.strip().splitlines()[-1])
        print(f"  {name}: {sum(results[name]['decode_tps']) / len(results[name]['decode_tps']):.1f} tok/s",
              file=sys.stderr)
    ref = results.get("fp32 (builder)")
    torch_ref = reference_tokens(args, folders, results)
    rows = []
    for name, r in results.items():
        agree, total = _prefix(ref["tokens"], r["tokens"]) if ref else (0, 0)
        tagree, ttotal = _prefix(torch_ref[name], r["tokens"]) if name in torch_ref else (0, 0)
        r["torch_same"] = f"{tagree}/{ttotal}" if name in torch_ref else "-"
        r["torch_prompts_equal"] = (sum(a[:len(b)] == b for a, b in zip(torch_ref[name], r["tokens"]))
                                    if name in torch_ref else None)
        size = sum(f.stat().st_size for f in folders[name].iterdir() if f.name.startswith("model.onnx"))
        rows.append({"variant": name, "decode_tok_s": sum(r["decode_tps"]) / len(r["decode_tps"]),
                     "decode_tok_s_per_prompt": r["decode_tps"], "prefill_s": r["prefill_s"],
                     "rss_model_mib": r["rss_model_mib"], "peak_rss_mib": r["peak_rss_mib"],
                     "file_mib": size / 2**20, "greedy_same_prefix": f"{agree}/{total}",
                     "same_as_torch_reference": r["torch_same"], "prompts_equal_torch": r["torch_prompts_equal"],
                     "tokens": r["tokens"]})
    load = os.getloadavg()
    print(f"\nonnxruntime-genai greedy, {len(PROMPTS)} prompts x {args.new} new tokens, best of "
          f"{args.repeat}; load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}, {os.cpu_count()} cores\n")
    print("| variant | decode tok/s | model files MiB | RSS after load MiB | peak RSS MiB | "
          "greedy = fp32 graph (common prefix) | greedy = transformers with the same table |\n"
          "|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['variant']} | {r['decode_tok_s']:.1f} | {r['file_mib']:.0f} | {r['rss_model_mib']:.0f} | "
              f"{r['peak_rss_mib']:.0f} | {r['greedy_same_prefix']} | {r['same_as_torch_reference']} |")
    return {"speed": rows, "loadavg": load}


TABLES_RUNNER = r"""
import os, sys, time, numpy as np, onnx
from onnx import TensorProto as TP, helper as h, numpy_helper as nh
layout, level, bits, path = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
V, H = 262144, 640
block = 32 if bits == 4 else 128
nb = H // block; blob = block * bits // 8
rng = np.random.default_rng(0)
data = rng.integers(0, 256, (V, H * bits // 8), dtype=np.uint8)
sc = (rng.random((V, nb)) * 0.01).astype(np.float32)
zp = np.full((V, (nb * bits + 7) // 8), 0x88 if bits == 4 else 128, np.uint8)
inits = [nh.from_array(sc, "S"), nh.from_array(zp, "Z")]
mm = dict(domain="com.microsoft", K=H, N=V, bits=bits, block_size=block, accuracy_level=level)
if layout == "reshape":
    inits += [nh.from_array(data, "W"), nh.from_array(np.array([V, nb, blob], np.int64), "shp")]
    nodes = [h.make_node("GatherBlockQuantized", ["W", "ids", "S", "Z"], ["e"], domain="com.microsoft",
                         bits=bits, block_size=block, gather_axis=0, quantize_axis=1),
             h.make_node("Reshape", ["W", "shp"], ["W3"]), h.make_node("MatMulNBits", ["x", "W3", "S", "Z"], ["y"], **mm)]
else:
    inits += [nh.from_array(data.reshape(V, nb, blob), "W"), nh.from_array(sc.reshape(V, nb, 1), "S3"),
              nh.from_array(np.array([-1, H], np.int64), "shp")]
    nodes = [h.make_node("GatherBlockQuantized", ["W", "ids", "S3"], ["e3"], domain="com.microsoft",
                         bits=bits, block_size=block, gather_axis=0, quantize_axis=2),
             h.make_node("Reshape", ["e3", "shp"], ["e"]), h.make_node("MatMulNBits", ["x", "W", "S", "Z"], ["y"], **mm)]
g = h.make_graph(nodes, "g", [h.make_tensor_value_info("ids", TP.INT64, [None]),
                              h.make_tensor_value_info("x", TP.FLOAT, [None, H])],
                 [h.make_tensor_value_info("e", TP.FLOAT, None), h.make_tensor_value_info("y", TP.FLOAT, None)], inits)
m = h.make_model(g, opset_imports=[h.make_opsetid("", 18), h.make_opsetid("com.microsoft", 1)]); m.ir_version = 9
onnx.save(m, path)
del m, g, inits, data
import gc; gc.collect()
import onnxruntime as ort
def anon():
    for l in open("/proc/self/smaps_rollup"):
        if l.startswith("Anonymous:"): return int(l.split()[1]) / 1024
a0 = anon()
s = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
x = rng.standard_normal((1, H)).astype(np.float32); ids = np.array([5], np.int64)
s.run(None, {"ids": ids, "x": x})
t = time.perf_counter()
for _ in range(5): s.run(None, {"ids": ids, "x": x})
print(anon() - a0, (time.perf_counter() - t) / 5 * 1e3)
"""


def cmd_tables(args) -> dict:
    import tempfile
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for bits in (4, 8):
            for level in (0, 4):
                for layout in ("reshape", "shared3d"):
                    p = subprocess.run([sys.executable, "-c", TABLES_RUNNER, layout, str(level), str(bits),
                                        f"{tmp}/m.onnx"], capture_output=True, text=True, check=True)
                    mib, ms = map(float, p.stdout.split())
                    rows.append({"bits": bits, "accuracy_level": level, "layout": layout,
                                 "session_anon_mib": mib, "gather_head_ms": ms})
    table = 262144 * 640 / 2**20
    print(f"\nGemma-sized tied table (uint8 bytes: int4 {table / 2:.0f} MiB, int8 {table:.0f} MiB)\n")
    print("| bits | accuracy_level | layout | session memory MiB | gather + head ms |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| int{r['bits']} | {r['accuracy_level']} | {r['layout']} | {r['session_anon_mib']:.0f} | "
              f"{r['gather_head_ms']:.1f} |")
    return {"tables": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=["q4", "speed", "tables"])
    ap.add_argument("--model", default=str(DEFAULT_MODEL))
    ap.add_argument("--work", default=str(CACHE / "bench-onnx"))
    ap.add_argument("--contexts", type=int, default=8)
    ap.add_argument("--length", type=int, default=129)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()
    res = {"q4": cmd_q4, "speed": cmd_speed, "tables": cmd_tables}[args.what](args)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
