"""embedq: offline int8/4-bit quantization of embedding and lm_head tables.

>>> import embedq
>>> report = embedq.quantize("./model", bits=8)   # in-place overlay
>>> print(report)                                  # summary table
>>> embedq.verify("./model"); embedq.remove("./model")

This module is the public API: plain functions over the layers below (see
docs/architecture.md). Each imports its layer only when called, so ``import embedq``
stays cheap.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from importlib.util import find_spec
from typing import TYPE_CHECKING, Any

from embedq.errors import EmbedqError
from embedq.jobs.report import ModuleReport, Report
from embedq.version import __version__

if TYPE_CHECKING:  # the layers are imported when called
    from embedq.jobs.inspect import InspectResult
    from embedq.jobs.recipe import QuantizeRecipe

# quantize's keyword defaults: a keyword left at its default is not passed on, so the recipe
# tells "not given" (the scheme defaults, DEFAULT_SCHEMES) from an explicit value.
_QUANTIZE_DEFAULTS = dict(group_size=None, symmetric=None, method=None, scale_dtype=None, head_bits=None,
                          head_group_size=None, head_symmetric=None, lm_head=False, per_layer_embeddings=False,
                          targets=None, trust=None, output=None, overlay_only=False, force=False, format="embedq",
                          max_kld=None, auto=False, chunk_rows=None, progress=True, base_model=None,
                          base_revision=None, eval_results=None, calibration=None)


def _given(value, default) -> bool:
    return value is not None if default is None else value != default


def quantize(path: str | os.PathLike, bits: int | None = None, *,
             group_size: int | None = None, symmetric: bool | None = None, method: str | None = None,
             scale_dtype: str | None = None, head_bits: int | None = None,
             head_group_size: int | None = None, head_symmetric: bool | None = None,
             lm_head: bool = False, per_layer_embeddings: bool = False,
             targets: Sequence[str] | None = None, trust: str | None = None,
             output: str | os.PathLike | None = None, overlay_only: bool = False, force: bool = False,
             format: str = "embedq", max_kld: float | None = None, auto: bool = False,
             chunk_rows: int | None = None, progress: bool = True, base_model: str | None = None,
             base_revision: str | None = None, eval_results: Any = None, calibration: Any = None,
             recipe: "QuantizeRecipe | None" = None) -> Report:
    """Quantize a checkpoint's embedding (and head) into an overlay.

    The keywords are the flags of ``embedq quantize`` (``--group-size`` (0: per row),
    ``--asym`` (``symmetric=False``), ``--method``, ``--lm-head``, ``--head-bits``,
    ``--per-layer-embeddings``, ``--output``, ``--max-kld`` ...), what is not given taken from the defaults
    (:data:`embedq.format.scheme.DEFAULT_SCHEMES`); they build the same
    :class:`embedq.jobs.recipe.QuantizeRecipe` the command builds. Or pass a ready
    ``recipe`` (and nothing else). With ``max_kld`` / ``auto`` the scheme is measured
    (:mod:`embedq.quality.select`); the selection is in ``report.extra["auto"]``.
    """
    from embedq.jobs.recipe import QuantizeRecipe
    options = {k: v for k, v in dict(
        group_size=group_size, symmetric=symmetric, method=method, scale_dtype=scale_dtype,
        head_bits=head_bits, head_group_size=head_group_size, head_symmetric=head_symmetric,
        lm_head=lm_head, per_layer_embeddings=per_layer_embeddings, targets=targets, trust=trust,
        output=output, overlay_only=overlay_only,
        force=force, format=format, max_kld=max_kld, auto=auto, chunk_rows=chunk_rows,
        progress=progress, base_model=base_model, base_revision=base_revision,
        eval_results=eval_results, calibration=calibration).items() if _given(v, _QUANTIZE_DEFAULTS[k])}
    if recipe is None:
        recipe = QuantizeRecipe.from_options(bits, **options)
    elif bits is not None or options:
        raise TypeError("embedq.quantize: pass a recipe or options, not both")
    elif not isinstance(recipe, QuantizeRecipe):
        raise TypeError(f"embedq.quantize: recipe must be a QuantizeRecipe, got {type(recipe).__name__}")
    if recipe.search is not None:
        from embedq.quality.select import quantize_auto
        return quantize_auto(path, recipe)[0]
    from embedq.jobs.quantize import quantize_checkpoint
    return quantize_checkpoint(path, recipe)


def inspect(path: str | os.PathLike, revision: str | None = None) -> "InspectResult":
    """Targets, tie status and bytes now / after int8 / after Q4 for a checkpoint folder or a
    Hub id (``org/name``: config.json and safetensors headers only, no weights): an
    :class:`embedq.jobs.inspect.InspectResult` (``.to_dict()``: what ``--json`` prints); for a
    GGUF file, its tables and the size after :func:`gguf`."""
    from embedq.format.files import inspect_target
    if inspect_target(path) == "gguf":  # by content; another file: one CheckpointError
        from embedq.backends.gguf import inspect_gguf
        return inspect_gguf(path)
    from embedq.jobs.inspect import inspect_checkpoint
    return inspect_checkpoint(path, revision=revision)


def remove(path) -> list[str]:
    """Remove an in-place overlay, restoring config.json and the index byte for byte."""
    from embedq.jobs.state import remove_overlay
    return remove_overlay(path)


def verify(path) -> Report:
    """Re-read an overlay, check its checksums against the source, report error metrics."""
    from embedq.jobs.verify import verify_overlay
    return verify_overlay(path)


def load_overlay(path):
    """The overlay's config and packed tables (see :class:`embedq.format.reader.Overlay`)."""
    from embedq.format.reader import load_overlay as _load
    return _load(path)


