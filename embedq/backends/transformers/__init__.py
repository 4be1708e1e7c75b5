"""transformers back end: load an embedq overlay into a ``PreTrainedModel``.

After ``import embedq`` the ``embedq`` quant method is registered with transformers'
quantizer registry, so ``AutoModelForCausalLM.from_pretrained(path)`` loads an
in-place overlay or a derived checkpoint (``embedq quantize --output``) with
:class:`QuantizedEmbedding` / :class:`QuantizedLMHead` modules in place of the float
tables. :func:`load` does the same with the right auto class picked for you.

Memory: the modules keep exactly the overlay's tensors (``weight_packed`` int32,
``weight_scale``, ``weight_shape``, and the compressed-tensors packed
``weight_zero_point`` when asymmetric) as buffers — nothing else. A lookup gathers
and dequantizes only the requested rows; the head dequantizes the table in chunks
of rows while computing the logits, so no float copy of the table is ever held.
A tied model's embedding and head share one :class:`PackedTable`.

How the loading works (transformers 5.x): the quantizer replaces the target modules
on the meta-device skeleton with quantized ones whose buffers are non-persistent, so
transformers neither expects nor loads them (the float table, absent from a derived
checkpoint, is not expected either). After the weights are loaded the quantizer
reads the overlay file itself (:func:`embedq.load_overlay`) and copies its tensors
into the buffers, which transformers has already placed on the right device.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from embedq.backends.transformers.modules import (PackedTable, QuantizedEmbedding,  # noqa: F401
                                                  QuantizedLMHead, fill_tables, quantized_modules,
                                                  quantized_nbytes, replace_modules,
                                                  resolve_targets)
from embedq.errors import OverlayError
from embedq.format.constants import CONFIG_NAME, QUANT_METHOD
from embedq.format.checkpoint import check_folder_reads, check_weights
from embedq.jobs.archfacts import transformers_config
from embedq.format.files import inside
from embedq.format.reader import check_overlay_header, parse_overlay_config, read_overlay_config


# ---------------------------------------------------------------------------------------
# transformers registration


def register() -> None:
    """Register the ``embedq`` quant method with transformers (idempotent; imports it)."""
    import embedq.backends.transformers.quantizer  # noqa: F401  (registers on import)


# ---------------------------------------------------------------------------------------
# public entry point


def load(path: str | os.PathLike, model_class=None, activations: str | None = None, **from_pretrained_kwargs):
    """Load a checkpoint with an embedq overlay (in place or derived) into transformers.

    ``model_class`` defaults to the class config.json names in ``architectures`` (as
    transformers' auto classes resolve it: ``BertModel`` gives hidden states,
    ``GPTNeoXForCausalLM`` logits), else ``AutoModelForCausalLM`` (falling back to
    ``AutoModelForImageTextToText`` for multimodal configs). Extra keyword arguments go
    to ``from_pretrained`` (``dtype=``, ``device_map=`` ...). The returned model has
    :class:`QuantizedEmbedding` / :class:`QuantizedLMHead` modules and ``generate()``
    works as usual. ``activations="int8"`` serves 4-bit heads with int8 activations (an
    opt-in, not exact: :mod:`embedq.kernels.actquant`); default ``EMBEDQ_ACTIVATIONS``, else exact.
    """
    if activations is not None:
        from embedq.kernels import actquant
        try:
            actquant.mode(activations)
        except ValueError as e:
            raise OverlayError(f"{path}: {e}") from None
    p = Path(path)
    if not p.is_dir():
        raise OverlayError(f"{p}: no such checkpoint folder")
    parsed = parse_overlay_config(p)  # clear error when there is no overlay
    # transformers reads the folder by itself: nothing outside it, and only headers
    # embedq has checked (the weights' and the overlay's), so that bad input is one line.
    check_folder_reads(p)
    if (p / CONFIG_NAME).is_file():
        check_weights(p)
    if (p / parsed.overlay).exists():
        check_overlay_header(inside(p, parsed.overlay), parsed)
    register()
    import transformers
    cfg = transformers_config(p)  # a config transformers refuses is one line, here
    if model_class is None:
        model_class = _architecture_class(p)
    if model_class is None:
        model_class = transformers.AutoModelForCausalLM
        if type(cfg) not in transformers.AutoModelForCausalLM._model_mapping:
            model_class = getattr(transformers, "AutoModelForImageTextToText", model_class)
    qc = _config_quantization(p)
    if qc is None:
        # overlay-only bundle or a config.json without the quantization_config:
        # pass it explicitly so that transformers routes through embedq.
        cfg.quantization_config = read_overlay_config(p)
        from_pretrained_kwargs.setdefault("config", cfg)
    result = model_class.from_pretrained(str(p), **from_pretrained_kwargs)
    model = result[0] if isinstance(result, tuple) else result  # output_loading_info=True
    if not quantized_modules(model):
        raise OverlayError(f"{p}: loaded, but no module was replaced by the overlay")
    if activations is not None:
        for m in quantized_modules(model).values():
            if m.table.prepared is not None:
                m.table.prepared.use_activations(activations)
    return result


def _architecture_class(p: Path):
    """The transformers class named by config.json ``architectures[0]`` (None: not a
    transformers class, e.g. remote code; the auto classes decide then)."""
    import transformers
    try:
        arch = json.loads(inside(p, CONFIG_NAME).read_text()).get("architectures")
    except (OSError, ValueError, RecursionError, AttributeError):
        return None
    if not (isinstance(arch, list) and arch and isinstance(arch[0], str)):
        return None
    cls = getattr(transformers, arch[0], None)
    return cls if isinstance(cls, type) and hasattr(cls, "from_pretrained") else None


def _config_quantization(p: Path) -> dict | None:
    try:
        qc = json.loads(inside(p, CONFIG_NAME).read_text()).get("quantization_config")
    except (OSError, ValueError, RecursionError, AttributeError):
        return None
    return qc if isinstance(qc, dict) and qc.get("quant_method") == QUANT_METHOD else None


__all__ = ["PackedTable", "QuantizedEmbedding", "QuantizedLMHead", "load", "register",
           "quantized_modules", "quantized_nbytes", "resolve_targets", "replace_modules", "fill_tables"]
