"""torch dtype tables of the format, each defined once."""

from __future__ import annotations

import torch

from embedq.errors import SchemeError
from embedq.format.constants import ST_FLOAT_NAMES

# Config names of the float dtypes a table or its scales may have.
DTYPE_NAMES: dict[torch.dtype, str] = {
    torch.bfloat16: "bfloat16",
    torch.float16: "float16",
    torch.float32: "float32",
}
NAME_DTYPES: dict[str, torch.dtype] = {v: k for k, v in DTYPE_NAMES.items()}
# Safetensors float names -> torch (tables embedq quantizes).
ST_TO_TORCH: dict[str, torch.dtype] = {st: NAME_DTYPES[n] for st, n in ST_FLOAT_NAMES.items()}
# Every safetensors dtype embedq writes or copies.
ST_NAME_TO_DTYPE: dict[str, torch.dtype] = {
    "I8": torch.int8, "U8": torch.uint8, "I16": torch.int16, "I32": torch.int32, "I64": torch.int64,
    "F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64,
    "BOOL": torch.bool,
}
DTYPE_TO_ST_NAME: dict[torch.dtype, str] = {v: k for k, v in ST_NAME_TO_DTYPE.items()}


def dtype_from_name(name: str) -> torch.dtype:
    """The torch dtype of a config dtype name (``bfloat16`` ...)."""
    try:
        return NAME_DTYPES[name]
    except KeyError:
        raise SchemeError(f"unsupported dtype {name!r} (expected one of {sorted(NAME_DTYPES)})") from None
