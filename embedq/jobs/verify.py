"""``embedq verify``: re-read an overlay, check checksums, measure error against the source.

Where the source table is present, every group's largest reconstruction error must stay
within what the scheme allows (:func:`error_bound`); NaN or infinity anywhere fails.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from safetensors import safe_open

from embedq.errors import OverlayError
from embedq.format.checkpoint import CONFIG_NAME, INDEX_NAME, Checkpoint
from embedq.format.config import ModuleEntry
from embedq.format.digest import hexdigest, new_hasher
from embedq.format.kept import check_settled
from embedq.format.reader import load_overlay
from embedq.format.dtypes import dtype_from_name
from embedq.quant.rtn import signed_max
from embedq.quant.stream import ErrorStats, NonFiniteSource, check_finite, default_chunk_rows
from embedq.jobs.report import ModuleReport, Report


# Scale spacing of each scale dtype (relative), and its smallest positive value.
_SCALE_EPS = {"bfloat16": 2.0 ** -7, "float16": 2.0 ** -10, "float32": 2.0 ** -23}
_SCALE_TINY = {"bfloat16": 2.0 ** -133, "float16": 2.0 ** -24, "float32": 2.0 ** -149}


def error_bound(x: torch.Tensor, entry: ModuleEntry) -> torch.Tensor:
    """Largest reconstruction error the scheme allows per group of ``x`` ([rows, groups]).

    A step is the group's range over its levels (``amax/qmax`` symmetric,
    ``range/(2^b-1)`` asymmetric, ``|m|/8`` for 4-bit signed-max). Round-to-nearest (rtn) misses by at most half a step
    (a whole step asymmetric, where the zero point is rounded too), plus the rounding of
    the stored scale (one unit of its dtype, and the dtype's smallest value for tiny
    groups). ``mse`` may clip outliers (ratios down to 0.6): half the group's largest
    magnitude more. ``gptq`` moves codes to compensate errors: at most twice it.
    """
    s = entry.scheme
    rows, cols = x.shape
    g = s.effective_group(cols)
    xg = x.float().reshape(rows, cols // g, g)
    amax = xg.abs().amax(dim=-1)
    if signed_max(s):
        # step |m| / 8; a value of the other sign near |m| is clipped to code 7 and misses
        # by up to one step (also bounds absmax/7 overlays written before: amax/14)
        step = amax / -s.qmin
        factor = 1.0
    elif s.symmetric:
        step = amax / s.qmax
        factor = 0.5
    else:
        step = (xg.amax(dim=-1).clamp(min=0) - xg.amin(dim=-1).clamp(max=0)) / ((1 << s.bits) - 1)
        factor = 1.0
    eps, tiny = _SCALE_EPS[entry.scale_dtype], _SCALE_TINY[entry.scale_dtype]
    bound = factor * (step * (1 + 2 * eps) + tiny)
    if s.method == "mse":
        bound = bound + 0.5 * amax
    elif s.method == "gptq":
        bound = bound + 2.0 * amax
    return bound + amax * 2.0 ** -20 + 1e-30


def verify_overlay(path: str | os.PathLike) -> Report:
    """Check an overlay end to end; raise :class:`OverlayError` on any mismatch.

    Checks the overlay tensors' recorded checksums, and where the source table is
    still in the checkpoint (in-place overlays), its checksum (the base must not
    have changed) and the reconstruction error against :func:`error_bound`.
    """
    p = Path(path)
    if p.is_dir():  # what a killed run left here (dead runs' staging only; announced)
        from embedq.jobs.state import cleanup_partials
        cleanup_partials(p)
        check_settled(p)  # between two overlays: read only, the next locked run settles it
    ov = load_overlay(p)
    cfg = ov.parsed
    file = ov.file
    reports = []
    with safe_open(str(file), framework="pt") as f:
        for name, entry in cfg.modules.items():
            # fails rather than letting "overlay OK" stand on an unchecked tensor
            entry.require_checksums(cfg.where, "re-run embedq quantize --force")
            for tname, digest in entry.checksums.items():
                got = hexdigest(f.get_tensor(tname).contiguous().view(torch.uint8).numpy(), cfg.digest)
                if got != digest:
                    raise OverlayError(f"{file}: tensor {tname} does not match its recorded checksum")
    # A folder with weights is checked against them (a corrupt or foreign shard is an
    # error, not a skipped check); an overlay-only bundle has no source tables.
    has_weights = (p / INDEX_NAME).exists() or (p / INDEX_NAME).is_symlink() or any(
        x.name != file.name for x in p.glob("*.safetensors"))
    ckpt = Checkpoint.open(p) if has_weights and (p / CONFIG_NAME).exists() else None
    if ckpt is not None and ckpt.index is not None:
        declared = cfg.tensors()
        wm = ckpt.index.get("weight_map") or {}
        extra = sorted(k for k, v in wm.items() if v == file.name and k not in declared)
        if extra:
            raise OverlayError(f"{p / INDEX_NAME}: maps {extra[0][:120]} to {file.name}, which the "
                               "overlay config does not declare (an overlay replaces only its modules)")
    warnings = []
    for name, entry in cfg.modules.items():
        t = ov.tables[name]
        s = entry.scheme
        src = entry.source
        dt = dtype_from_name(src.dtype or "bfloat16")
        before = t.rows * t.cols * torch.empty((), dtype=dt).element_size()
        stats = None
        if ckpt is not None and ckpt.has(src.tensor):
            info = ckpt.tensor(src.tensor)
            where = f"{ckpt.path / info.file}: {src.tensor}"
            if list(info.shape) != [t.rows, t.cols]:
                raise OverlayError(f"{where} has shape {list(info.shape)}, the overlay {[t.rows, t.cols]}")
            h = new_hasher(src.algorithm)
            stats = ErrorStats()
            problem = None  # reported after the source checksum (a changed source says so)
            with safe_open(str(ckpt.path / info.file), framework="pt") as sf:
                sl = sf.get_slice(src.tensor)
                cr = default_chunk_rows(t.cols, 4)
                for r0 in range(0, t.rows, cr):
                    x = sl[r0:r0 + cr]
                    h.update(x.contiguous().view(torch.uint8).numpy())
                    try:
                        check_finite(x, r0, where)
                    except NonFiniteSource as e:
                        problem = problem or str(e)
                        continue
                    xf = x.float()
                    xhat = t.dequantize(torch.float32, slice(r0, r0 + cr))
                    stats.update(xf, xhat)
                    err = (xhat - xf).abs()
                    g = s.effective_group(t.cols)
                    gerr = err.reshape(err.shape[0], t.cols // g, g).amax(dim=-1)
                    bound = error_bound(xf, entry)
                    bad = ~(gerr <= bound)  # NaN compares false: counted as bad
                    if bool(bad.any()) and problem is None:
                        r, c = (int(v) for v in bad.nonzero()[0])
                        problem = (
                            f"{file}: {name} row {r0 + r}: reconstruction error {float(gerr[r, c]):.4g} "
                            f"exceeds what {s.label()} allows ({float(bound[r, c]):.4g}); corrupt or "
                            "tampered scales or codes")
            if h.hexdigest() != src.digest:
                raise OverlayError(
                    f"{ckpt.path / info.file}: {src.tensor} changed since the overlay was made "
                    "(checksum mismatch); re-run embedq quantize --force")
            if problem:
                raise OverlayError(problem)
            if not stats.finite:
                raise OverlayError(f"{file}: {name} reconstructs to NaN or infinity")
        else:
            warnings.append(f"{name}: source tensor not in this folder; checked overlay checksums only")
        reports.append(ModuleReport(
            name, src.tensor, [t.rows, t.cols], s.label(), src.dtype or "?",
            before, t.nbytes(), None if stats is None else stats.max_abs,
            None if stats is None else stats.rms, None if stats is None else stats.rel_rms,
            entry.role, sorted(a for a, o in cfg.aliases.items() if o == name)))
    return Report(str(p), "verify", reports, cfg.tied, overlay=str(file), warnings=warnings)