def push(folder: str | os.PathLike, repo_id: str, private: bool = False, revision: str | None = None,
         dry_run: bool = False, token: str | None = None, *, commit_message: str | None = None,
         update_card: bool = True, progress: bool = True, include: list[str] | None = None):
    """Upload an embedq checkpoint or overlay bundle to the Hub (see :func:`embedq.hub.push.push`)."""
    from embedq.hub.push import push as _push
    return _push(folder, repo_id, private=private, revision=revision, dry_run=dry_run, token=token,
                 commit_message=commit_message, update_card=update_card, progress=progress,
                 include=include)


def apply(base, overlay, force: bool = False) -> Report:
    """Lay an overlay-only bundle onto a local copy of its base, in place (see
    :func:`embedq.jobs.apply.apply_overlay`)."""
    from embedq.jobs.apply import apply_overlay
    return apply_overlay(base, overlay, force=force)


def load(path, *, activations: str | None = None, **from_pretrained_kwargs):
    """Load a checkpoint with an embedq overlay into transformers (quantized modules).
    ``activations="int8"``: 4-bit heads with int8 activations (opt-in, not exact)."""
    from embedq.backends.transformers import load as _load
    return _load(path, activations=activations, **from_pretrained_kwargs)


def evaluate(path: str | os.PathLike, *, text: str | os.PathLike | None = None, contexts: int = 12,
             length: int = 128, reference: str | os.PathLike | None = None, dtype="float32",
             float_head: bool = False, tokens=None, bos: int | None | str = "auto",
             bootstrap: int = 2000, seed: int = 0, progress: bool = True, device: str | None = None,
             floor: bool | None = None, activations: str | None = None):
    """KLD of the overlaid model against the float one (see :func:`embedq.quality.evaluate.evaluate`;
    the keywords are ``embedq eval``'s flags)."""
    from embedq.quality.evaluate import evaluate as _evaluate
    return _evaluate(path, text=text, contexts=contexts, length=length, reference=reference, dtype=dtype,
                     float_head=float_head, tokens=tokens, bos=bos, bootstrap=bootstrap, seed=seed,
                     progress=progress, device=device, floor=floor, activations=activations)


def plan(path: str | os.PathLike, gpu_mem: str | int = "32GiB", *, kv_dtype: str = "auto",
         max_model_len: int | None = None, gpu_memory_utilization: float = 0.9,
         reserve: str | int | None = None, max_num_batched_tokens: int = 8192, max_num_seqs: int = 256,
         bits: int | None = None, group_size: int | None = None, symmetric: bool | None = None,
         weights_gib: float | str | None = None, revision: str | None = None,
         block_size: int | None = None, prefix_caching: bool = True, async_scheduling: bool = True,
         gdn_checkpoints: bool = False, mamba_ssm_cache_dtype: str = "auto"):
    """KV-cache capacity before/after the overlay (see :func:`embedq.capacity.plan.plan`; the
    keywords are ``embedq plan``'s flags)."""
    from embedq.capacity.plan import plan as _plan
    return _plan(path, gpu_mem, kv_dtype=kv_dtype, max_model_len=max_model_len,
                 gpu_memory_utilization=gpu_memory_utilization, reserve=reserve,
                 max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs, bits=bits,
                 group_size=group_size, symmetric=symmetric, weights_gib=weights_gib, revision=revision,
                 block_size=block_size, prefix_caching=prefix_caching, async_scheduling=async_scheduling,
                 gdn_checkpoints=gdn_checkpoints, mamba_ssm_cache_dtype=mamba_ssm_cache_dtype)


def gguf(base, overlay, output, force: bool = False):
    """A llama.cpp GGUF with the overlay's tables as Q8_0 / Q4_0, exactly (see
    :func:`embedq.backends.gguf.transcode`)."""
    from embedq.backends.gguf import transcode
    return transcode(base, overlay, output, force=force)


def _register_with_transformers() -> None:
    """Make ``AutoModel*.from_pretrained`` understand ``quant_method: embedq``.

    Registration goes through transformers' public decorators and so imports
    transformers (seconds). The ``embedq`` command never needs it (it loads models
    through :func:`load`, which registers), so its process skips it; so does
    ``EMBEDQ_NO_TRANSFORMERS=1``.
    """
    if os.environ.get("EMBEDQ_NO_TRANSFORMERS") == "1":
        return
    if os.path.basename(sys.argv[0] if sys.argv else "") == "embedq":
        return
    orig = getattr(sys, "orig_argv", [])
    if "-m" in orig[:-1] and orig[orig.index("-m") + 1] in ("embedq", "embedq.cli"):
        return  # `python -m embedq.cli`: the command, spelled otherwise
    if find_spec("transformers") is None:
        return
    from embedq.backends.transformers import register
    register()


_register_with_transformers()

__all__ = ["quantize", "load", "evaluate", "plan", "inspect", "remove", "verify", "load_overlay", "push",
           "apply", "gguf", "Report", "ModuleReport", "EmbedqError", "__version__"]
