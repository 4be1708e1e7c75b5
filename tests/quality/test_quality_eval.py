"""embedq eval: KLD of an identity overlay is 0; of a real one, > 0 and equal to a hand computation."""

from __future__ import annotations

import json
import math

import pytest
import torch
import transformers
from typer.testing import CliRunner

import embedq
from embedq.cli import app
from embedq.quality.evaluate import EvalError, load_reference, make_contexts, text_contexts
from qualutil import add_tokenizer, dequantized_reference, head_operands, logit_bound, set_table

TOKENS = [int(x) for x in torch.randint(3, 500, (70,), generator=torch.Generator().manual_seed(1))]
BOS = 1


def _exact_table(rows: int, cols: int) -> torch.Tensor:
    """Integers in [-127, 127] times 2^-7, every row reaching 127: int8 per-row is exact."""
    g = torch.Generator().manual_seed(0)
    q = torch.randint(-127, 128, (rows, cols), generator=g).float()
    q[:, 0] = 127.0
    return q * 2.0 ** -7


def test_identity_overlay_has_zero_kld(model_factory):
    src = model_factory("qwen2_tied")
    set_table(src, "model.embed_tokens.weight", _exact_table(512, 64))
    rep = embedq.quantize(src, bits=8, progress=False)
    assert rep.modules[0].max_abs_error == 0.0
    r = embedq.evaluate(src, tokens=TOKENS, contexts=3, length=8, bos=BOS, progress=False)
    # The table is exact, so the only difference left is the head kernel's float32 summation
    # order (the native CPU kernels sum in another order than F.linear): logits differ by
    # ~K * 2^-24 * sum|x*w| (~1e-6 here), and KLD is second order in that: <= ~1e-12.
    assert 0.0 <= r.mean_kld <= 1e-12 and 0.0 <= r.kld_max <= 1e-12
    assert max(abs(c) for c in r.kld_ci95) <= 1e-12
    assert r.same_top1 == 100.0
    assert abs(r.ppl_reference - r.ppl_quantized) <= 1e-5 * r.ppl_reference
    assert r.tokens == 3 * 7


def _by_hand(src, overlay, contexts):
    """Mean KLD / same-top-1 / perplexities computed directly from two float models, and how
    far ``embedq eval`` may be from them.

    evaluate's quantized head sums in another order than the dequantized model's float32
    F.linear (the kernel per CPU, MKL's path per CPU), so its logits differ from these by up
    to B = max_j logit_bound per token (float32). Then, with Δl the logit error:
    KL(p||q') - KL(p||q) = -E_p[Δl] + log E_q[exp Δl], within |E_q Δl - E_p Δl| + B²/2
    (Hoeffding) <= ||p - q||_1 B + B²/2 <= sqrt(2 KL(p||q)) B + B²/2 (Pinsker); each
    log-probability moves by at most 2B.
    """
    cls = transformers.AutoModelForCausalLM
    ref = load_reference(src, cls, torch.float32)
    deq = dequantized_reference(src, overlay, cls, dtype=torch.float32)
    kl, bounds, same, nll_r, nll_q = [], [], 0, 0.0, 0.0
    with torch.no_grad():
        for row in contexts:
            ids = torch.tensor([row])
            p = torch.softmax(ref(ids).logits[0, :-1].double(), -1)
            logits, x, w = head_operands(deq, ids)
            q = torch.softmax(logits[0, :-1].double(), -1)
            kl += (p * (p.log() - q.log())).sum(-1).tolist()
            la = logits[0, :-1]
            bounds += logit_bound(x[0, :-1], w, la, la).amax(-1).tolist()
            same += int((p.argmax(-1) == q.argmax(-1)).sum())
            nxt = ids[0, 1:]
            nll_r -= float(p[torch.arange(len(nxt)), nxt].log().sum())
            nll_q -= float(q[torch.arange(len(nxt)), nxt].log().sum())
    n = len(kl)
    err = [math.sqrt(2 * max(k, 0.0)) * b + b * b / 2 for k, b in zip(kl, bounds)]
    return {"mean_kld": sum(kl) / n, "kld_max": max(kl), "same_top1": 100.0 * same / n,
            "ppl_reference": math.exp(nll_r / n), "ppl_quantized": math.exp(nll_q / n), "tokens": n,
            "kld_tol": sum(err) / n, "kld_max_tol": max(err), "logprob_tol": 2 * max(bounds)}


@pytest.mark.parametrize("kind,kw", [("qwen2_tied", dict(bits=4)),
                                     ("llama_untied_sharded", dict(bits=4, lm_head=True, symmetric=False)),
                                     ("gemma3_tied", dict(bits=8))])
