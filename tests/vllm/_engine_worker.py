"""One vLLM engine run (a fresh process per model): greedy ``LLM.generate`` with the
top-2 logprobs of every step.

    python _engine_worker.py MODEL_DIR OUT.json PROMPTS.json MAX_TOKENS [LLM_KWARGS.json]

PROMPTS.json: a list of prompts, each a string or a list of token ids; LLM_KWARGS.json:
more keyword arguments of ``LLM`` (e.g. speculative_config). Writes {"tokens": [[...], ...],
"top2": [[[lp1, lp2], ...], ...], "kinds": {...}, "metrics": {spec-decode counters}}.
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engine core in this process
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; the default grabs most of RAM

from _harness import configure_env  # noqa: E402

configure_env()


def break_drafter() -> None:
    """Mutation (EMBEDQ_TEST_BREAK_DRAFTER=<model folder name>, e.g. q8): that model's MTP
    drafter reads its head's rows one off (its logits rolled by one along the vocabulary),
    the target untouched; test_vllm_engine.py's acceptance check must then fail."""
    from vllm.model_executor.models.qwen3_5_mtp import Qwen3_5MTP
    logits, top = Qwen3_5MTP.compute_logits, Qwen3_5MTP.get_top_tokens

    def compute_logits(self, *a, **k):
        y = logits(self, *a, **k)
        return None if y is None else y.roll(1, dims=-1)

    def get_top_tokens(self, *a, **k):  # the greedy proposer's local argmax
        return (top(self, *a, **k) + 1) % self.lm_head.org_vocab_size
    Qwen3_5MTP.compute_logits, Qwen3_5MTP.get_top_tokens = compute_logits, get_top_tokens


def main() -> None:
    model_dir, out, prompts_file, max_tokens = sys.argv[1:5]
    extra = json.loads(open(sys.argv[5]).read()) if len(sys.argv) > 5 else {}
    if os.environ.get("EMBEDQ_TEST_BREAK_DRAFTER", "") == os.path.basename(model_dir.rstrip("/")):
        break_drafter()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    prompts = json.loads(open(prompts_file).read())
    token_prompts = all(isinstance(p, list) for p in prompts)
    llm = LLM(model=model_dir, dtype="bfloat16", max_model_len=256, max_num_seqs=4, seed=0,
              skip_tokenizer_init=token_prompts, disable_log_stats=False, **extra)
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
    with open(out, "w") as f:
        json.dump({"tokens": tokens, "top2": top2, "kinds": kinds, "metrics": metrics}, f)


if __name__ == "__main__":
    main()
