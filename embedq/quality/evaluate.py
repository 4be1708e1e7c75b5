"""``embedq eval``: what an overlay costs in quality, measured as KL divergence.

The reference is the float checkpoint *without* the overlay; the quantized model is the
overlay-loaded one (:func:`embedq.load`). Like llama.cpp's ``perplexity
--kl-divergence``, the text is cut into contexts of ``length`` tokens that each start
with BOS (Gemma 3 without BOS behaves abnormally and inflates KLD several times); both
models run context by context and only one context's logits exist at a time.

Reported, over the ``contexts * (length - 1)`` scored positions (every position but the
last of each context, which has no next token to score perplexity against):

- mean KLD(P_ref || P_quant) in nats, with a bootstrap 95% CI over contexts;
- per-token KLD percentiles p50 / p90 / p99 / max;
- same-top-1 %: how often both models' most likely next token agree (with CI);
- perplexity of both models on the text and Δ perplexity (with CI);
- the bf16 noise floor (``floor``; automatic for a bf16 checkpoint computed in float32):
  the same statistics for the float model itself run in bfloat16 — the error users
  already accept — so an overlay's KLD can be read against it.

Default text: ``pydoc_data/topics.py`` of the running Python — the reference-manual
topics that ``help()`` shows, shipped with every CPython. It varies a little between
Python versions; results name the version (``text`` in the result).
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from embedq.errors import EmbedqError, EvalError
from embedq.jobs.advice import LOSSY_KLD, LOSSY_TOP1, MEASURED_GEMMA3_270M, scheme_advice  # noqa: F401  (re-exported)
from embedq.jobs.calibration import (config_bos, default_text, load_reference, load_tokenizer,  # noqa: F401
                                     make_contexts, quiet_transformers, read_text, text_contexts)
from embedq.format.config import OverlayConfig
from embedq.format.constants import is_head_name

DEFAULT_CONTEXTS = 12
DEFAULT_LENGTH = 128
BOOTSTRAP_SAMPLES = 2000
# Positions per float64 log-softmax block (bounds temporaries to ~3 x 64 x vocab doubles).
_POS_BLOCK = 32


@dataclass
class EvalResult:
    """Numbers of one ``embedq eval`` run (``str()`` is the printable report)."""

    path: str
    reference: str
    text: str
    contexts: int
    length: int
    tokens: int  # scored positions
    dtype: str
    modules: dict[str, str]  # module -> scheme label (aliases included)
    float_head: bool
    mean_kld: float
    kld_ci95: tuple[float, float]
    kld_p50: float
    kld_p90: float
    kld_p99: float
    kld_max: float
    same_top1: float  # percent
    same_top1_ci95: tuple[float, float]
    ppl_reference: float
    ppl_quantized: float
    delta_ppl: float
    delta_ppl_ci95: tuple[float, float]
    per_context: list[dict] = field(default_factory=list)
    seconds: float = 0.0
    bos: bool = True
    # the float model run in bfloat16 vs the reference (None: not measured)
    floor_kld: float | None = None
    floor_kld_ci95: tuple[float, float] | None = None
    floor_same_top1: float | None = None
    activations: str = "exact"  # "int8": the head's input rounded (the serving opt-in)

    def to_dict(self) -> dict:
        return asdict(self)

    def to_json(self, **kw) -> str:
        return json.dumps(self.to_dict(), indent=2, **kw)

    def table(self) -> str:
        mods = ", ".join(f"{m}: {s}" for m, s in self.modules.items())
        head = " (head kept float)" if self.float_head else ""
        head += " (int8 activations)" if self.activations == "int8" else ""
        lo, hi = self.kld_ci95
        tlo, thi = self.same_top1_ci95
        dlo, dhi = self.delta_ppl_ci95
        lines = [
            f"{self.path} vs {self.reference}{head}",
            f"  modules: {mods}",
            f"  {self.contexts} contexts x {self.length} tokens (BOS first), {self.tokens} scored; "
            f"text: {self.text}; dtype {self.dtype}; {self.seconds:.0f} s",
            f"  mean KLD        {self.mean_kld:.6f}   95% CI [{lo:.6f}, {hi:.6f}]",
            f"  KLD p50/p90/p99 {self.kld_p50:.6f} / {self.kld_p90:.6f} / {self.kld_p99:.6f}   "
            f"max {self.kld_max:.6f}",
            f"  same top-1      {self.same_top1:.2f}%   95% CI [{tlo:.2f}, {thi:.2f}]",
            f"  perplexity      {self.ppl_reference:.4f} -> {self.ppl_quantized:.4f}   "
            f"Δ {self.delta_ppl:+.4f}   95% CI [{dlo:+.4f}, {dhi:+.4f}]",
        ]
        if self.floor_kld is not None:
            flo, fhi = self.floor_kld_ci95
            ratio = self.mean_kld / self.floor_kld if self.floor_kld > 0 else math.inf
            lines.append(f"  bf16 floor      mean KLD {self.floor_kld:.6f}   95% CI [{flo:.6f}, {fhi:.6f}]   "
                         f"same top-1 {self.floor_same_top1:.2f}%  (the float model run in bfloat16; "
                         f"the overlay: {ratio:.2f}x)")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


# ---------------------------------------------------------------------------------------
# per-context statistics


@torch.no_grad()
def token_stats(ref_logits: torch.Tensor, q_logits: torch.Tensor, targets: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per position: KLD(ref || quant), same-top-1, NLL ref, NLL quant (float64 math).

    ``*_logits``: [n, vocab]; ``targets``: [n] next tokens.
    """
    return token_stats_many(ref_logits, [q_logits], targets)[0]


