"""What ``embedq quantize`` says about a scheme: measured losses of Gemma 3 270M.

The numbers are data (``measured_gemma3_270m.json`` beside this module), written by
``python scripts/eval_gemma3.py --all --update-advice`` (docs/quality.md);
:mod:`embedq.quality.evaluate` re-exports them. A scheme with no measured row gets no
numbers in its warning.
"""

from __future__ import annotations

import json
from importlib.resources import files

from embedq.format.scheme import DEFAULT_GROUP

# Measured on the real Gemma 3 270M (tied, 262144 x 640 bf16) against the float32 model,
# 12 contexts x 128 tokens of pydoc_data/topics.py, BOS first, bf16 scales, plain RTN, as
# ``python scripts/eval_gemma3.py --all --update-advice`` writes measured_gemma3_270m.json
# (each row says which run measured it). Key: (bits, group size, symmetric, head), head =
# "shared", "float" (gather only, head kept bf16) or "int8" (``--head-bits 8``).
# Value: (mean KLD, same-top-1 %, overlay MB).
_DATA = json.loads(files("embedq.jobs").joinpath("measured_gemma3_270m.json").read_text())
MEASURED_GEMMA3_270M: dict[tuple, tuple[float, float, float]] = {
    (r["bits"], r["group_size"], r["symmetric"], r["head"]): (r["mean_kld"], r["same_top1"], r["overlay_MB"])
    for r in _DATA["rows"]}
# The float model itself run in bfloat16, same contexts: the noise users already accept.
FLOOR_GEMMA3_270M = (_DATA["floor"]["mean_kld"], _DATA["floor"]["same_top1"])
# A scheme is called lossy at a mean KLD of 0.005 nats/token (about what llama.cpp
# measures for a whole model at Q6_K, here for one table) or below 97% same top-1.
LOSSY_KLD = 0.005
LOSSY_TOP1 = 97.0


def _measured(bits: int, group: int | None, sym: bool, head: str) -> str:
    m = MEASURED_GEMMA3_270M.get((bits, group, sym, head))
    if m is None:
        return ""
    return f" (Gemma 3 270M: mean KLD {m[0]:.4g}, same top-1 {m[1]:.1f}%)"


def scheme_advice(scheme, config: dict | None = None, *, head_scheme=None, lm_head: bool = False
                  ) -> str | None:
    """One line of warning when our measurements show ``scheme`` lossy for this kind of model.

    ``scheme`` / ``head_scheme``: :class:`embedq.format.scheme.Scheme` of the embedding
    table and, when the head gets its own table (``--head-bits``, ``--lm-head``), of the
    head. ``config``: the checkpoint's config.json (decides tied or not). Returns None when
    the scheme is not known to be lossy. The measurements are of one tied model (Gemma 3
    270M, whose table has a block-32 origin), so untied int8 tables get no warning.
    """
    cfg = config or {}
    text = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else cfg
    tied = bool(text.get("tie_word_embeddings", cfg.get("tie_word_embeddings", True)))
    if tied:
        head = scheme if head_scheme is None else head_scheme
    else:
        head = (head_scheme or scheme) if lm_head else None
    g = scheme.group_size
    m8 = MEASURED_GEMMA3_270M[(8, DEFAULT_GROUP[8], True, "shared")]
    if head is not None and head.unit.lossy:
        where = "tied head" if tied and head_scheme is None else "quantized head"
        mh = MEASURED_GEMMA3_270M.get((4, 32, True, "int8"))
        q4h8 = (f" and a Q4 gather with --head-bits 8 still {mh[0]:.2g} at {mh[2]:.0f} MB" if mh else "")
        fix = (f"there the 8-bit default (--bits 8) measured {m8[0]:.2g} at {m8[2]:.0f} MB{q4h8} "
               "(bf16 table: 336 MB)" if tied else
               "quantize the head at 8 bits (--head-bits 8) or leave it float")
        return (f"4-bit {where} is lossy: the output projection reads the 4-bit table"
                f"{_measured(4, head.group_size, head.symmetric, 'shared')}; {fix}")
    if scheme.unit.lossy:
        extra = ""
        mh = MEASURED_GEMMA3_270M.get((4, 32, True, "int8"))
        if tied and mh and m8[0] < mh[0] and m8[2] < mh[2]:  # said only while the data shows it
            extra = (f"; there the 8-bit default for both (mean KLD {m8[0]:.2g}, {m8[2]:.0f} MB) beat a Q4 "
                     f"gather with its own int8 head table ({mh[0]:.2g}, {mh[2]:.0f} MB) on size and quality")
        return (f"4-bit embedding gather is lossy{_measured(4, g, scheme.symmetric, 'float')}{extra}; "
                "measure it with `embedq eval`")
    if tied and head_scheme is None and (g is None or g > 128):
        return (f"int8 {'per-row' if g is None else f'g{g}'} on a tied table is measurably lossy"
                f"{_measured(8, g, scheme.symmetric, 'shared')}; the default groups of {DEFAULT_GROUP[8]} "
                f"measured {m8[0]:.2g} ({m8[0] / FLOOR_GEMMA3_270M[0]:.2f}x what bf16 inference itself "
                f"adds) for ~3% more bytes")
    return None
