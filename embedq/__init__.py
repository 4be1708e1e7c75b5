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
from importlib.util import find_spec

from embedq.errors import EmbedqError
from embedq.jobs.report import ModuleReport, Report
from embedq.version import __version__


def quantize(path, bits: int | None = None, *, recipe=None, **options) -> Report:
    """Quantize a checkpoint's embedding (and head) into an overlay.

    The options are those of ``embedq quantize`` (``group_size``, ``symmetric``, ``method``,
    ``lm_head``, ``head_bits``, ``targets``, ``output``, ``max_kld``, ...; see
    :meth:`embedq.jobs.recipe.QuantizeRecipe.from_options`), or a ready ``recipe``
    (:class:`embedq.jobs.recipe.QuantizeRecipe`). With ``max_kld`` / ``auto`` the scheme is
    measured (:mod:`embedq.quality.select`); the selection is in ``report.extra["auto"]``.
    """
    from embedq.jobs.recipe import QuantizeRecipe
    if recipe is None:
        recipe = QuantizeRecipe.from_options(bits, **options)
    elif bits is not None or options:
        raise TypeError("embedq.quantize: pass a recipe or options, not both")
    if recipe.search is not None:
        from embedq.quality.select import quantize_auto
        return quantize_auto(path, recipe)[0]
    from embedq.jobs.quantize import quantize_checkpoint
    return quantize_checkpoint(path, recipe)


def inspect(path, revision: str | None = None) -> dict:
    """Targets, tie status and bytes now / after int8 / after Q4 for a checkpoint folder or a
    Hub id (``org/name``: config.json and safetensors headers only, no weights); for a GGUF
    file, its tables and the size after :func:`gguf`."""
    if str(path).endswith(".gguf") or os.path.isfile(path):
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


def push(folder, repo_id: str, private: bool = False, revision: str | None = None,
         dry_run: bool = False, token: str | None = None, **kwargs):
    """Upload an embedq checkpoint or overlay bundle to the Hub (see :func:`embedq.hub.push.push`)."""
    from embedq.hub.push import push as _push
    return _push(folder, repo_id, private=private, revision=revision, dry_run=dry_run, token=token,
                 **kwargs)


def apply(base, overlay, force: bool = False) -> Report:
    """Lay an overlay-only bundle onto a local copy of its base, in place (see
    :func:`embedq.jobs.apply.apply_overlay`)."""
    from embedq.jobs.apply import apply_overlay
    return apply_overlay(base, overlay, force=force)


def load(path, **from_pretrained_kwargs):
    """Load a checkpoint with an embedq overlay into transformers (quantized modules)."""
    from embedq.backends.transformers import load as _load
    return _load(path, **from_pretrained_kwargs)


def evaluate(path, **kwargs):
    """KLD of the overlaid model against the float one (see :func:`embedq.quality.evaluate.evaluate`)."""
    from embedq.quality.evaluate import evaluate as _evaluate
    return _evaluate(path, **kwargs)


def plan(path, gpu_mem="32GiB", **kwargs):
    """KV-cache capacity before/after the overlay (see :func:`embedq.capacity.plan.plan`)."""
    from embedq.capacity.plan import plan as _plan
    return _plan(path, gpu_mem, **kwargs)


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