def test_perturbed_table_kld_matches_hand_computation(model_factory, kind, kw):
    src = model_factory(kind)
    embedq.quantize(src, progress=False, **kw)
    r = embedq.evaluate(src, tokens=TOKENS, contexts=3, length=8, bos=BOS, progress=False)
    # contexts by hand: 70 tokens = 10 windows of 7; windows 0, 3 and 6, each after BOS
    ctx = [[BOS] + TOKENS[k * 7:(k + 1) * 7] for k in (0, 3, 6)]
    assert make_contexts(TOKENS, 3, 8, BOS).tolist() == ctx
    hand = _by_hand(src, src, ctx)
    assert r.mean_kld > 0
    # the derived bounds of _by_hand (float32 summation order), never looser than 1e-6 relative
    # would be meaningless: they stay a small fraction of the KLD measured
    assert hand["kld_tol"] < 0.05 * hand["mean_kld"]
    assert r.mean_kld == pytest.approx(hand["mean_kld"], rel=1e-6, abs=hand["kld_tol"])
    assert r.kld_max == pytest.approx(hand["kld_max"], rel=1e-6, abs=hand["kld_max_tol"])
    assert r.same_top1 == pytest.approx(hand["same_top1"])
    assert r.ppl_reference == pytest.approx(hand["ppl_reference"], rel=1e-9)
    ppl_tol = math.expm1(hand["logprob_tol"])  # each log-probability within 2B
    assert r.ppl_quantized == pytest.approx(hand["ppl_quantized"], rel=max(ppl_tol, 1e-6))
    assert r.delta_ppl == pytest.approx(hand["ppl_quantized"] - hand["ppl_reference"],
                                        abs=max(ppl_tol, 1e-6) * hand["ppl_quantized"] + 1e-9)
    assert r.tokens == hand["tokens"]
    lo, hi = r.kld_ci95
    assert lo <= r.mean_kld <= hi
    assert r.kld_p50 <= r.kld_p90 <= r.kld_p99 <= r.kld_max
    assert len(r.per_context) == 3
    assert sum(c["mean_kld"] * c["tokens"] for c in r.per_context) / r.tokens == pytest.approx(r.mean_kld)


def test_float_head_measures_the_gather_only(model_factory):
    src = model_factory("qwen2_tied")
    embedq.quantize(src, bits=4, progress=False)
    full = embedq.evaluate(src, tokens=TOKENS, contexts=3, length=8, bos=BOS, progress=False)
    gather = embedq.evaluate(src, tokens=TOKENS, contexts=3, length=8, bos=BOS, float_head=True,
                             progress=False)
    assert gather.modules == {"model.embed_tokens": "int4 g32 sym"}
    assert 0 < gather.mean_kld != full.mean_kld


def test_derived_checkpoint_needs_its_source(model_factory, tmp_path):
    src = model_factory("qwen2_tied")
    out = tmp_path / "derived"
    embedq.quantize(src, bits=4, output=out, progress=False)
    with pytest.raises(EvalError, match="--reference"):
        embedq.evaluate(out, tokens=TOKENS, contexts=3, length=8, bos=BOS, progress=False)
    d = embedq.evaluate(out, reference=src, tokens=TOKENS, contexts=3, length=8, bos=BOS, progress=False)
    embedq.quantize(src, bits=4, progress=False)
    i = embedq.evaluate(src, tokens=TOKENS, contexts=3, length=8, bos=BOS, progress=False)
    assert d.mean_kld == i.mean_kld and d.same_top1 == i.same_top1


def test_contexts_from_text_start_with_bos_and_do_not_overlap(model_factory):
    src = model_factory("qwen2_tied")
    add_tokenizer(src, 512)
    tok = transformers.AutoTokenizer.from_pretrained(str(src))
    text = "\n".join(f"line {i}: " + "word " * (i % 7) for i in range(400))
    ctx = text_contexts(tok, text, 5, 16, tok.bos_token_id)
    assert ctx.shape == (5, 16) and (ctx[:, 0] == tok.bos_token_id).all()
    assert (ctx[:, 1:] != tok.bos_token_id).all()
    decoded = [tok.decode(r[1:]) for r in ctx]
    starts = [text.find(d) for d in decoded]
    assert all(s >= 0 for s in starts) and starts == sorted(starts)
    assert all(a + len(d) <= b for a, b, d in zip(starts, starts[1:], decoded))
    with pytest.raises(EvalError, match="too short"):
        text_contexts(tok, "tiny text", 3, 64, tok.bos_token_id)


def test_cli_eval_json_matches_python_api(model_factory, tmp_path):
    src = model_factory("qwen2_tied")
    add_tokenizer(src, 512)
    embedq.quantize(src, bits=4, progress=False)
    text = tmp_path / "t.txt"
    text.write_text("\n".join(f"The {i}th line says something about Python {i % 13}." for i in range(300)))
    res = CliRunner().invoke(app, ["eval", str(src), "--text", str(text), "--contexts", "4", "--length", "24",
                                   "--json"])
    assert res.exit_code == 0, res.output
    d = json.loads(res.stdout)
    api = embedq.evaluate(src, text=text, contexts=4, length=24, progress=False)
    for k in ("mean_kld", "kld_p99", "same_top1", "delta_ppl", "tokens"):
        assert d[k] == getattr(api, k)
    assert d["kld_ci95"] == list(api.kld_ci95)
    assert d["bos"] and d["text"] == str(text)
    # the default text (Python's bundled docs) also works, and the table prints
    res = CliRunner().invoke(app, ["eval", str(src), "--contexts", "2", "--length", "16", "-q"])
    assert res.exit_code == 0, res.output
    assert "mean KLD" in res.output and "pydoc_data/topics.py" in res.output


