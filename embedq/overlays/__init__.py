"""The on-disk contract: overlay writer, config schema, apply/remove, derived checkpoints."""

from embedq.overlays.reader import Overlay, load_overlay, read_overlay_config
from embedq.overlays.state import remove_overlay
from embedq.overlays.verify import verify_overlay
from embedq.overlays.write import quantize_checkpoint

__all__ = ["Overlay", "load_overlay", "read_overlay_config", "remove_overlay", "verify_overlay",
           "quantize_checkpoint"]
