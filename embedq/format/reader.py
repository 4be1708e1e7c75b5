"""Reading an overlay back: config plus quantized tables, via safetensors' own reader."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from embedq.errors import OverlayError
from embedq.format.constants import CONFIG_NAME, OVERLAY_FORMAT, OVERLAY_NAME, QCONFIG_NAME, QUANT_METHOD
from embedq.format.config import scheme_of, validate_config
from embedq.format.codec import unpack_zero_points
from embedq.format.codec import QuantizedTable


@dataclass
class Overlay:
    """An overlay read back: its folder, validated config, packed tables and file."""

    path: Path
    config: dict
    tables: dict[str, QuantizedTable]
    file: Path | None = None

    def table_for(self, module: str) -> QuantizedTable:
        """The table a module reads, following aliases (a tied head reads the embedding)."""
        owner = (self.config.get("aliases") or {}).get(module, module)
        return self.tables[owner]


def read_overlay_config(path: str | os.PathLike) -> dict:
    """``quantization_config.json`` of a folder (or config.json's quantization_config)."""
    p = Path(path)
    if (p / QCONFIG_NAME).exists():
        try:
            cfg = json.loads((p / QCONFIG_NAME).read_text())
        except json.JSONDecodeError as e:
            raise OverlayError(f"{p / QCONFIG_NAME}: not valid JSON ({e})") from None
        return validate_config(cfg, str(p / QCONFIG_NAME))
    if (p / CONFIG_NAME).exists():
        qc = json.loads((p / CONFIG_NAME).read_text()).get("quantization_config")
        if qc and qc.get("quant_method") == QUANT_METHOD:
            return validate_config(qc, str(p / CONFIG_NAME))
    raise OverlayError(f"{p}: no embedq overlay (no {QCONFIG_NAME})")


def load_overlay(path: str | os.PathLike, modules: list[str] | None = None) -> Overlay:
    """Load an overlay's tables into memory (packed, as on disk)."""
    p = Path(path)
    cfg = read_overlay_config(p)
    file = p / cfg.get("overlay", OVERLAY_NAME)
    if not file.exists():
        raise OverlayError(f"{file}: overlay file missing")
    tables = {}
    try:
        f = safe_open(str(file), framework="pt")
    except Exception as e:
        raise OverlayError(f"{file}: not a readable safetensors file ({e})") from None
    meta = f.metadata() or {}
    if meta.get("format") != OVERLAY_FORMAT:
        raise OverlayError(f"{file}: not an embedq overlay (metadata format={meta.get('format')!r})")
    keys = set(f.keys())
    for name, entry in cfg["modules"].items():
        if modules is not None and name not in modules:
            continue
        s = scheme_of(entry)
        rows, cols = entry["shape"]

        def get(suffix: str) -> torch.Tensor:
            k = f"{name}.{suffix}"
            if k not in keys:
                raise OverlayError(f"{file}: missing tensor {k}")
            return f.get_tensor(k)

        packed, scale = get("weight_packed"), get("weight_scale")
        shape = tuple(int(x) for x in get("weight_shape").tolist())
        if shape != (rows, cols) or packed.shape != (rows, cols * s.bits // 32) \
                or scale.shape != (rows, s.groups(cols)):
            raise OverlayError(f"{file}: tensors of {name} do not match the config's shape {[rows, cols]}")
        zp = None if s.symmetric else unpack_zero_points(get("weight_zero_point"), s.bits, rows)
        tables[name] = QuantizedTable(packed, scale, zp, s.bits, s.group_size, (rows, cols))
    return Overlay(p, cfg, tables, file)
