"""transformers' view of the ``embedq`` quant method, registered on import.

Importing this module (which imports transformers) registers :class:`EmbedqConfig` and
:class:`EmbedqHfQuantizer` through transformers' public ``register_quantization_config``
/ ``register_quantizer`` decorators; :func:`embedq.backends.transformers.register` does
that import. The quantizer swaps the target modules of the meta-device skeleton for
quantized ones before the weights load and fills them from the overlay afterwards.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path

import torch
from transformers import PreTrainedModel
from transformers.quantizers import register_quantization_config, register_quantizer
from transformers.quantizers.base import HfQuantizer
from transformers.utils.quantization_config import QuantizationConfigMixin

from embedq.backends.transformers.modules import fill_tables, replace_modules, resolve_targets
from embedq.errors import OverlayError
from embedq.format.config import parse_config
from embedq.format.constants import CONFIG_NAME, OVERLAY_SUFFIXES, QCONFIG_NAME, QUANT_METHOD


def _overlay_dir_from(checkpoint_files, config) -> Path:
    for f in checkpoint_files or []:
        d = Path(f).parent
        if (d / QCONFIG_NAME).exists() or (d / CONFIG_NAME).exists():
            return d
    name = getattr(config, "name_or_path", None) or getattr(config, "_name_or_path", None)
    if name and Path(name).is_dir():
        return Path(name)
    raise OverlayError("embedq: cannot locate the checkpoint folder holding the overlay "
                       "(only local folders are supported)")


@register_quantization_config(QUANT_METHOD)
class EmbedqConfig(QuantizationConfigMixin):
    """transformers' view of an embedq ``quantization_config`` (kept verbatim)."""

    def __init__(self, **kwargs):
        kwargs.setdefault("quant_method", QUANT_METHOD)
        for k, v in kwargs.items():
            setattr(self, k, v)
        self.quant_method = QUANT_METHOD

    def to_dict(self) -> dict:
        return {k: copy.deepcopy(v) for k, v in self.__dict__.items() if not k.startswith("_")}

@register_quantizer(QUANT_METHOD)
class EmbedqHfQuantizer(HfQuantizer):
    """Loads embedq overlays: quantized embedding / head modules, everything else float."""

    requires_calibration = True

    def validate_environment(self, *args, **kwargs):
        base = getattr(self.quantization_config, "base_quantization_config", None)
        if base:
            raise OverlayError(
                "embedq: this checkpoint also has a base quantization "
                f"({base.get('quant_method')!r}); the transformers back end only loads "
                "embedq overlays on float checkpoints (use vLLM)")
        dm = kwargs.get("device_map")
        if isinstance(dm, dict) and "disk" in dm.values():
            raise OverlayError("embedq: disk offload is not supported")

    def preprocess_model(self, model, dtype=None, **kwargs):
        self._dtype = dtype  # the base class does not pass it on
        return super().preprocess_model(model, dtype=dtype, **kwargs)

    def _process_model_before_weight_loading(self, model, checkpoint_files=None, **kwargs):
        qc = parse_config(self.quantization_config.to_dict(), "config.json quantization_config")
        self.overlay_dir = _overlay_dir_from(checkpoint_files, model.config)
        dtype = getattr(self, "_dtype", None)
        if not isinstance(dtype, torch.dtype):
            dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()),
                         torch.get_default_dtype())
        targets = resolve_targets(model, qc)
        self.tables = replace_modules(model, qc, dtype)
        # The replaced modules have no float weight: drop them from the tie
        # mapping of every (sub)model, and ignore their float / overlay tensors
        # when the shards list them (in-place sharded overlays, derived indexes).
        gone = tuple(targets)
        for _, sub in model.named_modules():
            if isinstance(sub, PreTrainedModel):
                tk = getattr(sub, "all_tied_weights_keys", None) or {}
                prefix = next((n + "." for n, m in model.named_modules() if m is sub and n), "")
                keep = {}
                for k, v in tk.items():
                    fk, fv = prefix + k, prefix + v
                    if any(fk.startswith(g + ".") or fv.startswith(g + ".") for g in gone):
                        continue
                    keep[k] = v
                sub.all_tied_weights_keys = keep
        pats = set(getattr(model, "_keys_to_ignore_on_load_unexpected", None) or [])
        names = set(qc.modules) | set(qc.aliases) | set(gone)
        for n in names:
            last = re.escape(n.split(".")[-1])
            pats.add(rf"(^|\.){last}\.(weight|{'|'.join(OVERLAY_SUFFIXES)})$")
        model._keys_to_ignore_on_load_unexpected = pats

    def _process_model_after_weight_loading(self, model, **kwargs):
        fill_tables(self.tables, self.overlay_dir)
        dtype = getattr(self, "_dtype", None)
        if not isinstance(dtype, torch.dtype):
            dtype = getattr(model, "dtype", torch.bfloat16)
        for table in self.tables.values():  # the serving layout, once, where the weights now are
            table.prepare(dtype)
        model.embedq_overlay = str(self.overlay_dir)
        return model

    def update_dtype(self, dtype):
        return dtype

    def is_serializable(self, *args, **kwargs):
        return False

    @property
    def is_trainable(self):
        return False
