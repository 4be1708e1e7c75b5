"""Reading a Hugging Face checkpoint folder without loading its weights."""

from __future__ import annotations

import json
import os
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path

from embedq.errors import CheckpointError

from embedq.format.constants import (CONFIG_NAME, INDEX_NAME, MAX_HEADER_BYTES,  # noqa: F401
                                     OVERLAY_NAME, QCONFIG_NAME, SINGLE_NAME, ST_DTYPE_BITS,
                                     STATE_DIR)
from embedq.format.files import check_links, inside, name_problem  # noqa: F401
from embedq.format.files import read_json as load_json


def read_json(path: Path) -> dict:
    """A JSON object file of a checkpoint (config.json, the index), read by the one reader."""
    data = load_json(path, CheckpointError, missing="file not found", constants=True)
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object")
    return data


# Types of the config.json fields embedq reads itself (and of text_config's): a config
# holding another type is refused here, once, instead of failing wherever it is read.
CONFIG_TYPES = {"quantization_config": dict, "tie_word_embeddings": bool, "text_config": dict,
                "architectures": list, "model_type": str, "vocab_size": int, "hidden_size": int,
                "num_hidden_layers": int}


def check_config(config: dict, where: str) -> dict:
    """Refuse a config.json whose fields embedq reads have the wrong type."""
    tc = config.get("text_config")
    for cfg, at in ((config, ""), (tc if isinstance(tc, dict) else {}, "text_config.")):
        for k, t in CONFIG_TYPES.items():
            v = cfg.get(k)
            if v is None:
                continue
            ok = isinstance(v, t) and not (t is int and (isinstance(v, bool) or v < 0))
            if k == "architectures":
                ok = ok and all(isinstance(a, str) for a in v)
            if not ok:
                want = {"dict": "an object", "bool": "true or false", "list": "a list of class names",
                        "str": "a string", "int": "a non-negative integer"}[t.__name__]
                raise CheckpointError(f"{where}: {at}{k} is {json.dumps(v)[:60]}, expected {want}")
    return config


def read_folder_json(folder: Path, name: str) -> dict:
    """:func:`read_json` of ``folder/name``, a file the folder must hold (:func:`inside`)."""
    return read_json(inside(folder, name))


def index_weight_map(index: dict, where: str, folder: Path | None = None) -> dict[str, str]:
    """The index's weight_map without the overlay's entries; every shard name a plain
    relative name and, given the ``folder``, a file inside it (:func:`inside`)."""
    wm = index.get("weight_map")
    if not isinstance(wm, dict) or not wm:
        raise CheckpointError(f"{where}: missing or empty weight_map")
    checked: set[str] = set()
    for k, v in wm.items():
        if isinstance(v, str) and v in checked:
            continue
        entry = f"{where}: weight_map entry {k[:120]!r}"
        if folder is None:
            problem = name_problem(v, plain=True)
            if problem:
                raise CheckpointError(f"{entry}: {str(v)[:200]!r} {problem}")
        else:
            inside(folder, v, named_by=entry, plain=True)
        checked.add(v)
    return {k: v for k, v in wm.items() if v != OVERLAY_NAME}


def check_folder_reads(folder: str | os.PathLike) -> None:
    """Before a library (transformers) reads ``folder`` by itself: no link in it leads
    out (tokenizer files, generation_config.json ...), and the index, if any, names only
    shards inside it (transformers opens ``folder/<weight_map value>`` as is)."""
    p = Path(folder)
    check_links(p)
    if (p / INDEX_NAME).is_file():
        index_weight_map(read_folder_json(p, INDEX_NAME), str(p / INDEX_NAME), p)


def check_weights(folder: str | os.PathLike) -> "Checkpoint":
    """The checkpoint at ``folder`` with the header of every shard read and checked, for
    a library that opens them all by itself (transformers refuses a header only with
    its own exception, after embedq handed it the folder)."""
    ck = Checkpoint.open(folder)
    for f in ck.files():
        ck.header(f)
    return ck


@dataclass
class TensorInfo:
    name: str
    file: str
    dtype: str  # safetensors name: BF16, F16, F32, ...
    shape: tuple[int, ...]
    data_offsets: tuple[int, int]
    header_len: int

    @property
    def nbytes(self) -> int:
        return self.data_offsets[1] - self.data_offsets[0]

    @property
    def file_offset(self) -> int:
        return 8 + self.header_len + self.data_offsets[0]


