"""Is a float initializer the overlay's source table? (recorded digest, dequantized, sampled rows)"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from embedq.format.digest import VERSION_DIGESTS, new_hasher
from embedq.backends.onnx.common import (CHUNK_BYTES, SAMPLE_ROWS, OnnxError, TensorRef, tensor_proto,
                                         torch_dtype_of)


# ------------------------------------------------------------------- source checks

@dataclass
class SourceCheck:
    how: str  # sha256 | blake3 (the recorded digest) | dequantized | sampled-rows
    detail: str = ""


def _lossless(graph_dtype: torch.dtype, src_dtype: torch.dtype) -> bool:
    """Can ``graph_dtype`` represent every value of ``src_dtype``?"""
    return graph_dtype == src_dtype or graph_dtype == torch.float32


def _chunk_rows(cols: int) -> int:
    return max(64, CHUNK_BYTES // max(1, cols * 4))


def check_source(t: TensorRef, transposed: bool, entry: dict, table, where: str) -> SourceCheck:
    """Is the float initializer ``t`` the overlay's source table? Raise OnnxError if not.

    1. the digest (sha256 or blake3, as the config records) of the rows cast to the source
       dtype equals the recorded source digest
       (only possible where the graph dtype holds the source values exactly);
    2. or every row equals the dequantized overlay table (a graph built from it);
    3. or, where the graph dtype cannot hold the source exactly (float16 graph of a
       bfloat16 source), sampled rows lie within half a quantization step (plus the
       graph dtype's rounding) of the dequantized rows.
    """
    from embedq.format.dtypes import dtype_from_name
    src = entry.get("source") or {}
    rows, cols = entry["shape"]
    gdt = torch_dtype_of(t.elem_type)
    sdt = dtype_from_name(src.get("dtype", "bfloat16"))
    lossless = _lossless(gdt, sdt)
    cr = _chunk_rows(cols)
    algo = next((a for a in VERSION_DIGESTS.values() if src.get(a)), None)
    if algo is not None:
        h = new_hasher(algo)
        for a in range(0, rows, cr):
            h.update(t.rows(a, min(rows, a + cr), transposed).to(sdt).contiguous().view(torch.uint8).numpy())
        if h.hexdigest() == src[algo]:
            return SourceCheck(algo)
    # A graph exported from the dequantized table (a derived checkpoint has no float source).
    sample = _sample_rows(rows)
    x = torch.cat([t.rows(int(r), int(r) + 1, transposed) for r in sample])
    deq = table.dequantize(torch.float32, sample).to(gdt)
    if torch.equal(x, deq):
        for a in range(0, rows, cr):
            b = min(rows, a + cr)
            if not torch.equal(t.rows(a, b, transposed), table.dequantize(torch.float32, slice(a, b)).to(gdt)):
                break
        else:
            return SourceCheck("dequantized")
    if not lossless:
        ok, frac = _within_quantization_error(x, table, sample, gdt)
        if ok:
            return SourceCheck("sampled-rows", f"{len(sample)} rows, {frac:.4%} of values within "
                               "half a quantization step (graph dtype cannot hold the source exactly)")
    raise OnnxError(
        f"{where} is not the source of this overlay's {src.get('tensor', 'table')} "
        f"({algo or 'the digest'} of its {rows}x{cols} values differs from quantization_config.json"
        f"{'' if lossless else ', and sampled rows are not within quantization error'}); "
        "refusing to patch with a wrong or stale overlay")


def _sample_rows(rows: int) -> torch.Tensor:
    n = min(rows, SAMPLE_ROWS)
    return torch.unique(torch.linspace(0, rows - 1, n).round().long())


def _within_quantization_error(x: torch.Tensor, table, sample: torch.Tensor,
                               gdt: torch.dtype) -> tuple[bool, float]:
    q = table.codes(sample).float()
    g = table.cols if table.group_size is None else table.group_size
    s = table.scale[sample].float().repeat_interleave(g, dim=1)
    deq = table.dequantize(torch.float32, sample)
    xf = x.float()
    eps = torch.finfo(gdt).eps
    tol = 0.5 * s * (1 + 1e-3) + eps * xf.abs() + torch.finfo(gdt).tiny
    d = xf - deq
    lo, hi = -(1 << (table.bits - 1)), (1 << (table.bits - 1)) - 1
    ok = d.abs() <= tol
    ok |= (q == hi) & (d >= -tol)  # a clipped maximum may lie further out
    ok |= (q == lo) & (d <= tol)
    frac = float(ok.float().mean())
    return frac >= 0.999 and bool(torch.isfinite(xf).all()), frac


# ------------------------------------------------------- step 2 of onnx patch

def check_sources(P, matches: list, optional: frozenset = frozenset()) -> list:
    """Step 2 of :func:`embedq.backends.onnx.patch.patch_model` (``P`` its shared state):
    keep the matches whose float initializer is their module's source table, checked once
    per module and initializer. Several candidates of the right shape (a second [V, H]
    table; Gemma 3n's per-layer embedding beside its input embedding) are kept only where
    they are the source; a module none of whose candidates is refuses the patch, except an
    ``optional`` one (a per-layer table), which stays float with a warning. A Gather two
    modules' tables match (identical tables) takes the first module's."""
    from embedq.format.reader import load_overlay
    P.ov = load_overlay(P.ov_path)
    checks: dict[tuple[str, str, bool], SourceCheck | None] = {}
    failed: dict[tuple[str, str], list[str]] = {}
    for m in matches:
        key = (m.module, m.init, m.transposed)
        if key in checks:
            continue
        entry = P.cfg["modules"][m.module]
        where = f"{P.src_path}: initializer {m.init!r} ({m.node.op_type} {m.node.name!r})"
        if P.G.tensor(m.init).elem_type == tensor_proto().BFLOAT16:
            raise OnnxError(f"{where} is bfloat16; ONNX Runtime's CPU kernels take float32 or "
                            "float16 scales and outputs: export the model in float32 or float16")
        try:
            checks[key] = check_source(P.G.tensor(m.init), m.transposed, entry, P.ov.tables[m.module], where)
        except OnnxError:
            # refuse at once only where this was the module's one candidate of its role
            if m.module not in optional and not any(
                    x.module == m.module and x.role == m.role and x.init != m.init for x in matches):
                raise
            checks[key] = None
            failed.setdefault((m.module, m.role), []).append(m.init)
            continue
        if checks[key].how == "sampled-rows":
            P.warnings.append(f"{m.init}: {checks[key].detail}")
    kept, nodes = [], set()
    for x in matches:
        c = checks[(x.module, x.init, x.transposed)]
        if c is not None and id(x.node) not in nodes:
            nodes.add(id(x.node))
            x.check = c.how
            kept.append(x)
    replaced, left = {x.init for x in kept}, set()
    for (module, role), inits in failed.items():
        op = "Gather" if role == "embedding" else "MatMul"
        shown = sorted(set(inits))
        if not any(checks[(x.module, x.init, x.transposed)] for x in matches
                   if x.module == module and x.role == role):
            if module in optional:
                P.warnings.append(f"{module}: no {op} reads its float table (none of {shown} is its "
                                  "source); it stays as it is")
                continue
            raise OnnxError(f"{P.src_path}: none of the float [V, H] tables {shown} read by a {op} is "
                            "the source of this overlay; refusing to patch with a wrong or stale overlay")
        left |= {i for i in shown if i not in replaced}
    if left:
        P.warnings.append(f"{', '.join(sorted(left))}: same shape but not the overlay's source; left as is")
    return kept