@torch.no_grad()
def token_stats_many(ref_logits: torch.Tensor, q_logits: list[torch.Tensor], targets: torch.Tensor
                     ) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """:func:`token_stats` of several models against one reference: the reference's
    float64 ``log_softmax`` over the 262k-token vocabulary is computed once per block."""
    out = [([], [], [], []) for _ in q_logits]
    for a in range(0, ref_logits.shape[0], _POS_BLOCK):
        r = torch.log_softmax(ref_logits[a:a + _POS_BLOCK].double(), dim=-1)
        pr, top_r = r.exp(), ref_logits[a:a + _POS_BLOCK].argmax(-1)
        t = targets[a:a + _POS_BLOCK].unsqueeze(-1)
        nll_r = -r.gather(-1, t).squeeze(-1)
        for lq, o in zip(q_logits, out):
            q = torch.log_softmax(lq[a:a + _POS_BLOCK].double(), dim=-1)
            o[0].append((pr * (r - q)).sum(-1).clamp_min(0.0))
            o[1].append(top_r == lq[a:a + _POS_BLOCK].argmax(-1))
            o[2].append(nll_r)
            o[3].append(-q.gather(-1, t).squeeze(-1))
    return [tuple(torch.cat(x) for x in o) for o in out]  # type: ignore[misc]


def _bootstrap(per_ctx: dict[str, torch.Tensor], samples: int, seed: int) -> dict[str, tuple[float, float]]:
    """Percentile 95% CIs of mean KLD, same-top-1 % and Δppl, resampling contexts."""
    n = per_ctx["n"].numel()
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, n, (samples, n), generator=g)
    tok = per_ctx["n"][idx].sum(1)
    kld = per_ctx["kld"][idx].sum(1) / tok
    top = 100.0 * per_ctx["same"][idx].sum(1) / tok
    dppl = torch.exp(per_ctx["nll_q"][idx].sum(1) / tok) - torch.exp(per_ctx["nll_r"][idx].sum(1) / tok)

    def ci(x):
        qs = torch.quantile(x.double(), torch.tensor([0.025, 0.975], dtype=torch.float64))
        return float(qs[0]), float(qs[1])
    return {"kld": ci(kld), "same": ci(top), "dppl": ci(dppl)}


