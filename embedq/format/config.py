"""The ``quantization_config.json`` schema (overlay contract §3): build, and the one parse.

Every reader goes through :func:`parse_config`, which checks every field once (types,
ranges, names, shapes against the packed sizes) and returns a frozen
:class:`OverlayConfig`; anything else raises :class:`OverlayError` naming the file.
:func:`validate_config` (the dict interface older callers use) runs the same parse.
A downloaded folder is untrusted input: nothing here trusts a field it did not check.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, Mapping

from embedq.errors import EmbedqError, OverlayError
from embedq.format.constants import (FORMAT_VERSION, METHODS, OVERLAY_NAME, QUANT_METHOD,
                                     READABLE_FORMAT_VERSIONS, ROLES, ST_FLOAT_NAMES, SUPPORTED_BITS,
                                     is_embedding_name, may_replace, is_head_name)
from embedq.format.digest import DIGEST, VERSION_DIGESTS, digest_for
from embedq.format.files import read_json
from embedq.format.scheme import RowsCols, Scheme

# A module or tensor name: dotted identifiers, as in a PyTorch state dict.
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z0-9_]+)*")
_HEX256 = re.compile(r"[0-9a-f]{64}")  # sha256 and BLAKE3 (32-byte output) alike
MAX_NAME = 256
MAX_ROWS = 1 << 31          # no vocabulary comes near; keeps every size an int64
MAX_COLS = 1 << 20
MAX_ELEMENTS = 1 << 40
SCALE_ST_NAMES = {v: k for k, v in ST_FLOAT_NAMES.items()}  # "bfloat16" -> "BF16"


def _show(v: Any) -> str:
    r = repr(v)
    return r if len(r) <= 60 else r[:57] + "..."


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def onnx_block_size(scheme: Scheme, cols: int) -> int | None:
    """Block size ONNX Runtime uses for this table, or None (:meth:`Scheme.onnx_block_size`)."""
    return scheme.onnx_block_size(cols)


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


# ----------------------------------------------------------------------------- the parse

@dataclass(frozen=True)
class SourceRef:
    """The float tensor a module was made from; ``digest`` is its checksum (hex) in
    ``algorithm`` (the config's: sha256 for format 1, blake3 for format 2)."""

    tensor: str
    dtype: str | None
    digest: str | None
    algorithm: str = DIGEST


@dataclass(frozen=True)
class ModuleEntry(RowsCols):
    """One quantized module of a validated config."""

    name: str
    scheme: Scheme           # scale_dtype always set
    role: str
    shape: tuple[int, int]
    source: SourceRef
    checksums: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))

    @property
    def scale_dtype(self) -> str:
        return self.scheme.scale_dtype or "bfloat16"

    def tensors(self) -> dict[str, tuple[str, tuple[int, ...]]]:
        """The overlay tensors this entry declares: name -> (safetensors dtype, shape)."""
        return self.scheme.overlay_tensors(self.name, self.shape, SCALE_ST_NAMES[self.scale_dtype])

    def require_checksums(self, where: str, fix: str) -> None:
        """Refuse an entry without a recorded checksum for one of its tensors (every format
        version records one per tensor; one missing, from an edited or truncated config,
        would leave that tensor unchecked). ``fix``: what to do, for the message."""
        missing = sorted(set(self.tensors()) - set(self.checksums))
        if missing:
            raise OverlayError(f"{where}: module {self.name}: no checksum recorded for {missing[0]}, "
                               f"so the overlay cannot be checked; {fix}")


@dataclass(frozen=True)
class OverlayConfig:
    """A validated ``quantization_config``; ``where`` is the file it came from."""

    where: str
    overlay: str
    modules: Mapping[str, ModuleEntry]
    tied: bool
    aliases: Mapping[str, str]
    base_quantization_config: Mapping | None
    raw_json: str  # the validated dict, serialized (frozen); :meth:`to_dict` gives a copy
    format_version: int = FORMAT_VERSION

    @property
    def digest(self) -> str:
        """The algorithm of every checksum this config records (sha256 or blake3)."""
        return digest_for(self.format_version)

    def to_dict(self) -> dict:
        return json.loads(self.raw_json)

    def owner(self, module: str) -> str:
        """The module whose table ``module`` reads (itself, or its alias target)."""
        return self.aliases.get(module, module)

    def tensors(self) -> dict[str, tuple[str, tuple[int, ...]]]:
        """Every tensor the overlay file must hold, and nothing else."""
        out: dict[str, tuple[str, tuple[int, ...]]] = {}
        for e in self.modules.values():
            out.update(e.tensors())
        return out


