"""Reading an overlay back: config plus quantized tables, via safetensors' own reader."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from embedq.errors import OverlayError
from embedq.format.constants import CONFIG_NAME, OVERLAY_FORMAT, OVERLAY_SUFFIXES, QCONFIG_NAME, QUANT_METHOD
from embedq.format.checkpoint import read_safetensors_header
from embedq.format.files import inside, read_json
from embedq.format.kept import check_settled
from embedq.format.config import OverlayConfig, parse_config, read_config_file
from embedq.errors import EmbedqError
from embedq.format.codec import unpack_zero_points
from embedq.format.codec import QuantizedTable


@dataclass
class Overlay:
    """An overlay read back: its folder, validated config, packed tables and file."""

    path: Path
    config: dict
    tables: dict[str, QuantizedTable]
    file: Path | None = None
    parsed: OverlayConfig | None = None

    def table_for(self, module: str) -> QuantizedTable:
        """The table a module reads, following aliases (a tied head reads the embedding)."""
        owner = (self.config.get("aliases") or {}).get(module, module)
        return self.tables[owner]


ITEMSIZE = {"I32": 4, "I64": 8, "BF16": 2, "F16": 2, "F32": 4}


def parse_overlay_config(path: str | os.PathLike) -> OverlayConfig:
    """The validated config of a folder: ``quantization_config.json``, else config.json's;
    when both exist they must agree. A folder a killed re-commit left between two overlays
    is refused (``kept.check_settled``)."""
    p = Path(path)
    check_settled(p)
    parsed = None
    if (p / QCONFIG_NAME).exists() or (p / QCONFIG_NAME).is_symlink():
        parsed = read_config_file(inside(p, QCONFIG_NAME))
    if (p / CONFIG_NAME).exists():  # what loaders (embedq.load, from_pretrained) read
        cfg = read_json(inside(p, CONFIG_NAME), OverlayError, constants=True)
        qc = cfg.get("quantization_config") if isinstance(cfg, dict) else None
        if isinstance(qc, dict) and qc.get("quant_method") == QUANT_METHOD:
            in_config = parse_config(qc, f"{p / CONFIG_NAME} (quantization_config)")
            if parsed is None:
                return in_config
            if in_config.to_dict() != parsed.to_dict():
                raise OverlayError(f"{in_config.where}: differs from {QCONFIG_NAME}, and loaders read "
                                   "this one; re-create the folder with embedq (quantize --output, or apply)")
    if parsed is not None:
        return parsed
    raise OverlayError(f"{p}: no embedq overlay (no {QCONFIG_NAME})")


def read_overlay_config(path: str | os.PathLike) -> dict:
    """``quantization_config.json`` of a folder (or config.json's quantization_config), validated."""
    return parse_overlay_config(path).to_dict()


def check_overlay_header(file: Path, cfg: OverlayConfig) -> tuple[int, dict]:
    """Read an overlay file's header and hold it to the config: exactly the declared
    tensors (no other name), each with the declared dtype and shape, and data offsets
    that match those sizes, do not overlap and lie inside the file."""
    try:
        n, header = read_safetensors_header(file)
    except EmbedqError as e:
        raise OverlayError(str(e)) from None
    try:
        return _held_to_config(file, n, header, cfg)
    except OverlayError as e:  # the file no longer matches its config: the way out
        raise OverlayError(f"{e}; {REWRITE_HINT}") from None


REWRITE_HINT = "write the overlay again from the float model (embedq quantize --force)"


def _held_to_config(file: Path, n: int, header: dict, cfg: OverlayConfig) -> tuple[int, dict]:
    meta = header.get("__metadata__") or {}
    if not isinstance(meta, dict) or meta.get("format") != OVERLAY_FORMAT:
        fmt = meta.get("format") if isinstance(meta, dict) else None
        raise OverlayError(f"{file}: not an embedq overlay (metadata format={fmt!r})")
    want = cfg.tensors()
    names = [k for k in header if k != "__metadata__"]
    extra = sorted(set(names) - set(want))
    if extra:
        raise OverlayError(f"{file}: holds tensor {extra[0][:120]!r}, which the config does not declare "
                           "(an overlay carries only its modules' quantized tables)")
    missing = sorted(set(want) - set(names))
    if missing:
        raise OverlayError(f"{file}: missing tensor {missing[0]}")
    spans = []
    size = file.stat().st_size
    for k in names:
        v = header[k]
        dtype, shape = want[k]
        hs = v.get("shape") if isinstance(v, dict) else None
        if not isinstance(v, dict) or v.get("dtype") != dtype or not isinstance(hs, list) \
                or any(type(x) is not int for x in hs) or hs != list(shape):
            got = (v.get("dtype"), v.get("shape")) if isinstance(v, dict) else v
            raise OverlayError(f"{file}: tensor {k} is {str(got)[:80]}, the config declares "
                               f"{dtype} {list(shape)}")
        off = v.get("data_offsets")
        nbytes = ITEMSIZE[dtype]
        for d in shape:
            nbytes *= d
        if not (isinstance(off, list) and len(off) == 2 and all(type(x) is int for x in off)
                and 0 <= off[0] and off[1] - off[0] == nbytes and 8 + n + off[1] <= size):
            raise OverlayError(f"{file}: tensor {k} has data_offsets {str(off)[:60]}, which do not hold "
                               f"its {nbytes} bytes inside the file")
        spans.append((off[0], off[1], k))
    spans.sort()
    for (_, e1, k1), (b2, _, k2) in zip(spans, spans[1:]):
        if b2 < e1:
            raise OverlayError(f"{file}: tensors {k1} and {k2} overlap")
    return n, header


def load_overlay(path: str | os.PathLike, modules: list[str] | None = None) -> Overlay:
    """Load an overlay's tables into memory (packed, as on disk)."""
    p = Path(path)
    parsed = parse_overlay_config(p)
    cfg = parsed.to_dict()
    file = inside(p, parsed.overlay, named_by=parsed.where)
    if not file.is_file():
        raise OverlayError(f"{file}: overlay file missing")
    check_overlay_header(file, parsed)
    tables = {}
    try:
        f = safe_open(str(file), framework="pt")
    except Exception as e:
        raise OverlayError(f"{file}: not a readable safetensors file ({str(e)[:200]})") from None
    for name, entry in parsed.modules.items():
        if modules is not None and name not in modules:
            continue
        s = entry.scheme
        rows, cols = entry.shape
        packed_name, scale_name, shape_name, zp_name = (f"{name}.{s}" for s in OVERLAY_SUFFIXES)
        packed = f.get_tensor(packed_name)
        scale = f.get_tensor(scale_name)
        shape = tuple(int(x) for x in f.get_tensor(shape_name).tolist())
        if shape != (rows, cols):
            raise OverlayError(f"{file}: {shape_name} is {list(shape)}, the config says {[rows, cols]}")
        if not bool(torch.isfinite(scale).all()):
            raise OverlayError(f"{file}: {scale_name} holds NaN or infinite scales")
        zp = None if s.symmetric else unpack_zero_points(f.get_tensor(zp_name), s.bits, rows)
        tables[name] = QuantizedTable(packed, scale, zp, s.bits, s.group_size, (rows, cols))
    return Overlay(p, cfg, tables, file, parsed)

