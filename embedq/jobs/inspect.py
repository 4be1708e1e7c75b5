"""``embedq inspect``: what embedq would quantize, and what it would save."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, fields

from embedq.format.checkpoint import HubCheckpoint, open_checkpoint
from embedq.format.constants import ST_FLOAT_NAMES
from embedq.format.kept import check_settled
from embedq.format.scheme import Scheme
from embedq.jobs.targets import find_targets


def _size(shape, scheme: Scheme, src_bytes: int) -> int | None:
    try:
        scheme.check_shape(shape, "")
    except Exception:
        return None
    scale_bytes = {"float32": 4, "float16": 2, "bfloat16": 2}.get(scheme.scale_dtype, src_bytes)
    return scheme.overlay_bytes(shape, scale_bytes)


@dataclass(frozen=True)
class InspectTensor:
    """One target tensor: where it is, and its bytes now / after the int8 and Q4 g32 defaults
    (None: that scheme cannot represent its shape)."""

    role: str            # embedding | head | mtp | per_layer (quantized with --per-layer-embeddings)
    tensor: str
    file: str
    shape: list[int]
    dtype: str
    bytes: int
    bytes_int8: int | None
    bytes_q4_g32: int | None


@dataclass(frozen=True)
class InspectResult:
    """What ``embedq inspect`` found; :meth:`to_dict` is what ``--json`` prints."""

    path: str
    hub: bool
    sharded: bool
    files: int
    targets_from: str
    config_tie_word_embeddings: bool | None
    head_tensor: str | None
    head_module: str | None
    head_identical: bool | None
    tensors: tuple[InspectTensor, ...]
    existing_quantization: str | None

    def to_dict(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["tensors"] = [asdict(t) for t in self.tensors]
        return d

    def __getitem__(self, key: str):
        """``result["tensors"]``: the dict view (what ``embedq.inspect`` returned before)."""
        return self.to_dict()[key]


def inspect_checkpoint(path: str | os.PathLike, revision: str | None = None) -> InspectResult:
    """Targets found, tie status and bytes now / after the int8 / Q4 g32 defaults per tensor.

    ``path`` is a checkpoint folder or a Hub id (``org/name``, read header-only: config.json
    and safetensors headers, no weights; ``revision`` picks a branch, tag or commit).
    Imports neither torch nor transformers when the model class's facts are cached
    (:mod:`embedq.jobs.archfacts`).
    """
    if revision is None and os.path.isdir(path):
        check_settled(path)  # a killed re-commit: config.json the original's, the tables new
    ckpt = open_checkpoint(path, revision=revision)
    t, tied_cfg = find_targets(ckpt)
    names = [("embedding", t.embedding)]
    if t.head:
        names.append(("head", t.head))
    names += [("mtp", n) for n in t.extra_embeddings]
    names += [("per_layer", n) for n in t.per_layer]
    rows = []
    for role, n in names:
        info = ckpt.tensor(n)
        numel = 1
        for d in info.shape:
            numel *= d
        isz = info.nbytes // numel if info.dtype in ST_FLOAT_NAMES and numel else 0
        rows.append(InspectTensor(
            role=role, tensor=n, file=info.file, shape=list(info.shape), dtype=info.dtype,
            bytes=info.nbytes,
            bytes_int8=_size(info.shape, Scheme.default(8).fit(info.shape[-1]), isz),  # the default
            bytes_q4_g32=_size(info.shape, Scheme.default(4), isz)))
    identical = ckpt.tensors_identical(t.embedding, t.head) if t.head else None
    qc = ckpt.existing_quantization_config()
    return InspectResult(
        path=str(ckpt.path), hub=isinstance(ckpt, HubCheckpoint), sharded=ckpt.sharded,
        files=len(ckpt.files()), targets_from=t.source, config_tie_word_embeddings=tied_cfg,
        head_tensor=t.head, head_module=t.head_module, head_identical=identical,
        tensors=tuple(rows), existing_quantization=(qc or {}).get("quant_method"))


def format_inspect(result: InspectResult | dict) -> str:
    d = result.to_dict() if isinstance(result, InspectResult) else result
    lines = [f"{d['path']}: {d['files']} weight file(s), targets from {d['targets_from']}",
             f"tie_word_embeddings={d['config_tie_word_embeddings']} head tensor={d['head_tensor'] or '(none)'}"
             + ("" if d["head_identical"] is None else f" identical={d['head_identical']}")
            + (f" head module={d['head_module']}" if d.get("head_module") and not d["head_tensor"] else "")]
    if d["existing_quantization"]:
        lines.append(f"existing quantization: {d['existing_quantization']}")
    fmt = "{:<10} {:<42} {:<14} {:<5} {:>10} {:>10} {:>10}"
    lines.append(fmt.format("role", "tensor", "shape", "dtype", "MB now", "MB int8", "MB Q4g32"))
    mb = lambda b: "n/a" if b is None else f"{b / 1e6:.1f}"  # noqa: E731
    for r in d["tensors"]:
        lines.append(fmt.format(r["role"], r["tensor"], "x".join(map(str, r["shape"])), r["dtype"],
                                mb(r["bytes"]), mb(r["bytes_int8"]), mb(r["bytes_q4_g32"])))
    if any(r["role"] == "per_layer" for r in d["tensors"]):
        lines.append("per_layer: quantized only with --per-layer-embeddings (with the table's scheme)")
    return "\n".join(lines)