def _scheme(e: Mapping, where: str, name: str) -> Scheme:
    """The scheme fields of one module entry, type- and range-checked."""
    def bad(msg: str) -> OverlayError:
        return OverlayError(f"{where}: module {name}: {msg}")

    for k in ("num_bits", "symmetric"):
        if k not in e:
            raise bad(f"lacks {k!r}")
    bits = e["num_bits"]
    if not _is_int(bits) or bits not in SUPPORTED_BITS:
        raise bad(f"num_bits must be one of {list(SUPPORTED_BITS)}, got {_show(bits)}")
    if e.get("type", "int") != "int":
        raise bad(f"type must be 'int', got {_show(e.get('type'))}")
    sym = e["symmetric"]
    if not isinstance(sym, bool):
        raise bad(f"symmetric must be true or false, got {_show(sym)}")
    g = e.get("group_size")
    if g is not None and (not _is_int(g) or g < 8 or g % 8 or g > MAX_COLS):
        raise bad(f"group_size must be null or a positive multiple of 8 (at most {MAX_COLS}), "
                  f"got {_show(g)}")
    strategy = e.get("strategy", "channel" if g is None else "group")
    if strategy not in ("channel", "group") or (strategy == "group") != (g is not None):
        raise bad(f"strategy {_show(strategy)} does not match group_size {_show(g)} "
                  "(channel: null, group: a number)")
    method = e.get("method", "rtn")
    if not isinstance(method, str) or method not in METHODS:
        raise bad(f"method must be one of {list(METHODS)}, got {_show(method)}")
    sd = e.get("scale_dtype", "bfloat16")
    if not isinstance(sd, str) or sd not in SCALE_ST_NAMES:
        raise bad(f"scale_dtype must be one of {sorted(SCALE_ST_NAMES)}, got {_show(sd)}")
    try:
        return Scheme(bits=bits, symmetric=sym, group_size=g, method=method, scale_dtype=sd)
    except EmbedqError as x:  # pragma: no cover - every field was checked above
        raise bad(str(x)) from None


def _check_name(v: Any, where: str, what: str) -> str:
    if not isinstance(v, str) or len(v) > MAX_NAME or not _NAME.fullmatch(v):
        raise OverlayError(f"{where}: {what} {_show(v)} is not a module/tensor name")
    return v