def compare_models(reference, quantized, contexts: torch.Tensor, *, bootstrap: int = BOOTSTRAP_SAMPLES,
                   seed: int = 0, progress: bool = False, floor=None) -> dict:
    """Run both models context by context; return the aggregated statistics.

    ``contexts``: [n, length] token ids. Never holds more than one context's logits (of
    each model).
    ``floor``: a third model (the float one in bf16) measured against the reference the
    same way; its mean KLD, CI and same-top-1 come back as ``floor_*``.
    """
    all_kld, per = [], {"kld": [], "same": [], "nll_r": [], "nll_q": [], "n": []}
    fl = {"kld": [], "same": [], "nll_r": [], "nll_q": [], "n": []}
    it = range(contexts.shape[0])
    if progress:
        from tqdm.auto import tqdm
        it = tqdm(it, desc="eval", unit="ctx", leave=False)
    dev_r = _device_of(reference)
    dev_q = _device_of(quantized)
    for i in it:
        ids = contexts[i:i + 1]
        with torch.inference_mode():
            lr = reference(input_ids=ids.to(dev_r), use_cache=False).logits[0, :-1].float().cpu()
            lq = quantized(input_ids=ids.to(dev_q), use_cache=False).logits[0, :-1].float().cpu()
        models = [lq]
        if floor is not None:
            with torch.inference_mode():
                models.append(floor(input_ids=ids.to(_device_of(floor)), use_cache=False).logits[0, :-1].float().cpu())
        stats = token_stats_many(lr, models, ids[0, 1:])
        kld, same, nll_r, nll_q = stats[0]
        if floor is not None:
            for k, v in zip(("kld", "same", "nll_r", "nll_q"), stats[1]):
                fl[k].append(float(v.sum()))
            fl["n"].append(kld.numel())
        del lr, lq, models, stats
        all_kld.append(kld)
        per["kld"].append(float(kld.sum()))
        per["same"].append(float(same.sum()))
        per["nll_r"].append(float(nll_r.sum()))
        per["nll_q"].append(float(nll_q.sum()))
        per["n"].append(kld.numel())
    kl = torch.cat(all_kld)
    pc = {k: torch.tensor(v, dtype=torch.float64) for k, v in per.items()}
    n = float(pc["n"].sum())
    ppl_r = math.exp(float(pc["nll_r"].sum()) / n)
    ppl_q = math.exp(float(pc["nll_q"].sum()) / n)
    qs = torch.quantile(kl, torch.tensor([0.5, 0.9, 0.99], dtype=torch.float64))
    cis = _bootstrap(pc, bootstrap, seed) if bootstrap else {
        "kld": (math.nan, math.nan), "same": (math.nan, math.nan), "dppl": (math.nan, math.nan)}
    out = {}
    if floor is not None:
        fc = {k: torch.tensor(v, dtype=torch.float64) for k, v in fl.items()}
        out = {"floor_kld": float(fc["kld"].sum()) / n, "floor_same_top1": 100.0 * float(fc["same"].sum()) / n,
               "floor_kld_ci95": _bootstrap(fc, bootstrap, seed)["kld"] if bootstrap else (math.nan, math.nan)}
    return {
        **out,
        "tokens": int(n),
        "mean_kld": float(kl.mean()),
        "kld_ci95": cis["kld"],
        "kld_p50": float(qs[0]), "kld_p90": float(qs[1]), "kld_p99": float(qs[2]),
        "kld_max": float(kl.max()),
        "same_top1": 100.0 * float(pc["same"].sum()) / n,
        "same_top1_ci95": cis["same"],
        "ppl_reference": ppl_r, "ppl_quantized": ppl_q, "delta_ppl": ppl_q - ppl_r,
        "delta_ppl_ci95": cis["dppl"],
        "per_context": [{"tokens": int(pc["n"][i]), "mean_kld": float(pc["kld"][i] / pc["n"][i]),
                         "same_top1": 100.0 * float(pc["same"][i] / pc["n"][i]),
                         "nll_reference": float(pc["nll_r"][i] / pc["n"][i]),
                         "nll_quantized": float(pc["nll_q"][i] / pc["n"][i])}
                        for i in range(len(per["n"]))],
    }


def _device_of(model) -> torch.device:
    try:
        return next(p.device for p in model.parameters())
    except StopIteration:  # pragma: no cover
        return torch.device("cpu")


# ---------------------------------------------------------------------------------------
# loading the pair of models


