"""embedq: offline int8/4-bit quantization of embedding and lm_head tables.

>>> import embedq
>>> report = embedq.quantize("./model", bits=8)   # in-place overlay
>>> print(report)                                  # summary table
>>> embedq.verify("./model"); embedq.remove("./model")
"""

from __future__ import annotations

__version__ = "0.1.0"

from embedq.errors import EmbedqError
from embedq.report import ModuleReport, Report


# ``embedq.quantize(path, bits=8, ...) -> Report`` is the callable subpackage
# embedq/quantize (see its __init__ for why).
from embedq import quantize  # noqa: E402


def inspect(path) -> dict:
    """Targets, tie status and bytes now / after int8 / after Q4 for a checkpoint."""
    from embedq.overlays.inspect import inspect_checkpoint
    return inspect_checkpoint(path)


def remove(path) -> list[str]:
    """Remove an in-place overlay, restoring config.json and the index byte for byte."""
    from embedq.overlays.state import remove_overlay
    return remove_overlay(path)


def verify(path) -> Report:
    """Re-read an overlay, check its checksums against the source, report error metrics."""
    from embedq.overlays.verify import verify_overlay
    return verify_overlay(path)


def load_overlay(path):
    """The overlay's config and packed tables (see :class:`embedq.overlays.reader.Overlay`)."""
    from embedq.overlays.reader import load_overlay as _load
    return _load(path)


def push(folder, repo_id: str, private: bool = False, revision: str | None = None,
         dry_run: bool = False, token: str | None = None, **kwargs):
    """Upload an embedq checkpoint or overlay bundle to the Hub (see :func:`embedq.publish.push`)."""
    from embedq.publish import push as _push
    return _push(folder, repo_id, private=private, revision=revision, dry_run=dry_run, token=token,
                 **kwargs)


def apply(base, overlay, force: bool = False) -> Report:
    """Lay an overlay-only bundle onto a local copy of its base, in place (see
    :func:`embedq.overlays.apply.apply_overlay`)."""
    from embedq.overlays.apply import apply_overlay
    return apply_overlay(base, overlay, force=force)


def load(path, **from_pretrained_kwargs):
    """Load a checkpoint with an embedq overlay into transformers (quantized modules)."""
    from embedq.backends.transformers import load as _load
    return _load(path, **from_pretrained_kwargs)


def evaluate(path, **kwargs):
    """KLD of the overlaid model against the float one (see :func:`embedq.evaluate.evaluate`)."""
    from embedq.evaluate import evaluate as _evaluate
    return _evaluate(path, **kwargs)


def plan(path, gpu_mem="32GiB", **kwargs):
    """KV-cache capacity before/after the overlay (see :func:`embedq.plan.plan`)."""
    from embedq.plan import plan as _plan
    return _plan(path, gpu_mem, **kwargs)


# ``AutoModel*.from_pretrained`` understands ``quant_method: embedq`` once transformers'
# quantizer registry is imported (registered then, so ``import embedq`` stays cheap).
from embedq.backends.transformers import install_import_hook as _install_hook  # noqa: E402

_install_hook()

__all__ = ["quantize", "load", "evaluate", "plan", "inspect", "remove", "verify", "load_overlay", "push", "apply", "Report",
           "ModuleReport", "EmbedqError", "__version__"]