def test_cli_eval_errors_are_one_line(model_factory, tmp_path):
    src = model_factory("qwen2_tied")
    res = CliRunner().invoke(app, ["eval", str(src)])
    assert res.exit_code == 2 and str(src) in res.output and "no embedq overlay" in res.output
    embedq.quantize(src, bits=8, progress=False)
    res = CliRunner().invoke(app, ["eval", str(src), "--text", str(tmp_path / "missing.txt")])
    assert res.exit_code == 2 and "missing.txt: text file not found" in res.output


def test_bf16_floor_is_the_float_model_run_in_bf16(model_factory):
    """A bf16 checkpoint gets the noise floor by default: the float model in bfloat16 vs float32."""
    src = model_factory("qwen2_tied")
    embedq.quantize(src, bits=8, progress=False)
    r = embedq.evaluate(src, tokens=TOKENS, contexts=3, length=8, bos=BOS, progress=False)
    ctx = make_contexts(TOKENS, 3, 8, BOS)
    cls = transformers.AutoModelForCausalLM
    ref, low = load_reference(src, cls, torch.float32), load_reference(src, cls, torch.bfloat16)
    kl = []
    with torch.no_grad():
        for ids in ctx:
            p = torch.log_softmax(ref(ids[None]).logits[0, :-1].double(), -1)
            q = torch.log_softmax(low(ids[None]).logits[0, :-1].float().double(), -1)
            kl += (p.exp() * (p - q)).sum(-1).clamp_min(0).tolist()
    assert r.floor_kld > 0 and r.floor_kld == pytest.approx(sum(kl) / len(kl), rel=1e-6)
    assert r.floor_kld_ci95[0] <= r.floor_kld <= r.floor_kld_ci95[1]
    assert 0 <= r.floor_same_top1 <= 100
    assert "bf16 floor" in r.table() and "x)" in r.table()
    off = embedq.evaluate(src, tokens=TOKENS, contexts=3, length=8, bos=BOS, progress=False, floor=False)
    assert off.floor_kld is None and "bf16 floor" not in off.table()
    assert off.mean_kld == r.mean_kld  # the floor adds a model, changes nothing else
    with pytest.raises(EvalError, match="float32 reference"):
        embedq.evaluate(src, tokens=TOKENS, contexts=3, length=8, bos=BOS, progress=False, floor=True,
                        dtype="bfloat16")
    bf = embedq.evaluate(src, tokens=TOKENS, contexts=3, length=8, bos=BOS, progress=False, dtype="bfloat16")
    assert bf.floor_kld is None  # not measured against a bf16 computation


def test_cli_eval_floor_flag(model_factory, tmp_path):
    src = model_factory("qwen2_tied")
    add_tokenizer(src, 512)
    embedq.quantize(src, bits=8, progress=False)
    text = tmp_path / "t.txt"
    text.write_text("\n".join(f"The {i}th line says something about Python {i % 13}." for i in range(300)))
    res = CliRunner().invoke(app, ["eval", str(src), "--text", str(text), "--contexts", "2", "--length", "16",
                                   "--no-floor", "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["floor_kld"] is None
    res = CliRunner().invoke(app, ["eval", str(src), "--text", str(text), "--contexts", "2", "--length", "16",
                                   "--floor", "--dtype", "bfloat16"])
    assert res.exit_code == 2 and "float32 reference" in res.output


def test_eval_measures_the_int8_activation_opt_in(model_factory, monkeypatch):
    """``embedq eval --activations int8``: the 4-bit head served with int8 activations (what
    the opt-in costs), said in the result; 8-bit heads stay exact and say so; a bad value is
    one line naming the flag."""
    from embedq.kernels import dispatch
    if dispatch.layout_unavailable("native"):
        pytest.skip(dispatch.layout_unavailable("native"))
    monkeypatch.delenv("EMBEDQ_ACTIVATIONS", raising=False)
    src = model_factory("qwen2_tied")
    embedq.quantize(src, bits=4, progress=False)
    kw = dict(tokens=TOKENS, contexts=3, length=8, bos=BOS, progress=False, floor=False)
    exact = embedq.evaluate(src, **kw)
    a8 = embedq.evaluate(src, activations="int8", **kw)
    assert exact.activations == "exact" and a8.activations == "int8"
    assert a8.mean_kld != exact.mean_kld and "(int8 activations)" in a8.table()
    res = CliRunner().invoke(app, ["eval", str(src), "--activations", "int4", "--contexts", "2"])
    assert res.exit_code != 0 and "--activations" in res.output and "Traceback" not in res.output
    assert len(res.output.strip().splitlines()) == 1, res.output
    embedq.quantize(src, bits=8, progress=False, force=True)
    assert embedq.evaluate(src, activations="int8", **kw).activations == "exact"