def _dtype(dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    from embedq.format.dtypes import dtype_from_name
    return dtype_from_name(str(dtype))


def check_reference(path: Path, reference: Path, qconfig: OverlayConfig) -> None:
    """The reference folder must hold every quantized module's float source tensor."""
    from embedq.format.checkpoint import Checkpoint
    try:
        ck = Checkpoint.open(reference)
    except EmbedqError as e:
        raise EvalError(f"reference {reference}: {e}") from None
    for name, e in qconfig.modules.items():
        src = e.source.tensor
        if not ck.has(src):
            hint = ("; it is a derived checkpoint without the float table: pass --reference "
                    "with the source checkpoint" if reference == path else "")
            raise EvalError(f"{reference}: no float tensor {src} to compare {name} against{hint}")
        info = ck.tensor(src)
        if list(info.shape) != list(e.shape):
            raise EvalError(f"{reference}: {src} has shape {list(info.shape)}, the overlay's "
                            f"{name} was made from {list(e.shape)} (a different model?)")


def source_is_bf16(path: Path, qconfig: OverlayConfig) -> bool:
    """Whether every quantized module's float source tensor in ``path`` is bfloat16."""
    from embedq.format.checkpoint import Checkpoint
    ck = Checkpoint.open(path)
    srcs = [e.source.tensor for e in qconfig.modules.values()]
    return bool(srcs) and all(ck.has(t) and ck.tensor(t).dtype == "BF16" for t in srcs)


def load_pair(path: str | os.PathLike, reference: str | os.PathLike | None = None,
              dtype="float32", float_head: bool = False, device: str | None = None,
              activations: str | None = None):
    """(reference model, quantized model) for ``path``; see :func:`evaluate`."""
    from embedq.backends.transformers import QuantizedLMHead, load
    from embedq.format.reader import parse_overlay_config
    p = Path(path)
    ref_path = Path(reference) if reference is not None else p
    qconfig = parse_overlay_config(p)
    check_reference(p, ref_path, qconfig)
    dt = _dtype(dtype)
    with quiet_transformers():
        quant = load(p, dtype=dt, activations=activations, **({"device_map": device} if device else {})).eval()
    ref = load_reference(ref_path, type(quant), dt, device)
    if float_head:
        for name, m in list(quant.named_modules()):
            if isinstance(m, QuantizedLMHead):
                parent, _, child = name.rpartition(".")
                setattr(quant.get_submodule(parent) if parent else quant, child, ref.get_submodule(name))
    return ref, quant


def _check_device(p: Path, device: str | None) -> None:
    """Refuse a device torch cannot parse or this machine lacks, before loading anything
    (torch's own failure comes late, as an AssertionError or a meta-tensor ValueError)."""
    if device is None:
        return
    try:
        d = torch.device(device)
    except (RuntimeError, ValueError, TypeError):
        raise EvalError(f"{p}: --device {device!r} is not a torch device; use cpu, cuda, cuda:1, ...") from None
    if d.type == "cpu":
        return
    if d.type == "cuda":
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if n == 0:
            raise EvalError(f"{p}: --device {device}: this torch sees no CUDA GPU; drop --device (CPU)")
        if d.index is not None and d.index >= n:
            raise EvalError(f"{p}: --device {device}: this machine has {n} CUDA GPU(s) (cuda:0..cuda:{n - 1})")
        return
    backend = getattr(torch.backends, d.type, None) or getattr(torch, d.type, None)
    if d.type == "meta" or backend is None or not getattr(backend, "is_available", lambda: False)():
        raise EvalError(f"{p}: --device {device}: not available here; use cpu or cuda")


def _check_ids(p: Path, ctx: torch.Tensor, rows: int | None, source: str) -> None:
    """Every id must index the embedding table: an id past it is the tokenizer (or the ids
    given) disagreeing with the model, which torch reports only as an IndexError."""
    if rows is None:
        return
    hi, lo = int(ctx.max()), int(ctx.min())
    if hi >= rows or lo < 0:
        bad = hi if hi >= rows else lo
        raise EvalError(f"{p}: {source} and the model disagree: token id {bad} is outside the "
                        f"table's {rows} rows (0..{rows - 1}); use the model's own tokenizer")


def _labels(qconfig: OverlayConfig, float_head: bool) -> dict[str, str]:
    out = {}
    for name, e in qconfig.modules.items():
        if float_head and e.role == "head":
            continue
        out[name] = e.scheme.label()
    for alias, owner in qconfig.aliases.items():
        if float_head and is_head_name(alias):
            continue
        out[alias] = f"= {owner}"
    return out


def evaluate(path: str | os.PathLike, *, text: str | os.PathLike | None = None,
             contexts: int = DEFAULT_CONTEXTS, length: int = DEFAULT_LENGTH,
             reference: str | os.PathLike | None = None, dtype="float32", float_head: bool = False,
             tokens: list[int] | torch.Tensor | None = None, bos: int | None | str = "auto",
             bootstrap: int = BOOTSTRAP_SAMPLES, seed: int = 0, progress: bool = True,
             device: str | None = None, floor: bool | None = None,
             activations: str | None = None) -> EvalResult:
    """Mean / percentile KLD, same-top-1 and Δ perplexity of the overlay at ``path``.

    - ``reference``: the float checkpoint (default: ``path`` itself, whose shards still
      hold the float table for an in-place overlay; a derived checkpoint needs its source).
    - ``text``: a UTF-8 file (default: Python's ``pydoc_data/topics.py``); or pass
      ``tokens`` (token ids) directly.
    - ``dtype``: compute dtype of both models (default float32: the reference is the
      checkpoint's exact values, the quantized table is dequantized exactly).
    - ``float_head``: keep the float head in the quantized model (measures the gather only).
    - ``bos``: token id that starts every context (``"auto"``: the tokenizer's / config's).
    - ``device``: where both models run (``"cuda"`` ...; default CPU).
    - ``activations``: ``"int8"`` measures the serving opt-in (4-bit heads with int8
      activations, :mod:`embedq.kernels.actquant`); default ``EMBEDQ_ACTIVATIONS``, else exact.
    - ``floor``: also measure the float model run in bfloat16 against the reference (the
      noise floor, one more forward pass per context); ``None``: when the checkpoint's
      tables are bf16 and ``dtype`` is float32.
    """
    t0 = time.perf_counter()
    from embedq.format.reader import parse_overlay_config
    from embedq.kernels import actquant
    p = Path(path)
    try:
        actquant.mode(activations)
    except ValueError as e:
        raise EvalError(f"{p}: {e} (--activations)") from None
    _check_device(p, device)
    if isinstance(bootstrap, bool) or not isinstance(bootstrap, int) or bootstrap < 0:
        raise EvalError(f"{p}: bootstrap={bootstrap!r}: give a number of samples >= 0 (0: no CIs)")
    if bos != "auto" and bos is not None and (isinstance(bos, bool) or not isinstance(bos, int) or bos < 0):
        raise EvalError(f"{p}: bos={bos!r}: give a token id >= 0, None (no BOS) or \"auto\"")
    qconfig = parse_overlay_config(p)
    tokenizer, tok_bos = None, None
    if tokens is None:
        body, desc = read_text(text) if text is not None else default_text()
        ref_folder = Path(reference) if reference is not None else p
        folder = p if (p / "tokenizer.json").exists() or (p / "tokenizer_config.json").exists() else ref_folder
        tokenizer = load_tokenizer(folder)
        tok_bos = tokenizer.bos_token_id
    else:
        desc = "token ids given"
    if bos == "auto":
        bos = tok_bos if tok_bos is not None else config_bos(p)
        if bos is None:
            raise EvalError(f"{p}: neither the tokenizer nor config.json names a BOS token; pass bos=ID "
                            "(or bos=None to run without one)")
    if tokenizer is not None:
        ctx = text_contexts(tokenizer, body, contexts, length, bos)
    else:
        try:
            ctx = make_contexts(tokens, contexts, length, bos)
        except (TypeError, ValueError, RuntimeError) as e:  # torch's words for a ragged / non-int list
            raise EvalError(f"{p}: tokens: not a list of integer token ids ({e})") from None
    ref_path = Path(reference) if reference is not None else p
    if floor and _dtype(dtype) != torch.float32:
        raise EvalError(f"{p}: the bf16 floor is measured against a float32 reference; drop --floor "
                        f"or use --dtype float32 (not {dtype})")
    if floor is None:
        floor = _dtype(dtype) == torch.float32 and source_is_bf16(ref_path, qconfig)
    source = "the tokenizer" if tokenizer is not None else "tokens/bos"
    # Before loading: the overlay's tables are vocabulary-sized (a per-layer table may be
    # smaller: Gemma 3n maps the ids past it to 0 itself); after: the models' own tables.
    _check_ids(p, ctx, min((e.shape[0] for e in qconfig.modules.values() if e.role != "per_layer"),
                           default=None), source)
    ref, quant = load_pair(p, reference, dtype, float_head, device, activations)
    _check_ids(p, ctx, min(m.get_input_embeddings().num_embeddings for m in (ref, quant)), source)
    from embedq.backends.transformers import QuantizedLMHead
    used = {m.table.prepared.activations for m in quant.modules()  # heads that really round them
            if isinstance(m, QuantizedLMHead) and m.table.prepared is not None
            and any(r.act != "exact" for r in m.table.prepared.routes)}
    low = load_reference(ref_path, type(quant), torch.bfloat16, device) if floor else None
    stats = compare_models(ref, quant, ctx, bootstrap=bootstrap, seed=seed, progress=progress, floor=low)
    del ref, quant, low
    return EvalResult(path=str(p), reference=str(Path(reference) if reference else p), text=desc,
                      contexts=contexts, length=length, dtype=str(_dtype(dtype)).replace("torch.", ""),
                      modules=_labels(qconfig, float_head), float_head=float_head,
                      seconds=time.perf_counter() - t0, bos=bos is not None,
                      activations=used.pop() if used else "exact", **stats)


__all__ = ["evaluate", "EvalResult", "EvalError", "compare_models", "token_stats", "token_stats_many",
           "make_contexts", "load_pair", "default_text", "scheme_advice"]
