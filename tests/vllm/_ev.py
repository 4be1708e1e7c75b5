"""The names the vLLM tests use, from where they live (entry point, layers, codec, format)."""

from embedq.backends.vllm import ENTRY_POINT, register  # noqa: F401
from embedq.backends.vllm.layers import EmbedqConfig, EmbedqMethod, EmbedqVocabParallelEmbedding  # noqa: F401
from embedq.format.codec import pack_zero_point_rows, zero_points_of  # noqa: F401
from embedq.format.compressed_tensors import compressed_tensors_config  # noqa: F401
from embedq.format.config import scheme_of as _scheme_of


def scheme_of(entry: dict) -> tuple[int, int | None, bool]:
    """(bits, group_size or None, symmetric) of a ``modules`` entry."""
    s = _scheme_of(entry)
    return s.bits, s.group_size, s.symmetric
