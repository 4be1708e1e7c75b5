"""Where a transformers KV-cached decode step spends its time: the float model vs embedq's.

    python scripts/profile_decode.py [--dtype bf16|f32] [--schemes int8g64 q4g32] [-n 3] [--ops]

Why: bench_serve.py's ``hf`` section measured decode at batch 1 below the float model
(AMD EPYC AVX2: 0.90x / 0.88x) although the head alone is 2.5x faster there. This times,
per generated token (median over the 32 steps, models interleaved round by round), the
whole step, the head (lm_head forward) and the embedding gather, with forward hooks; with
``--ops`` a torch.profiler table per model (self CPU time). Run it alone: it prints the
load average beside every round.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib as bl  # noqa: E402


def hooked(model) -> tuple[dict[str, list[float]], list]:
    """Per-call wall times of the head and the embedding, recorded by forward hooks."""
    rec = {"head": [], "emb": []}
    hooks = []
    for name, mod in (("head", model.get_output_embeddings()), ("emb", model.get_input_embeddings())):
        def pre(m, inp):
            m._embedq_t0 = time.perf_counter()

        def post(m, inp, out, name=name):
            rec[name].append(time.perf_counter() - m._embedq_t0)
        hooks += [mod.register_forward_pre_hook(pre), mod.register_forward_hook(post)]
    return rec, hooks


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", choices=["bf16", "f32"], default="bf16")
    ap.add_argument("--schemes", nargs="+", default=["int8g64", "q4g32"])
    ap.add_argument("-n", type=int, default=3, help="rounds")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--ops", action="store_true", help="a torch.profiler table per model")
    ap.add_argument("--workdir", type=Path, default=Path.home() / ".cache/embedq/bench-serve")
    args = ap.parse_args()
    import transformers
    import embedq
    dtype = {"bf16": torch.bfloat16, "f32": torch.float32}[args.dtype]
    paths = bl.gemma_models(args.workdir)
    models = {"float": transformers.AutoModelForCausalLM.from_pretrained(paths["float"], dtype=dtype)}
    for k in args.schemes:
        models[k] = embedq.load(str(paths[k]), dtype=dtype)
    print(f"== decode step, Gemma 3 270M {args.dtype}, batch 1, {args.new_tokens} tokens on "
          f"{bl.cpu_model()}, torch threads {torch.get_num_threads()}", flush=True)
    ids = torch.tensor([bl.PROMPT])
    n = args.new_tokens
    med = statistics.median
    with torch.inference_mode():
        for m in models.values():  # warm-up
            m.generate(ids, max_new_tokens=4, min_new_tokens=4, do_sample=False)
        for r in range(args.n):
            print(f"-- round {r} (load {bl.load()})", flush=True)
            names = list(models)
            for k in names[r % len(names):] + names[:r % len(names)]:
                rec, hooks = hooked(models[k])
                t0 = time.perf_counter()
                models[k].generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
                total = (time.perf_counter() - t0) / n
                for h in hooks:
                    h.remove()
                # the first call of each is the prompt (prefill): decode steps only
                head, emb = rec["head"][1:], rec["emb"][1:]
                print(f"   {k:8s} {total * 1e3:6.1f} ms/token   head {med(head) * 1e3:6.2f} ms   "
                      f"embedding {med(emb) * 1e3:6.3f} ms   rest {(total - med(head) - med(emb)) * 1e3:6.1f} ms",
                      flush=True)
        if args.ops:
            from torch.profiler import ProfilerActivity, profile
            for k, m in models.items():
                with profile(activities=[ProfilerActivity.CPU]) as p:
                    m.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
                print(f"-- {k}: torch.profiler, self CPU time")
                print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))


if __name__ == "__main__":
    main()