def check_header(header, where: str, n: int, size: int | None = None) -> dict:
    """Hold a parsed safetensors header to the rules safetensors' own reader enforces, so
    that nothing downstream (embedq, safe_open, a loader) meets a header it cannot read:
    string metadata; per tensor a known dtype, a shape of non-negative ints and data
    offsets that hold exactly its bytes; the tensors back to back from 0 and, when
    ``size`` is known, ending exactly at the end of the file (no trailing bytes)."""
    if not isinstance(header, dict):
        raise CheckpointError(f"{where}: corrupt safetensors header (not a JSON object)")
    meta = header.get("__metadata__", {})
    if meta is not None and (not isinstance(meta, dict)
                             or not all(isinstance(v, str) for v in meta.values())):
        raise CheckpointError(f"{where}: corrupt safetensors header (__metadata__ must map "
                              "names to strings)")
    spans = []
    for k, v in header.items():
        if k == "__metadata__":
            continue
        bad = f"{where}: corrupt safetensors header entry {k[:120]!r}"
        if not isinstance(v, dict):
            raise CheckpointError(f"{bad} (not an object)")
        dtype, shape, off = v.get("dtype"), v.get("shape"), v.get("data_offsets")
        if not isinstance(dtype, str) or dtype not in ST_DTYPE_BITS:
            raise CheckpointError(f"{bad} (dtype {str(dtype)[:40]!r} is not a safetensors dtype)")
        if not isinstance(shape, list) or any(type(d) is not int or d < 0 for d in shape):
            raise CheckpointError(f"{bad} (shape {str(shape)[:60]} is not a list of sizes)")
        if not (isinstance(off, list) and len(off) == 2 and all(type(x) is int for x in off)
                and 0 <= off[0] <= off[1]):
            raise CheckpointError(f"{bad} (data_offsets {str(off)[:60]} are not [begin, end])")
        bits = ST_DTYPE_BITS[dtype]
        for d in shape:
            bits *= d
        if bits % 8 or off[1] - off[0] != bits // 8:
            raise CheckpointError(f"{bad} ({dtype} {shape} needs {bits / 8:g} bytes, data_offsets "
                                  f"hold {off[1] - off[0]})")
        spans.append((off[0], off[1], k))
    spans.sort()
    end = 0
    for b, e, k in spans:
        if b != end:
            raise CheckpointError(f"{where}: corrupt safetensors header (tensor {k[:120]!r} starts at "
                                  f"byte {b}, expected {end}: overlapping or gapped data_offsets)")
        end = e
    if size is not None and 8 + n + end != size:
        what = "truncated" if 8 + n + end > size else "trailing bytes after the tensors in"
        raise CheckpointError(f"{where}: {what} safetensors file ({size} bytes, header "
                              f"describes {8 + n + end})")
    return header


