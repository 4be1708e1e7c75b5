#!/usr/bin/env python
"""Benchmark ``embedq quantize`` against a plain copy and against llm-compressor.

One run does four things (see docs/performance.md for results and how to read them):

1. Synthesizes (once; cached under ``$EMBEDQ_CACHE/bench``) a checkpoint shaped like
   Qwen3.8-27B's vocabulary tables: embedding 248,320 x 5,120 bf16 and an untied lm_head
   of the same shape, over 3 shards with other tensors (~5.1 GB). ``--small`` makes a
   65,536 x 2,048 variant (~0.55 GB) for a quick run.
2. Measures a **copy baseline** with plain file I/O, warm page cache: read exactly the
   source tables' bytes (``preadv`` into a reused buffer) and write as many bytes as the
   overlay of each scheme has, to a new file in the checkpoint folder. Reported without
   and with a final ``fsync`` (embedq fsyncs its overlay: that is the like-for-like one).
3. Runs ``embedq quantize DIR --lm-head`` for int8 per-row, int8 g128 and Q4 g32, each in
   a fresh process, twice: first with an empty torch.compile cache (compilation counted),
   then with the cache that run filled (``EMBEDQ_KERNEL_CACHE``/``TORCHINDUCTOR_CACHE_DIR``
   point into a temporary folder). Wall time, CPU time (user+sys) and peak RSS come
   from ``wait4`` on the child, like ``/usr/bin/time``.
4. Runs llm-compressor's data-free embedding recipe (``QuantizationModifier`` with a
   config group targeting ``Embedding``: W8 per channel, W4 g32; ``oneshot`` without data;
   ``save_pretrained(save_compressed=True)``) on the real Gemma 3 270M checkpoint, in its
   own venv (scripts/setup_llmcompressor_venv.sh), and embedq on the same checkpoint.

Every embedq run is profiled (``EMBEDQ_PROFILE``, :mod:`embedq.quant.profile`): a second
table gives its CPU seconds per stage (start-up and imports, kernel, source hash, output
hash, pwrite+fsync, page mapping, per-chunk Python, ...) beside the ratios, with the sum of
the stages against the process's own CPU time. The load average is printed with each run:
on a shared machine, read wall-time ratios taken at a load above ~2 as upper bounds.

Prints the tables and writes JSON to ``bench-results/bench-<shape>-<timestamp>.json``.

To rerun alone on a quiet machine (``uptime`` load < 1), from the repository root with the
project's venv (``PYTHONPATH=.`` picks this tree's embedq)::

    PYTHONPATH=. python scripts/bench_quantize.py --shape 27b --skip-peer          # 5.1 GB, the 27B shape
    PYTHONPATH=. python scripts/bench_quantize.py --shape 14b --skip-peer --skip-startup  # 3.1 GB untied 14B
    PYTHONPATH=. python scripts/bench_quantize.py --skip-synthetic                 # Gemma 3 270M vs llm-compressor
    PYTHONPATH=. python scripts/bench_quantize.py --small --skip-peer              # quick (0.55 GB)

``--repeat N`` adds warm runs per scheme, ``--schemes "Q4 g32"`` picks schemes. Each shape
is synthesized once into ``$EMBEDQ_CACHE/bench`` (needs 1.2x its size free on disk).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))  # benchlib_quantize, beside this script

from benchlib_quantize import (cache_root, copy_baseline, dir_bytes, fmt_table, log, machine,  # noqa: E402
                               overlay_bytes, run_measured, synthesize, table_info, warm)

SCHEMES = {  # label -> embedq CLI flags
    "int8 per-row": ["--bits", "8", "--group-size", "0"],  # 0: per row (the 8-bit default is g64)
    "int8 g128": ["--bits", "8", "--group-size", "128"],
    "Q4 g32": ["--bits", "4", "--group-size", "32"],
}
PEER_SCHEMES = {  # label -> (embedq flags, llm-compressor weights args)
    "W8 channel": (["--bits", "8", "--group-size", "0"], {"num_bits": 8, "type": "int", "symmetric": True,
                                     "strategy": "channel"}),
    "W4 g32": (["--bits", "4", "--group-size", "32"], {"num_bits": 4, "type": "int", "symmetric": True,
                                                      "strategy": "group", "group_size": 32}),
}
FULL = dict(name="qwen27b-shaped", vocab=248_320, hidden=5_120, intermediate=1_024, layers=2)
# Qwen2.5-14B's untied vocabulary tables: 152,064 x 5,120 bf16, embedding and head (3.11 GB).
Q14 = dict(name="qwen14b-shaped", vocab=152_064, hidden=5_120, intermediate=1_024, layers=2)
SMALL = dict(name="qwen27b-shaped-small", vocab=65_536, hidden=2_048, intermediate=512, layers=2)
SHAPES = {"27b": FULL, "14b": Q14, "small": SMALL}

# Profile stages (embedq.quant.profile) -> the columns of the per-stage table.
STAGE_GROUPS = [
    ("start-up+imports", ("start-up", "imports")),
    ("targets+config", ("open checkpoint", "base state", "target discovery", "kernel: load",
                        "overlay: create", "commit")),
    ("kernel build", ("C compiler",)),  # the child cc process, first run only
    ("kernel", ("kernel: quantize", "kernel: pack zero")),
    ("finite", ("finite check",)),
    ("hash src", ("read: hash source",)),
    ("map pages", ("read: map pages", "release pages")),
    ("hash out", ("write: hash outputs",)),
    ("pwrite+fsync", ("write: pwrite", "write: sync_file_range", "overlay: fsync")),
    ("python/queues", ("pipeline:", "read: loop", "write: loop")),
]


def stage_summary(profile: dict) -> dict:
    """CPU seconds per column of STAGE_GROUPS (+ ``other``: unattributed, foreign threads)."""
    out = {k: 0.0 for k, _ in STAGE_GROUPS}
    out["other"] = 0.0
    for r in profile["rows"]:
        col = next((k for k, prefixes in STAGE_GROUPS if r["stage"].startswith(prefixes)), "other")
        out[col] += r["cpu_s"]
    out["process CPU"] = profile["process_cpu_s"]
    out["named %"] = 100 * profile["coverage"]
    return out


def stage_table(runs: list[dict]) -> str:
    cols = [k for k, _ in STAGE_GROUPS] + ["other", "process CPU", "named %"]
    rows = [[r["scheme"], r["compile_cache"]] + [f"{r['stages'][c]:.2f}" if c != "named %" else
                                                  f"{r['stages'][c]:.1f}" for c in cols]
            for r in runs if r.get("stages")]
    return fmt_table(rows, ["scheme", "kernel cache"] + cols)


# --- 1. the synthetic checkpoint, 2. the copy baseline: scripts/benchlib_quantize.py ---

# --- 3. embedq, in a child process timed like /usr/bin/time (run_measured) ------------

def embedq_cmd(ckpt: Path, flags: list[str], lm_head: bool) -> list[str]:
    return [sys.executable, "-m", "embedq.cli", "quantize", str(ckpt), *flags,
            *(["--lm-head"] if lm_head else []), "--force", "--json", "-q"]


def run_embedq(ckpt: Path, flags: list[str], lm_head: bool, inductor_cache: Path,
               extra_env: dict | None = None) -> dict:
    """One ``embedq quantize`` process; compiled kernels are cached under ``inductor_cache``."""
    prof = Path(tempfile.mkstemp(prefix="embedq-profile-", suffix=".json")[1])
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(inductor_cache / "inductor"),
           "EMBEDQ_KERNEL_CACHE": str(inductor_cache / "kernels"), "EMBEDQ_PROFILE": str(prof),
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
           **(extra_env or {})}
    r = run_measured(embedq_cmd(ckpt, flags, lm_head), env=env)
    try:
        r["profile"] = json.loads(prof.read_text())
        r["stages"] = stage_summary(r["profile"])
    except (OSError, ValueError, KeyError):
        r["profile"] = r["stages"] = None
    finally:
        prof.unlink(missing_ok=True)
    if r["rc"] != 0:
        raise SystemExit(f"embedq failed ({r['rc']}):\n{r['stderr'][-3000:]}")
    rep = json.loads(r["stdout"])
    r["report_seconds"] = rep.get("seconds")
    r["bytes_before"] = rep["bytes_before"]
    r["bytes_after"] = rep["bytes_after"]
    r["overlay_file_bytes"] = (ckpt / "embedq.safetensors").stat().st_size
    r["rms_error"] = [m["rms_error"] for m in rep["modules"]]
    del r["stdout"]
    r["stderr"] = r["stderr"][-2000:]
    return r


def embedq_remove(ckpt: Path) -> None:
    subprocess.run([sys.executable, "-m", "embedq.cli", "remove", str(ckpt)],
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


# --- 4. the peer -----------------------------------------------------------------------

LLMC_SCRIPT = r"""
import json, sys, time
t0 = time.perf_counter()
src, out, weights = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
import torch
from transformers import AutoModelForCausalLM
from llmcompressor import oneshot
from llmcompressor.modifiers.quantization import QuantizationModifier
t_import = time.perf_counter() - t0
model = AutoModelForCausalLM.from_pretrained(src, dtype="auto")
recipe = QuantizationModifier(config_groups={"group_0": {"targets": ["Embedding"], "weights": weights}})
oneshot(model=model, recipe=recipe)
model.save_pretrained(out, save_compressed=True)
print(json.dumps({"import_s": t_import, "total_s": time.perf_counter() - t0}))
"""


def run_peer(work: Path, gemma: Path, repeat: int, inductor_cache: Path) -> list[dict]:
    setup = REPO / "scripts" / "setup_llmcompressor_venv.sh"
    try:
        py = subprocess.run(["bash", str(setup)], check=True, capture_output=True,
                            text=True).stdout.strip().splitlines()[-1]
    except (subprocess.CalledProcessError, IndexError) as e:
        log(f"llm-compressor venv unavailable ({e}); skipping the peer comparison")
        return []
    # embedq works on a private copy: the shards hard-linked (never modified in place),
    # the small files copied (config.json is edited).
    ck = work / "gemma3-270m"
    shutil.rmtree(ck, ignore_errors=True)
    from embedq.format.files import link_checkpoint
    link_checkpoint(gemma, ck)
    warm(table_info(ck, ["model.embed_tokens.weight"]))
    rows = []
    for label, (flags, weights) in PEER_SCHEMES.items():
        for i in range(repeat):
            out = work / "llmc-out"
            shutil.rmtree(out, ignore_errors=True)
            log(f"llm-compressor {label} (run {i + 1})")
            r = run_measured([py, "-c", LLMC_SCRIPT, str(gemma), str(out), json.dumps(weights)])
            ok = r["rc"] == 0
            inner = json.loads(r["stdout"].strip().splitlines()[-1]) if ok else {}
            rows.append({"tool": "llm-compressor", "scheme": label, "run": i + 1, "rc": r["rc"],
                         "wall_s": r["wall_s"], "cpu_s": r["cpu_s"], "peak_rss_mib": r["peak_rss_mib"],
                         "inner_s": inner.get("total_s"), "import_s": inner.get("import_s"),
                         "output_bytes": dir_bytes(out) if ok else None,
                         "stderr": "" if ok else r["stderr"][-3000:]})
            shutil.rmtree(out, ignore_errors=True)
            # embedq three ways: no compiled kernel on disk (a job this small then runs
            # the eager kernels), building one (forced: EMBEDQ_COMPILE_MIN_BYTES=0), and
            # with the kernel that run left in the cache.
            cache = inductor_cache / f"{label.replace(' ', '_')}-{i}"
            for variant, env in (("eager", {}), ("compiled, cold cache", {"EMBEDQ_COMPILE_MIN_BYTES": "0"}),
                                 ("compiled, cached", {})):
                log(f"embedq {label} {variant} (run {i + 1})")
                embedq_remove(ck)
                e = run_embedq(ck, flags, False, cache, env)
                rows.append({"tool": f"embedq ({variant})", "scheme": label, "run": i + 1, "rc": 0,
                             "wall_s": e["wall_s"], "cpu_s": e["cpu_s"], "peak_rss_mib": e["peak_rss_mib"],
                             "inner_s": e["report_seconds"], "output_bytes": e["overlay_file_bytes"]})
    embedq_remove(ck)
    return rows


# --- main ---------------------------------------------------------------------------------

STARTUP_PROBE = r"""
import os, sys, time
t0 = float(sys.argv[1])
import embedq.jobs.overlay as ov
first = []
orig = ov.stream_module
def stream_module(*a, **k):
    if not first:
        first.append(time.time())
    return orig(*a, **k)
