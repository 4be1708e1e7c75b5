"""``embedq quantize --max-kld X`` / ``--auto``: the smallest overlay under a measured KLD.

Candidate schemes are tried from the smallest overlay up; each one's table is quantized
in memory (same code as the writer: :func:`embedq.quant.stream.quantize_chunk`), put
into the float model in place of the float table (the gather, and the head when the
head reads it) and scored against the float model on a small built-in text sample
(``SAMPLE_CONTEXTS`` x ``SAMPLE_LENGTH`` tokens of Python's ``pydoc_data`` topics,
BOS first — :func:`embedq.quality.evaluate.text_contexts`). The first candidate whose mean
KLD is at most X wins: it is the smallest one that passes. Everything tried is reported.

The dequantized table in the float model is exactly what the transformers back end
computes from the overlay (tests/quality checks that equality), so the measured KLD
is the overlay's on that sample. It is a sample: rerun ``embedq eval`` on text of
your own before shipping.
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from embedq.errors import EmbedqError
from embedq.format.scheme import Scheme
from embedq.jobs.recipe import AUTO_MAX_KLD, QuantizeRecipe

SAMPLE_CONTEXTS = 4
SAMPLE_LENGTH = 128

# (bits, group_size (None: per row), symmetric): tried in order of overlay bytes.
CANDIDATES = [
    (4, 128, True), (4, 128, False), (4, 64, True), (4, 64, False), (4, 32, True), (4, 32, False),
    (8, None, True), (8, None, False), (8, 128, True), (8, 128, False), (8, 64, True), (8, 32, True),
]


class SelectError(EmbedqError):
    """No candidate scheme meets the requested KLD, or the selection cannot run."""


@dataclass
class Trial:
    scheme: str
    bits: int
    group_size: int | None
    symmetric: bool
    method: str
    overlay_bytes: int
    mean_kld: float | None = None  # None: not measured (does not fit, or a smaller one passed)
    same_top1: float | None = None
    seconds: float = 0.0
    note: str = ""


@dataclass
class Selection:
    max_kld: float
    chosen: Trial | None
    trials: list[Trial] = field(default_factory=list)
    sample: str = ""
    tokens: int = 0
    seconds: float = 0.0
    bits: int | None = None  # --bits: only that width's candidates were searched (None: all)

    def to_dict(self) -> dict:
        return asdict(self)

    def table(self) -> str:
        # a narrowed search says so: "the smallest overlay" is among B-bit schemes only
        among = "" if self.bits is None else f" among {self.bits}-bit schemes only (--bits {self.bits})"
        lines = [f"auto: smallest overlay{among} with mean KLD <= {self.max_kld:g} on {self.tokens} tokens of "
                 f"{self.sample} ({self.seconds:.0f} s)"]
        for t in self.trials:
            kld = (f"KLD {t.mean_kld:.5f}  top-1 {t.same_top1:.1f}%" if t.mean_kld is not None
                   else "-" if t.note else "not tried (a smaller one passed)")
            mark = " <- chosen" if self.chosen is t else ""
            note = f"  ({t.note})" if t.note else ""
            lines.append(f"  {t.scheme:<22} {t.overlay_bytes / 1e6:8.1f} MB  {kld}{mark}{note}")
        if self.chosen is None:
            lines.append("  none passes")
        return "\n".join(lines)


def overlay_bytes(shape: tuple[int, int], bits: int, group_size: int | None, symmetric: bool,
                  scale_bytes: int) -> int:
    return Scheme(bits=bits, symmetric=symmetric, group_size=group_size).overlay_bytes(shape, scale_bytes)


def _dequantized(read, shape, scheme, scale_dtype, chunk_rows: int, calibration=None) -> torch.Tensor:
    from embedq.format.codec import dequantize_codes
    from embedq.quant.stream import quantize_chunk
    rows, cols = shape
    out = torch.empty(rows, cols, dtype=torch.float32)
    for a in range(0, rows, chunk_rows):
        b = min(rows, a + chunk_rows)
        q, s, zp = quantize_chunk(read(a, b), scheme, scale_dtype, calibration)
        out[a:b] = dequantize_codes(q, s, zp, scheme.group_size)
    return out


def select_scheme(path: str | os.PathLike, max_kld: float, *, method: str | None = None,
                  lm_head: bool = False, targets: list[str] | None = None, trust: str | None = None,
                  candidates=None, contexts: int = SAMPLE_CONTEXTS, length: int = SAMPLE_LENGTH,
                  text: str | os.PathLike | None = None, progress: bool = False,
                  log=None) -> Selection:
    """Try candidate schemes smallest-first; return the first whose sample KLD <= ``max_kld``.

    ``method``: quantization method for every candidate (default: ``gptq`` when a head
    reads the table — tied models, or ``lm_head`` — else ``mse``).
    """
    if not (max_kld > 0):
        raise SelectError(f"--max-kld {max_kld}: must be a positive number (nats per token)")
    t_start = time.perf_counter()
    import transformers
    from safetensors import safe_open

    from embedq.quality.evaluate import (default_text, load_reference, load_tokenizer, read_text,
                                 text_contexts, token_stats)
    from embedq.format.checkpoint import Checkpoint
    from embedq.jobs.archfacts import transformers_config
    from embedq.jobs.overlay import plan_modules
    from embedq.quant.stream import default_chunk_rows

    p = Path(path)
    ckpt = Checkpoint.open(p)
    probe = Scheme(bits=8)
    plans, aliases, tied = plan_modules(ckpt, probe, lm_head=lm_head, targets=targets, trust=trust)
    method = method or ("gptq" if any(pl.head_reads for pl in plans) else "mse")

    body, desc = read_text(text) if text is not None else default_text()
    tok = load_tokenizer(p)
    ctx = text_contexts(tok, body, contexts, length, tok.bos_token_id)
    cfg = transformers_config(p)
    arch = (getattr(cfg, "architectures", None) or [None])[0]
    cls = getattr(transformers, arch, None) if arch else None
    model = load_reference(p, cls or transformers.AutoModelForCausalLM, torch.float32)
    emb = model.get_input_embeddings()
    head = model.get_output_embeddings()
    originals = {"embedding": emb.weight.data, "head": head.weight.data if head is not None else None}

    @torch.no_grad()
    def logits_all():
        return [model(input_ids=ctx[i:i + 1], use_cache=False).logits[0, :-1].float()
                for i in range(ctx.shape[0])]

    ref_logits = logits_all()
    targets_next = [ctx[i, 1:] for i in range(ctx.shape[0])]

    def method_for(pl) -> str:
        # gptq weights by what the head needs: only for tables a head reads
        return method if (method != "gptq" or pl.head_reads) else "mse"

    from embedq.jobs.calibration import collect_calibration
    gptq = any(method_for(pl) == "gptq" for pl in plans)  # else calibration would go unused
    cal = collect_calibration(p, progress=progress) if gptq else None

    sel = Selection(max_kld, None, sample=desc, tokens=sum(int(t.numel()) for t in targets_next))
    sel.calibration = cal
    for bits, group, sym in (CANDIDATES if candidates is None else candidates):
        label = Scheme(bits=bits, symmetric=sym, group_size=group, method=method).label()
        note = ""
        for pl in plans:
            try:
                Scheme(bits=bits, symmetric=sym, group_size=group).check_shape(pl.shape, pl.tensor)
            except EmbedqError as e:
                note = f"does not fit: {e}"
        total = sum(overlay_bytes(pl.shape, bits, group, sym,
                                  pl.dtype.itemsize) for pl in plans)
        sel.trials.append(Trial(label, bits, group, sym, method, total, note=note))
    sel.trials.sort(key=lambda t: t.overlay_bytes)

    for t in sel.trials:
        if t.note:
            continue
        t0 = time.perf_counter()
        for pl in plans:
            s = Scheme(bits=t.bits, symmetric=t.symmetric, group_size=t.group_size, method=method_for(pl))
            sl = safe_open(str(ckpt.path / pl.file), framework="pt").get_slice(pl.tensor)
            cr = default_chunk_rows(pl.shape[1], pl.dtype.itemsize)
            w = _dequantized(lambda a, b: sl[a:b], pl.shape, s, pl.dtype, cr,
                             cal if s.method == "gptq" else None)
            if pl.role == "head":
                if head is not None:
                    head.weight.data = w
            elif pl.role == "embedding":
                emb.weight.data = w
                if tied and head is not None and pl.aliases:
                    head.weight.data = w  # the tied head reads the same table
            # other tables (MTP / draft embeddings) are not used by the forward: left float
        kl_sum = same = n = 0.0
        with torch.no_grad():
            for lr, tn, i in zip(ref_logits, targets_next, range(ctx.shape[0])):
                lq = model(input_ids=ctx[i:i + 1], use_cache=False).logits[0, :-1].float()
                kld, s_, _, _ = token_stats(lr, lq, tn)
                kl_sum += float(kld.sum())
                same += float(s_.sum())
                n += kld.numel()
        emb.weight.data = originals["embedding"]
        if head is not None:
            head.weight.data = originals["head"]
        t.mean_kld, t.same_top1 = kl_sum / n, 100.0 * same / n
        t.seconds = time.perf_counter() - t0
        if log is not None:
            log(f"  {t.scheme:<22} {t.overlay_bytes / 1e6:8.1f} MB  KLD {t.mean_kld:.5f}")
        if t.mean_kld <= max_kld:
            sel.chosen = t
            break
    sel.seconds = time.perf_counter() - t_start
    del model
    return sel


def quantize_auto(path: str | os.PathLike, recipe: QuantizeRecipe, *, log=None):
    """Choose the scheme of ``recipe.search`` with :func:`select_scheme`, then write the
    recipe with that scheme (:func:`embedq.jobs.quantize.quantize_checkpoint`).

    Returns ``(report, selection)``.
    """
    from embedq.jobs.overlay import compile_min_bytes
    from embedq.jobs.quantize import quantize_checkpoint
    compile_min_bytes()  # a bad EMBEDQ_COMPILE_MIN_BYTES fails before the search
    search = recipe.search
    x = search.max_kld
    # --bits: only that width's candidates ("the smallest 4-bit scheme under X")
    candidates = [c for c in CANDIDATES if search.bits in (None, c[0])]
    sel = select_scheme(path, x, method=search.method, lm_head=recipe.lm_head,
                        targets=list(recipe.targets) if recipe.targets else None, trust=recipe.trust,
                        candidates=candidates, progress=recipe.progress, log=log)
    sel.bits = search.bits  # the table's header and report.extra["auto"] say the search was narrowed
    if sel.chosen is None:
        best = min((t for t in sel.trials if t.mean_kld is not None), key=lambda t: t.mean_kld, default=None)
        hint = f"; the best candidate, {best.scheme}, measured {best.mean_kld:.5f}" if best else ""
        what = "candidate scheme" if search.bits is None else f"{search.bits}-bit candidate scheme"
        more = "" if search.bits is None else f"; drop --bits {search.bits} to try every width"
        if sel.trials and all(t.note for t in sel.trials):  # nothing measured: none fits the shape
            why = sel.trials[-1].note.removeprefix("does not fit: ")  # the smallest groups' reason
            raise SelectError(f"no {what} fits the table ({why}){more}")
        raise SelectError(f"no {what} has mean KLD <= {x:g} on the sample{hint}{more}")
    c = sel.chosen
    scheme = Scheme.default(c.bits, c.symmetric, 0 if c.group_size is None else c.group_size, c.method,
                            search.scale_dtype)
    report = quantize_checkpoint(path, recipe.chosen(scheme, getattr(sel, "calibration", None)))
    report.extra["auto"] = sel.to_dict()
    report.extra["auto"]["chosen"] = asdict(c)
    return report, sel


__all__ = ["select_scheme", "quantize_auto", "Selection", "Trial", "SelectError", "CANDIDATES",
           "AUTO_MAX_KLD", "overlay_bytes"]
