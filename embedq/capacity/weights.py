"""Where a plan's model comes from (a checkpoint folder, a config-only folder, a Hub id) and
its resident weight bytes with float tables and with the overlay (on disk, or estimated).

A Hub repo is read header-only: config.json, then the safetensors headers through
:func:`embedq.format.checkpoint.open_hub` (HTTP Range; no byte of tensor data).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from embedq.capacity.layout import MODEL_DTYPE_BYTES, GiB, KVLayout, PlanError
from embedq.format.config import OverlayConfig
from embedq.format.constants import QUANT_METHOD

_SCALE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}  # an explicit --scale-dtype

DTYPE_BYTES = {"BF16": 2, "F16": 2, "F32": 4, "F64": 8, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
               "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "U32": 4, "U16": 2, "U64": 8}


def weight_bytes(path: str | os.PathLike, bits: int | None = None, group_size: int | None = None,
                 symmetric: bool | None = None) -> dict:
    """Resident weight bytes of a local checkpoint with float tables and with the overlay."""
    from embedq.format.checkpoint import Checkpoint
    return checkpoint_weights(Checkpoint.open(path), bits, group_size, symmetric)


def checkpoint_weights(ck, bits: int | None, group_size: int | None, symmetric: bool | None,
                       hub: tuple | None = None) -> dict:
    """Float and overlay weight bytes from safetensors headers (local or Hub).

    With an overlay (in place or derived) its real tensor bytes are used; without one,
    the overlay a ``bits`` / ``group_size`` run of ``embedq quantize`` would write is
    estimated (embedding only, plus a tied head that reads it). ``hub``: (overlay config
    or None, overlay header reader) of a Hub repo, whose files are not on disk.
    """
    from embedq.format.checkpoint import read_safetensors_header
    from embedq.format.scheme import Scheme
    sizes: dict[str, int] = {}
    for f in ck.files():
        _, header = ck.header(f)
        for k, v in header.items():
            if k != "__metadata__" and ck.weight_map.get(k) == f:
                sizes[k] = v["data_offsets"][1] - v["data_offsets"][0]
    qc = hub[0] if hub else overlay_config(ck)
    if qc is not None:
        if hub is None:
            overlay_file = ck.path / qc.overlay
            if not overlay_file.exists():
                raise PlanError(f"{overlay_file}: overlay file missing")
            _, oh = read_safetensors_header(overlay_file)
        else:
            oh = hub[1](qc.overlay)
        overlay = sum(v["data_offsets"][1] - v["data_offsets"][0] for k, v in oh.items() if k != "__metadata__")
        floats, drop = 0, set()
        for e in qc.modules.values():
            if e.source.tensor in drop:
                continue
            drop.add(e.source.tensor)
            floats += e.rows * e.cols * DTYPE_BYTES.get(st_dtype(e.source.dtype), 2)
        for alias in qc.aliases:
            drop.add(alias + ".weight")  # a tied head's duplicate is not resident
        base = sum(s for k, s in sizes.items() if k not in drop)
        schemes = sorted({e.scheme.label() for e in qc.modules.values()})
        return {"float": base + floats, "quantized": base + overlay, "float_tables": floats,
                "overlay": overlay, "overlay_source": "overlay on disk", "scheme": ", ".join(schemes)}
    from embedq.jobs.targets import find_targets
    t, tied_cfg = find_targets(ck)
    emb = ck.tensor(t.embedding)
    scheme = Scheme.default(bits, symmetric, group_size)
    if group_size is None and len(emb.shape) == 2:
        scheme = scheme.fit(emb.shape[1])
    scheme.check_shape(emb.shape, f"{ck.path / emb.file}: {t.embedding}")
    overlay = scheme.overlay_bytes(emb.shape, _SCALE_BYTES.get(scheme.scale_dtype, DTYPE_BYTES.get(emb.dtype, 2)))
    drop = {t.embedding}
    if t.head and tied_cfg:
        drop.add(t.head)
    base = sum(s for k, s in sizes.items() if k not in drop)
    return {"float": base + emb.nbytes, "quantized": base + overlay, "float_tables": emb.nbytes,
            "overlay": overlay, "overlay_source": "estimate (no overlay yet)", "scheme": scheme.label()}


def given_weights(total: int, layout: KVLayout, where: str, bits: int | None,
                  group_size: int | None, symmetric: bool | None) -> dict:
    """``--weights-gib``: float weights as given, the embedding (vocab x hidden) from config."""
    from embedq.format.scheme import Scheme
    shape = (layout.vocab_size, layout.hidden_size)
    scheme = Scheme.default(bits, symmetric, group_size)
    if group_size is None:
        scheme = scheme.fit(shape[1])
    scheme.check_shape(shape, f"{where}: embedding vocab_size x hidden_size")
    isz = MODEL_DTYPE_BYTES[layout.model_dtype]
    table = shape[0] * shape[1] * isz
    if table >= total:
        raise PlanError(f"--weights-gib {total / GiB:.2f}: smaller than the embedding table alone "
                        f"({table / GiB:.2f} GiB from {where})")
    overlay = scheme.overlay_bytes(shape, _SCALE_BYTES.get(scheme.scale_dtype, isz))
    return {"float": total, "quantized": total - table + overlay, "float_tables": table,
            "overlay": overlay, "overlay_source": "estimate from config.json and --weights-gib",
            "scheme": scheme.label()}


def st_dtype(name: str | None) -> str:
    return {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}.get(name or "", "BF16")


def overlay_config(ck) -> OverlayConfig | None:
    """The checkpoint's overlay config, validated by the one reader (None: no overlay)."""
    from embedq.format.checkpoint import QCONFIG_NAME
    from embedq.format.reader import parse_overlay_config
    qc = ck.config.get("quantization_config")
    if (ck.path / QCONFIG_NAME).exists() or (isinstance(qc, dict) and qc.get("quant_method") == QUANT_METHOD):
        return parse_overlay_config(ck.path)
    return None