def read_safetensors_header(path: Path) -> tuple[int, dict]:
    """Parse and validate a safetensors header (:func:`check_header`); errors name the file."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                raise CheckpointError(f"{path}: truncated safetensors file (no header)")
            (n,) = struct.unpack("<Q", raw)
            if n > min(size - 8, MAX_HEADER_BYTES):
                raise CheckpointError(f"{path}: corrupt safetensors header (length {n})")
            header = json.loads(f.read(n))
    except FileNotFoundError:
        raise CheckpointError(f"{path}: file not found") from None
    except IsADirectoryError:
        raise CheckpointError(f"{path}: a folder, not a safetensors file") from None
    except (ValueError, RecursionError):  # JSONDecodeError, UnicodeDecodeError
        raise CheckpointError(f"{path}: corrupt safetensors header (not JSON)") from None
    return n, check_header(header, str(path), n, size)


@dataclass
class Checkpoint:
    """A local HF checkpoint: config, weight files and where each tensor lives.

    Shards are only opened on demand (:meth:`tensor`), so opening a checkpoint
    costs one small read per shard at most.
    """

    path: Path
    config: dict
    sharded: bool
    weight_map: dict[str, str]  # tensor name -> file name (overlay entries excluded)
    index: dict | None = None
    _headers: dict[str, tuple[int, dict]] = field(default_factory=dict)

    @classmethod
    def open(cls, path: str | os.PathLike) -> "Checkpoint":
        p = Path(path)
        if not p.exists():
            raise CheckpointError(f"{p}: no such directory")
        if not p.is_dir():
            raise CheckpointError(f"{p}: not a directory")
        if not (p / CONFIG_NAME).exists() and not (p / CONFIG_NAME).is_symlink():
            raise CheckpointError(f"{p / CONFIG_NAME}: no config.json in the checkpoint folder")
        config = check_config(read_folder_json(p, CONFIG_NAME), str(p / CONFIG_NAME))
        if (p / INDEX_NAME).exists() or (p / INDEX_NAME).is_symlink():
            index = read_folder_json(p, INDEX_NAME)
            weight_map = index_weight_map(index, str(p / INDEX_NAME), p)
            for f in sorted(set(weight_map.values())):
                if not (p / f).is_file():
                    raise CheckpointError(f"{p / INDEX_NAME}: names shard {f!r}, which does not exist")
            return cls(p, config, True, weight_map, index)
        files = sorted(x.name for x in p.glob("*.safetensors") if x.name != OVERLAY_NAME)
        if not files:
            if list(p.glob("*.bin")) or list(p.glob("*.pt")) or list(p.glob("*.pth")):
                raise CheckpointError(
                    f"{p}: only PyTorch .bin weights found; embedq needs safetensors "
                    "(convert with transformers: model.save_pretrained(dir, safe_serialization=True))")
            raise CheckpointError(f"{p}: no *.safetensors weights found")
        if len(files) > 1 and SINGLE_NAME not in files:
            raise CheckpointError(f"{p}: several .safetensors files but no {INDEX_NAME}")
        f = SINGLE_NAME if SINGLE_NAME in files else files[0]
        inside(p, f)
        ck = cls(p, config, False, {}, None)
        ck.weight_map = {k: f for k in ck.header(f)[1] if k != "__metadata__"}
        return ck

    def header(self, file: str) -> tuple[int, dict]:
        if file not in self._headers:
            self._headers[file] = read_safetensors_header(self.path / file)
        return self._headers[file]

    def has(self, name: str) -> bool:
        return name in self.weight_map

    def tensor(self, name: str) -> TensorInfo:
        """Header facts for one tensor, opening only its shard."""
        try:
            file = self.weight_map[name]
        except KeyError:
            raise CheckpointError(f"{self.path}: no tensor {name!r} in the checkpoint") from None
        n, header = self.header(file)
        if name not in header:
            raise CheckpointError(
                f"{self.path / file}: index says it holds {name!r}, but the shard has no such tensor")
        h = header[name]
        return TensorInfo(name, file, h["dtype"], tuple(h["shape"]), tuple(h["data_offsets"]), n)

    def files(self) -> list[str]:
        return sorted(set(self.weight_map.values()))

    def tensors_identical(self, a: str, b: str) -> bool:
        """Whether tensors ``a`` and ``b`` hold the same bytes (shape and dtype included)."""
        ta, tb = self.tensor(a), self.tensor(b)
        if ta.shape != tb.shape or ta.dtype != tb.dtype:
            return False
        step = 8 << 20  # usually decided by the first block; keeps peak memory small
        with open(self.path / ta.file, "rb") as fa, open(self.path / tb.file, "rb") as fb:
            for off in range(0, ta.nbytes, step):
                n = min(step, ta.nbytes - off)
                if os.pread(fa.fileno(), n, ta.file_offset + off) != os.pread(fb.fileno(), n, tb.file_offset + off):
                    return False
        return True

    def existing_quantization_config(self) -> dict | None:
        return self.config.get("quantization_config")


# ---------------------------------------------------------------------------------------
# A checkpoint on the Hugging Face Hub, read header-only


HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")


def looks_like_hub_id(spec: str | os.PathLike) -> bool:
    """``org/name`` that is not an existing local path."""
    s = str(spec)
    return bool(HUB_ID.match(s)) and not Path(s).exists()


@dataclass
class HubCheckpoint(Checkpoint):
    """A Hub repository seen as a :class:`Checkpoint`, without its weights.

    Reads config.json (and the shard index when sharded) with huggingface_hub's session and
    auth headers (``build_hf_headers``; nothing is cached), and
    each shard's safetensors header with two HTTP Range requests (8 bytes of length,
    then exactly the header): no byte of tensor data is ever requested. Honors
    ``HF_ENDPOINT``, ``HF_TOKEN`` and the usual huggingface_hub settings.
    ``tensors_identical`` would need the data, so it answers None (unknown).
    """

    repo_id: str = ""
    revision: str | None = None
    token: str | bool | None = None

    def header(self, file: str) -> tuple[int, dict]:
        if file not in self._headers:
            self._headers[file] = _hub_header(self.repo_id, file, self.revision, self.token)
        return self._headers[file]

    def tensors_identical(self, a: str, b: str):  # type: ignore[override]
        return None


def _hub_error(repo_id: str, what: str, e: Exception) -> CheckpointError:
    return CheckpointError(f"{repo_id}: cannot read {what} from the Hub ({type(e).__name__}: {e})")


def _hub_request(repo_id: str, file: str, revision, token, method: str = "GET",
                 byte_range: tuple[int, int] | None = None):
    from urllib.parse import quote

    from huggingface_hub import constants, get_session
    from huggingface_hub.utils import build_hf_headers
    # The resolve URL as hf_hub_url builds it, on the endpoint configured now (HF_ENDPOINT).
    url = (f"{constants.ENDPOINT.rstrip('/')}/{repo_id}/resolve/"
           f"{quote(revision or constants.DEFAULT_REVISION, safe='')}/{quote(file)}")
    headers = build_hf_headers(token=token)
    if byte_range is not None:
        headers["range"] = f"bytes={byte_range[0]}-{byte_range[1]}"
    return get_session().request(method, url, headers=headers, follow_redirects=True,
                                 timeout=constants.HF_HUB_DOWNLOAD_TIMEOUT)


def _hub_range(repo_id: str, file: str, revision, token, start: int, end: int) -> bytes:
    from huggingface_hub.utils import hf_raise_for_status
    r = _hub_request(repo_id, file, revision, token, byte_range=(start, end))
    hf_raise_for_status(r)
    return r.content[: end - start + 1]


def _hub_exists(repo_id: str, file: str, revision, token) -> bool:
    from huggingface_hub.utils import hf_raise_for_status
    try:
        r = _hub_request(repo_id, file, revision, token, method="HEAD")
    except Exception as e:
        raise _hub_error(repo_id, file, e) from None
    if r.status_code == 404 and r.headers.get("X-Error-Code") == "EntryNotFound":
        return False
    try:
        hf_raise_for_status(r)
    except Exception as e:
        raise _hub_error(repo_id, file, e) from None
    return True


def _hub_header(repo_id: str, file: str, revision, token) -> tuple[int, dict]:
    where = f"{repo_id}/{file}"
    try:
        raw = _hub_range(repo_id, file, revision, token, 0, 7)
    except Exception as e:
        raise _hub_error(repo_id, file, e) from None
    if len(raw) < 8:
        raise CheckpointError(f"{where}: truncated safetensors file (no header)")
    (n,) = struct.unpack("<Q", raw)
    if n > MAX_HEADER_BYTES:
        raise CheckpointError(f"{where}: corrupt safetensors header (length {n})")
    try:
        body = _hub_range(repo_id, file, revision, token, 8, 8 + n - 1)
        header = json.loads(body)
    except CheckpointError:
        raise
    except (ValueError, RecursionError):
        raise CheckpointError(f"{where}: corrupt safetensors header (not JSON)") from None
    except Exception as e:
        raise _hub_error(repo_id, file, e) from None
    check_header(header, where, n)
    return n, header


def _hub_json(repo_id: str, file: str, revision, token) -> dict:
    from huggingface_hub.utils import hf_raise_for_status
    try:
        r = _hub_request(repo_id, file, revision, token)
        hf_raise_for_status(r)
        data = json.loads(r.content)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise CheckpointError(f"{repo_id}/{file}: not valid JSON") from None
    except Exception as e:
        raise _hub_error(repo_id, file, e) from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{repo_id}/{file}: expected a JSON object")
    return data


def open_hub(repo_id: str, revision: str | None = None, token: str | bool | None = None) -> HubCheckpoint:
    """Open a Hub model repository header-only: config.json, the index if sharded, and
    the safetensors headers of its shards (fetched lazily, by HTTP Range). No weights."""
    config = check_config(_hub_json(repo_id, CONFIG_NAME, revision, token), f"{repo_id}/{CONFIG_NAME}")
    sharded = _hub_exists(repo_id, INDEX_NAME, revision, token)
    single = not sharded and _hub_exists(repo_id, SINGLE_NAME, revision, token)
    label = repo_id if revision is None else f"{repo_id}@{revision}"
    if sharded:
        index = _hub_json(repo_id, INDEX_NAME, revision, token)
        weight_map = index_weight_map(index, f"{repo_id}/{INDEX_NAME}")
        return HubCheckpoint(Path(label), config, True, weight_map, index, repo_id=repo_id,
                             revision=revision, token=token)
    if not single:
        raise CheckpointError(f"{repo_id}: no {SINGLE_NAME} or {INDEX_NAME} on the Hub "
                              "(embedq needs safetensors weights)")
    ck = HubCheckpoint(Path(label), config, False, {}, None, repo_id=repo_id, revision=revision,
                       token=token)
    ck.weight_map = {k: SINGLE_NAME for k in ck.header(SINGLE_NAME)[1] if k != "__metadata__"}
    return ck


def open_checkpoint(spec: str | os.PathLike, revision: str | None = None,
                    token: str | bool | None = None) -> Checkpoint:
    """A local checkpoint folder, or a Hub id (``org/name``) read header-only."""
    if looks_like_hub_id(spec):
        return open_hub(str(spec), revision=revision, token=token)
    return Checkpoint.open(spec)