def _entry(name: str, e: Any, where: str, algo: str = DIGEST) -> ModuleEntry:
    if not isinstance(e, dict):
        raise OverlayError(f"{where}: module {name}: entry must be an object, got {_show(e)}")
    scheme = _scheme(e, where, name)
    role = e.get("role", "embedding")
    if not isinstance(role, str) or role not in ROLES:
        raise OverlayError(f"{where}: module {name}: role must be one of {list(ROLES)}, got {_show(role)}")
    # An overlay replaces embedding tables and heads, nothing else.
    if role == "head" and not may_replace(name, role):
        raise OverlayError(f"{where}: module {name} has role 'head' but is not an output "
                           "embedding (lm_head ...); an overlay replaces only embeddings and heads")
    if role == "per_layer" and not may_replace(name, role):
        raise OverlayError(f"{where}: module {name} has role 'per_layer' but is not a per-layer "
                           "input embedding (embed_tokens_per_layer); an overlay replaces only "
                           "embeddings and heads")
    if role != "head" and not may_replace(name, role):
        raise OverlayError(f"{where}: module {name} is not an embedding table (embed_tokens, wte ...); "
                           "an overlay replaces only embeddings and heads")
    shape = e.get("shape")
    if not isinstance(shape, list) or len(shape) != 2 or not all(_is_int(x) for x in shape):
        raise OverlayError(f"{where}: module {name}: shape must be [rows, cols] integers, got {_show(shape)}")
    rows, cols = shape
    if not (1 <= rows <= MAX_ROWS and 1 <= cols <= MAX_COLS and rows * cols <= MAX_ELEMENTS):
        raise OverlayError(f"{where}: module {name}: shape {_show(shape)} out of range")
    if not scheme.unit.fits(cols):
        raise OverlayError(f"{where}: module {name}: {cols} columns x {scheme.bits} bits is not "
                           "a whole number of int32 words")
    if scheme.group_size is not None and cols % scheme.group_size:
        raise OverlayError(f"{where}: module {name}: group_size {scheme.group_size} does not divide "
                           f"{cols} columns")
    src = e.get("source")
    if not isinstance(src, dict):
        raise OverlayError(f"{where}: module {name}: source must be an object naming the float tensor")
    tensor = _check_name(src.get("tensor"), where, f"module {name}: source tensor")
    if not tensor.endswith(".weight"):
        raise OverlayError(f"{where}: module {name}: source tensor {tensor} is not a .weight")
    stem = tensor[: -len(".weight")]
    if tensor != name + ".weight" and not (role == "head" and is_embedding_name(stem)):
        raise OverlayError(f"{where}: module {name}: source tensor {tensor} is not {name}.weight")
    dt = src.get("dtype")
    if dt is not None and (not isinstance(dt, str) or dt not in SCALE_ST_NAMES):
        raise OverlayError(f"{where}: module {name}: source dtype must be one of "
                           f"{sorted(SCALE_ST_NAMES)}, got {_show(dt)}")
    other = [a for a in VERSION_DIGESTS.values() if a != algo and a in src]
    if other:
        raise OverlayError(f"{where}: module {name}: source records {other[0]}, but this format "
                           f"version's checksums are {algo}")
    sha = src.get(algo)
    if sha is not None and (not isinstance(sha, str) or not _HEX256.fullmatch(sha)):
        raise OverlayError(f"{where}: module {name}: source {algo} is not 64 hex digits: {_show(sha)}")
    ref = SourceRef(tensor, dt, sha, algo)
    entry = ModuleEntry(name, scheme, role, (rows, cols), ref)
    ck = e.get("checksums") or {}
    if not isinstance(ck, dict):
        raise OverlayError(f"{where}: module {name}: checksums must be an object, got {_show(ck)}")
    declared = entry.tensors()
    for k, v in ck.items():
        if k not in declared:
            raise OverlayError(f"{where}: module {name}: checksum for {_show(k)}, which is not one "
                               "of its tensors")
        if not isinstance(v, str) or not _HEX256.fullmatch(v):
            raise OverlayError(f"{where}: module {name}: checksum of {k} is not 64 hex digits: {_show(v)}")
    return ModuleEntry(name, scheme, role, (rows, cols), ref, MappingProxyType(dict(ck)))