ov.stream_module = stream_module
from embedq.jobs.quantize import quantize_checkpoint
from embedq.jobs.recipe import QuantizeRecipe
quantize_checkpoint(sys.argv[2], QuantizeRecipe.from_options(8, force=True, progress=False))
print(f"{first[0] - t0:.3f} {time.time() - t0:.3f}")
"""


def run_startup(gemma: Path, work: Path, repeat: int) -> dict:
    """Start-up costs on the Gemma 3 270M checkpoint, each in a fresh process:
    ``embedq inspect`` (the console command, wall), ``embedq quantize`` from process start
    to its first chunk (the CLI's environment: EMBEDQ_NO_TRANSFORMERS=1), and, for scale,
    a bare ``import torch``. The load average is recorded with them: on a loaded machine
    the numbers are the machine's as much as embedq's."""
    from embedq.format.files import link_checkpoint
    exe = Path(sys.executable).with_name("embedq")
    ck = link_checkpoint(gemma, work / "gemma3-startup")
    env = {**os.environ, "EMBEDQ_NO_TRANSFORMERS": "1"}
    out: dict = {"load_avg_before": os.getloadavg(), "inspect_s": [], "quantize_first_chunk_s": [],
                 "quantize_total_s": [], "import_torch_s": [], "cli_quantize_s": [], "cli_stages": []}
    for _ in range(repeat):
        r = run_measured([str(exe), "inspect", str(ck)], env=env)
        if r["rc"] != 0:
            raise SystemExit(f"embedq inspect failed:\n{r['stderr'][-2000:]}")
        out["inspect_s"].append(r["wall_s"])
        t0 = time.time()
        p = subprocess.run([sys.executable, "-c", STARTUP_PROBE, repr(t0), str(ck)], env=env,
                           capture_output=True, text=True)
        if p.returncode != 0:
            raise SystemExit(f"quantize start-up probe failed:\n{p.stderr[-2000:]}")
        first, total = map(float, p.stdout.split()[-2:])
        out["quantize_first_chunk_s"].append(first)
        out["quantize_total_s"].append(total)
        embedq_remove(ck)
        # The command a user types, end to end (fresh process, wall from wait4), profiled.
        prof = work / "gemma3-startup.profile.json"
        r = run_measured([sys.executable, "-m", "embedq.cli", "quantize", str(ck), "--force", "-q"],
                         env={**env, "EMBEDQ_PROFILE": str(prof)})
        if r["rc"] != 0:
            raise SystemExit(f"embedq quantize failed:\n{r['stderr'][-2000:]}")
        out["cli_quantize_s"].append(r["wall_s"])
        out["cli_stages"].append(stage_summary(json.loads(prof.read_text())))
        prof.unlink(missing_ok=True)
        embedq_remove(ck)
        r = run_measured([sys.executable, "-c", "import torch"])
        out["import_torch_s"].append(r["wall_s"])
    out["load_avg_after"] = os.getloadavg()
    shutil.rmtree(ck, ignore_errors=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="27b",
                    help="27b: 248,320 x 5,120 x 2 tables (5.1 GB); 14b: 152,064 x 5,120 x 2, "
                         "untied (3.1 GB); small: 65,536 x 2,048 x 2 (0.55 GB)")
    ap.add_argument("--small", action="store_true", help="the same as --shape small")
    ap.add_argument("--repeat", type=int, default=1, help="warm-cache runs per scheme (after the cold one)")
    ap.add_argument("--copy-repeat", type=int, default=3)
    ap.add_argument("--skip-peer", action="store_true", help="no llm-compressor / Gemma comparison")
    ap.add_argument("--skip-synthetic", action="store_true", help="only the Gemma comparison")
    ap.add_argument("--peer-repeat", type=int, default=1)
    ap.add_argument("--schemes", default=",".join(SCHEMES), help="comma-separated subset of: " + ", ".join(SCHEMES))
    ap.add_argument("--out", type=Path, default=REPO / "bench-results")
    ap.add_argument("--skip-startup", action="store_true", help="no start-up section")
    ap.add_argument("--startup-only", action="store_true", help="only the start-up section")
    ap.add_argument("--startup-repeat", type=int, default=3)
    args = ap.parse_args()
    bad = [x.strip() for x in args.schemes.split(",") if x.strip() and x.strip() not in SCHEMES]
    if bad:  # before minutes of synthesis, not a KeyError after them
        ap.error(f"--schemes: unknown {', '.join(map(repr, bad))}; choose from {', '.join(map(repr, SCHEMES))}")

    spec = SMALL if args.small else SHAPES[args.shape]
    root = cache_root() / "bench"
    root.mkdir(parents=True, exist_ok=True)
    result = {"machine": machine(), "spec": spec, "started": _dt.datetime.now().isoformat(timespec="seconds")}
    log(f"machine: {result['machine']}")
    tmp_caches = Path(tempfile.mkdtemp(prefix="embedq-bench-inductor-"))
    out_lines = []
    if args.startup_only:
        args.skip_synthetic = args.skip_peer = True
    try:
        if not args.skip_startup:
            sys.path.insert(0, str(REPO / "scripts"))
            from make_gemma3_fixture import ensure_gemma3_270m
            st = run_startup(Path(ensure_gemma3_270m()), root, args.startup_repeat)
            result["startup"] = st
            med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
            rows = [[name, f"{min(st[k]):.2f}", f"{med(st[k]):.2f}", f"{max(st[k]):.2f}", goal]
                    for name, k, goal in [
                        ("embedq inspect (wall)", "inspect_s", "<= 2"),
                        ("embedq quantize: start -> first chunk", "quantize_first_chunk_s", "<= 3"),
                        ("embedq quantize: whole run", "quantize_total_s", ""),
                        ("python -m embedq.cli quantize (end to end)", "cli_quantize_s", "<= 3.0"),
                        ("python -c 'import torch' (for scale)", "import_torch_s", "")]]
            out_lines += [f"Start-up on Gemma 3 270M, fresh process each, {args.startup_repeat} runs; "
                          f"load average {st['load_avg_before'][0]:.2f} before, "
                          f"{st['load_avg_after'][0]:.2f} after",
                          fmt_table(rows, ["step", "min s", "median s", "max s", "goal s"]), ""]
            if st["cli_stages"]:
                cols = [k for k, _ in STAGE_GROUPS] + ["other", "process CPU"]
                out_lines += ["CPU seconds per stage of the end-to-end Gemma runs (EMBEDQ_PROFILE)",
                              fmt_table([[str(i + 1)] + [f"{s[c]:.2f}" for c in cols]
                                         for i, s in enumerate(st["cli_stages"])], ["run"] + cols), ""]
        if not args.skip_synthetic:
            ckpt = synthesize(spec, root)
            embedq_remove(ckpt)
            tables = table_info(ckpt, ["model.embed_tokens.weight", "lm_head.weight"])
            src_bytes = sum(n for _, _, n in tables)
            result["checkpoint"] = {"path": str(ckpt), "table_bytes": src_bytes,
                                    "total_bytes": dir_bytes(ckpt)}
            runs = []
            for label in [s.strip() for s in args.schemes.split(",") if s.strip()]:
                flags = SCHEMES[label]
                bits = int(flags[1])
                group = int(flags[3]) if "--group-size" in flags else None
                ob = overlay_bytes(spec["vocab"], spec["hidden"], bits, group, 2)
                cache = tmp_caches / label.replace(" ", "_")  # empty: the first run builds its kernel
                for i in range(1 + args.repeat):
                    # Baseline and candidate interleaved: the copy is re-measured right before
                    # each run, so both see the same machine load.
                    warm(tables)
                    copy_nf = min(copy_baseline(tables, ob, ckpt, False) for _ in range(args.copy_repeat))
                    copy_fs = min(copy_baseline(tables, ob, ckpt, True) for _ in range(args.copy_repeat))
                    warm(tables)
                    log(f"embedq {label} run {i + 1} ({'cold' if i == 0 else 'warm'} kernel cache)")
                    load0 = os.getloadavg()[0]
                    r = run_embedq(ckpt, flags, True, cache)
                    r["load_avg"] = (load0, os.getloadavg()[0])
                    embedq_remove(ckpt)
                    r.update(scheme=label, run=i + 1, compile_cache="cold" if i == 0 else "warm",
                             copy_s=copy_nf, copy_fsync_s=copy_fs, out_bytes_expected=ob,
                             gb_per_s=src_bytes / r["wall_s"] / 1e9,
                             x_copy=r["wall_s"] / copy_nf, x_copy_fsync=r["wall_s"] / copy_fs)
                    runs.append(r)
            result["synthetic"] = runs
            head = ["scheme", "kernel cache", "wall s", "CPU s", "peak RSS MiB", "GB/s",
                    "copy s", "copy+fsync s", "x copy", "x copy+fsync", "load avg"]
            rows = [[r["scheme"], r["compile_cache"], f"{r['wall_s']:.2f}", f"{r['cpu_s']:.2f}",
                     f"{r['peak_rss_mib']:.0f}", f"{r['gb_per_s']:.2f}", f"{r['copy_s']:.2f}",
                     f"{r['copy_fsync_s']:.2f}", f"{r['x_copy']:.2f}", f"{r['x_copy_fsync']:.2f}",
                     "%.1f-%.1f" % tuple(r["load_avg"])]
                    for r in runs]
            out_lines += [f"embedq quantize --lm-head on {spec['name']} "
                          f"({spec['vocab']:,} x {spec['hidden']:,} bf16 x 2 tables = {src_bytes / 1e9:.2f} GB)",
                          fmt_table(rows, head), "",
                          "CPU seconds per stage of the same runs (EMBEDQ_PROFILE; 'named %': the stages' "
                          "share of the process CPU time, children included)",
                          stage_table(runs), ""]
        if not args.skip_peer:
            sys.path.insert(0, str(REPO / "scripts"))
            from make_gemma3_fixture import ensure_gemma3_270m
            gemma = Path(ensure_gemma3_270m())
            peer = run_peer(root / "peer", gemma, args.peer_repeat, tmp_caches / "gemma")
            result["peer"] = peer
            if peer:
                head = ["tool", "scheme", "wall s", "CPU s", "peak RSS MiB", "output MB", "speed-up", "less memory"]
                rows = []
                by = {(r["tool"], r["scheme"], r["run"]): r for r in peer}
                for r in peer:
                    other = by.get(("llm-compressor", r["scheme"], r["run"]))
                    su = f"{other['wall_s'] / r['wall_s']:.1f}x" if r["tool"].startswith("embedq") and other and other["rc"] == 0 else ""
                    mem = f"{other['peak_rss_mib'] / r['peak_rss_mib']:.1f}x" if su else ""
                    rows.append([r["tool"], r["scheme"], f"{r['wall_s']:.2f}", f"{r['cpu_s']:.2f}",
                                 f"{r['peak_rss_mib']:.0f}",
                                 "-" if r["output_bytes"] is None else f"{r['output_bytes'] / 1e6:.0f}", su, mem])
                out_lines += ["Gemma 3 270M (262,144 x 640 bf16 embedding, tied): embedq vs llm-compressor "
                              "(fresh process each, wall includes Python start-up and imports)",
                              fmt_table(rows, head), ""]
    finally:
        shutil.rmtree(tmp_caches, ignore_errors=True)
    result["machine"]["load_avg_end"] = os.getloadavg()
    m = result["machine"]
    out_lines.append(f"machine: {m['cpu']}, {m['cores']} cores, {m['mem_gib']} GiB RAM, "
                     f"torch {m['torch']}, Linux {m['kernel']}; load average at start "
                     f"{m['load_avg_start'][0]:.2f}, at end {m['load_avg_end'][0]:.2f}")
    text = "\n".join(out_lines)
    print(text)
    result["table"] = text
    args.out.mkdir(parents=True, exist_ok=True)
    dest = args.out / f"bench-{spec['name']}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    dest.write_text(json.dumps(result, indent=2, default=str))
    log(f"wrote {dest}")


if __name__ == "__main__":
    main()
