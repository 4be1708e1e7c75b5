"""The ``quantization_config.json`` schema (overlay contract §3)."""

from __future__ import annotations

from embedq.errors import OverlayError
from embedq.format.constants import FORMAT_VERSION, QUANT_METHOD, is_head_name
from embedq.format.scheme import Scheme



def onnx_block_size(scheme: Scheme, cols: int) -> int | None:
    """Block size ONNX Runtime uses for this table, or None if it has none.

    The largest power of two dividing the group (per row: the whole row); each
    group becomes ``group/block`` blocks repeating its scale and zero point.
    ONNX Runtime needs a block of at least 16. Must agree with
    :func:`embedq.backends.onnx.onnx_block_size`.
    """
    g = cols if scheme.group_size is None else scheme.group_size
    b = g & -g
    return b if b >= 16 else None


def module_entry(scheme: Scheme, shape: tuple[int, int], scale_dtype: str, source: dict,
                 checksums: dict[str, str] | None = None) -> dict:
    entry = {
        "num_bits": scheme.bits,
        "type": "int",
        "symmetric": scheme.symmetric,
        "strategy": scheme.strategy,
        "group_size": scheme.group_size,
        "scale_dtype": scale_dtype,
        "method": scheme.method,
        "shape": list(shape),
        "source": source,
    }
    if checksums:
        entry["checksums"] = checksums
    return entry


def scheme_of(entry: dict) -> Scheme:
    """The :class:`Scheme` a module entry describes."""
    try:
        return Scheme(bits=int(entry["num_bits"]), symmetric=bool(entry["symmetric"]),
                      group_size=entry.get("group_size"), method=entry.get("method", "rtn"),
                      scale_dtype=entry.get("scale_dtype"))
    except KeyError as e:
        raise OverlayError(f"quantization_config: module entry lacks {e}") from None


def build_config(modules: dict[str, dict], tied: bool, aliases: dict[str, str],
                 base_quantization_config: dict | None) -> dict:
    onnx: dict[str, dict] = {}
    for name, e in modules.items():
        s = scheme_of(e)
        b = onnx_block_size(s, e["shape"][1])
        if b is not None:
            onnx[name] = {"op": "GatherBlockQuantized", "bits": s.bits, "block_size": b}
    for alias, owner in aliases.items():
        if owner in onnx and is_head_name(alias):
            onnx[alias] = {"op": "MatMulNBits", "shares": owner, "bits": onnx[owner]["bits"],
                           "block_size": onnx[owner]["block_size"]}
    for name, e in modules.items():
        if e.get("role") == "head" and name in onnx:
            onnx[name]["op"] = "MatMulNBits"
    return {
        "quant_method": QUANT_METHOD,
        "format_version": FORMAT_VERSION,
        "overlay": "embedq.safetensors",
        "modules": modules,
        "tie_word_embeddings": tied,
        "aliases": aliases,
        "base_quantization_config": base_quantization_config,
        "onnx": onnx,
    }


def validate_config(cfg: dict, where: str) -> dict:
    """Check the fields every back end relies on; raise OverlayError naming ``where``."""
    if cfg.get("quant_method") != QUANT_METHOD:
        raise OverlayError(f"{where}: quant_method is {cfg.get('quant_method')!r}, not {QUANT_METHOD!r}")
    if cfg.get("format_version") != FORMAT_VERSION:
        raise OverlayError(f"{where}: unsupported format_version {cfg.get('format_version')!r}")
    mods = cfg.get("modules")
    if not isinstance(mods, dict) or not mods:
        raise OverlayError(f"{where}: no modules")
    for name, e in mods.items():
        scheme_of(e)
        if not isinstance(e.get("shape"), list) or len(e["shape"]) != 2:
            raise OverlayError(f"{where}: module {name} has no 2-D shape")
    for alias, owner in (cfg.get("aliases") or {}).items():
        if owner not in mods:
            raise OverlayError(f"{where}: alias {alias} -> {owner}, which is not a quantized module")
    return cfg