def parse_config(cfg: Any, where: str) -> OverlayConfig:
    """Validate a ``quantization_config`` dict; every error is an OverlayError naming ``where``."""
    if not isinstance(cfg, dict):
        raise OverlayError(f"{where}: expected a JSON object, got {type(cfg).__name__}")
    if cfg.get("quant_method") != QUANT_METHOD:
        raise OverlayError(f"{where}: quant_method is {_show(cfg.get('quant_method'))}, not {QUANT_METHOD!r}")
    fv = cfg.get("format_version")
    if not _is_int(fv) or fv not in READABLE_FORMAT_VERSIONS:
        raise OverlayError(f"{where}: unsupported format_version {_show(fv)}")
    algo = digest_for(fv)
    overlay = cfg.get("overlay", OVERLAY_NAME)
    if overlay != OVERLAY_NAME:  # a file name of this folder, never a path
        raise OverlayError(f"{where}: overlay must be {OVERLAY_NAME!r}, got {_show(overlay)}")
    mods = cfg.get("modules")
    if not isinstance(mods, dict) or not mods:
        raise OverlayError(f"{where}: no modules")
    modules = {}
    for name, e in mods.items():
        _check_name(name, where, "module")
        modules[name] = _entry(name, e, where, algo)
    tied = cfg.get("tie_word_embeddings", False)
    if not isinstance(tied, bool):
        raise OverlayError(f"{where}: tie_word_embeddings must be true or false, got {_show(tied)}")
    aliases = cfg.get("aliases")
    if aliases is None:
        aliases = {}
    if not isinstance(aliases, dict):
        raise OverlayError(f"{where}: aliases must be an object, got {_show(aliases)}")
    for alias, owner in aliases.items():
        _check_name(alias, where, "alias")
        if not isinstance(owner, str) or owner not in modules:
            raise OverlayError(f"{where}: alias {alias} -> {_show(owner)}, which is not a quantized module")
        if alias in modules:
            raise OverlayError(f"{where}: alias {alias} is also a quantized module")
        if not (may_replace(alias, "head") or may_replace(alias, "mtp")):
            raise OverlayError(f"{where}: alias {alias} is not an embedding or head; an overlay "
                               "replaces only embeddings and heads")
    base = cfg.get("base_quantization_config")
    if base is not None and (not isinstance(base, dict) or base.get("quant_method") == QUANT_METHOD):
        raise OverlayError(f"{where}: base_quantization_config must be null or another method's config")
    onnx = cfg.get("onnx")
    if onnx is not None:
        want = _onnx_block({n: (m.scheme, m.cols, m.role) for n, m in modules.items()}, aliases)
        if onnx != want:
            raise OverlayError(f"{where}: onnx block does not match the modules' schemes")
    try:
        raw = json.dumps(cfg, allow_nan=False)
    except (TypeError, ValueError) as x:
        raise OverlayError(f"{where}: not plain JSON ({x})") from None
    return OverlayConfig(where, overlay, MappingProxyType(modules), tied,
                         MappingProxyType(dict(aliases)),
                         None if base is None else MappingProxyType(dict(base)), raw, fv)


def read_config_file(path: str | os.PathLike) -> OverlayConfig:
    """Parse ``quantization_config.json`` (or a JSON file holding such a config)."""
    cfg = read_json(path, OverlayError, max_bytes=16 << 20, what="quantization config")
    return parse_config(cfg, str(Path(path)))


def scheme_of(entry: Mapping | ModuleEntry) -> Scheme:
    """The :class:`Scheme` a module entry describes (an OverlayError if it describes none)."""
    if isinstance(entry, ModuleEntry):
        return entry.scheme
    if not isinstance(entry, Mapping):
        raise OverlayError(f"quantization_config: module entry must be an object, got {_show(entry)}")
    s = _scheme(entry, "quantization_config", "entry")
    if "scale_dtype" not in entry:  # older callers: None means the source dtype
        return Scheme(bits=s.bits, symmetric=s.symmetric, group_size=s.group_size, method=s.method)
    return s


def _onnx_block(modules: Mapping[str, tuple[Scheme, int, str]], aliases: Mapping[str, str]) -> dict:
    onnx: dict[str, dict] = {}
    for name, (s, cols, _) in modules.items():
        b = onnx_block_size(s, cols)
        if b is not None:
            onnx[name] = {"op": "GatherBlockQuantized", "bits": s.bits, "block_size": b}
    for alias, owner in aliases.items():
        if owner in onnx and is_head_name(alias):
            onnx[alias] = {"op": "MatMulNBits", "shares": owner, "bits": onnx[owner]["bits"],
                           "block_size": onnx[owner]["block_size"]}
    for name, (_, _, role) in modules.items():
        if role == "head" and name in onnx:
            onnx[name]["op"] = "MatMulNBits"
    return onnx


def build_config(modules: dict[str, dict], tied: bool, aliases: dict[str, str],
                 base_quantization_config: dict | None) -> dict:
    onnx = _onnx_block({n: (scheme_of(e), e["shape"][1], e.get("role", "embedding"))
                        for n, e in modules.items()}, aliases)
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


def validate_config(cfg: Any, where: str) -> dict:
    """Run :func:`parse_config`; return ``cfg`` itself (for callers that read the dict)."""
    parse_config(cfg, where)
    return cfg


__all__ = ["ModuleEntry", "OverlayConfig", "SourceRef", "build_config", "module_entry",
           "onnx_block_size", "parse_config", "read_config_file", "scheme_of", "validate_config"]