# ---------------------------------------------------------------------------------------
# inputs: local checkpoint, config-only folder, Hub id


@dataclass
class Source:
    label: str
    config: dict
    config_where: str
    weights: object  # callable(bits, group_size, symmetric) -> dict, or None (config only)


def local_source(p: Path) -> Source:
    from embedq.format.checkpoint import CONFIG_NAME, Checkpoint, read_json
    if not p.is_dir():
        raise PlanError(f"{p}: not a directory")
    cfg_path = p / CONFIG_NAME
    if not cfg_path.exists():
        raise PlanError(f"{cfg_path}: no config.json in the checkpoint folder")
    has_weights = any(x.suffix == ".safetensors" for x in p.iterdir())
    if not has_weights:
        return Source(str(p), read_json(cfg_path), str(cfg_path), None)
    ck = Checkpoint.open(p)
    return Source(str(p), ck.config, str(cfg_path),
                  lambda b, g, s: checkpoint_weights(ck, b, g, s))


def hub_source(repo_id: str, revision: str | None, need_weights: bool) -> Source:
    """config.json of a Hub repo (huggingface_hub), and with ``need_weights`` its safetensors
    headers (:func:`embedq.format.checkpoint.open_hub`; no weight bytes)."""
    try:
        from huggingface_hub import HfApi
        from huggingface_hub.errors import (EntryNotFoundError, HfHubHTTPError, RepositoryNotFoundError,
                                            RevisionNotFoundError)
    except ImportError:  # pragma: no cover - huggingface_hub is a dependency
        raise PlanError(f"{repo_id}: planning a Hub model needs huggingface_hub") from None
    from embedq.errors import CheckpointError
    from embedq.format.checkpoint import open_hub
    where = f"{repo_id}/config.json"
    try:  # HF_ENDPOINT / HF_TOKEN as huggingface_hub reads them
        cfg_file = HfApi().hf_hub_download(repo_id, "config.json", revision=revision)
    except (RepositoryNotFoundError, RevisionNotFoundError) as e:
        raise PlanError(f"{repo_id}: no such directory or Hub model ({type(e).__name__})") from None
    except EntryNotFoundError:
        raise PlanError(f"{where}: not in the Hub repo") from None
    except (HfHubHTTPError, OSError) as e:
        raise PlanError(f"{where}: cannot download: {str(e).splitlines()[0]}") from None
    try:
        config = json.loads(Path(cfg_file).read_text())
    except ValueError:
        raise PlanError(f"{where}: not valid JSON") from None
    if not need_weights:
        return Source(repo_id, config, where, None)
    try:
        ck = open_hub(repo_id, revision)
    except CheckpointError as e:
        raise PlanError(f"{e}; pass --weights-gib to plan from config.json alone") from None
    from embedq.format.config import parse_config
    qc = config.get("quantization_config")
    qc = parse_config(qc, f"{where} (quantization_config)") \
        if isinstance(qc, dict) and qc.get("quant_method") == QUANT_METHOD else None

    def overlay_header(name: str) -> dict:
        return ck.header(name)[1]

    return Source(repo_id, config, where,
                  lambda b, g, s: checkpoint_weights(ck, b, g, s, (qc, overlay_header)))


def source(path, revision: str | None, need_weights: bool) -> Source:
    """The model ``plan`` reads: a local folder, else a Hub ``org/model`` id."""
    from embedq.format.checkpoint import HUB_ID
    p = Path(path)
    if p.exists():
        return local_source(p)
    if HUB_ID.fullmatch(str(path)) and not str(path).startswith((".", "/")):
        return hub_source(str(path), revision, need_weights)
    raise PlanError(f"{p}: no such directory (and not an org/model Hub id)")


__all__ = ["Source", "source", "weight_bytes", "checkpoint_weights", "given_weights", "DTYPE_BYTES"]
