"""``embedq demo``: an embedded default job that needs no download."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from embedq.jobs.report import Report


def build_demo_model(path: Path, seed: int = 0) -> Path:
    """A small tied Qwen2-style causal LM (32k vocab) saved as a real HF checkpoint."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM
    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=32768, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    model = Qwen2ForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(path)
    return path


# Written into the demo model's folder once it is built: the one sign that the folder is
# demo's own, so a rerun may re-quantize it with force (never a user's checkpoint and overlay).
DEMO_MARKER = ".embedq-demo"


def run_demo(workdir: Path | None = None, bits: int | None = None) -> Report:
    from embedq.errors import EmbedqError
    from embedq.format import staging
    from embedq.jobs.quantize import quantize_checkpoint
    from embedq.jobs.recipe import QuantizeRecipe
    from embedq.jobs.verify import verify_overlay
    recipe = QuantizeRecipe.from_options(bits, force=True)  # a bad scheme fails before the 32k model is built
    base = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="embedq-demo-"))
    model = base / "demo-model"
    if not (model / DEMO_MARKER).is_file():
        if model.is_symlink() or model.exists() and (not model.is_dir() or any(model.iterdir())):
            raise EmbedqError(f"{model}: already exists and was not made by `embedq demo` (no {DEMO_MARKER} "
                              "marker: a folder of yours, or of an older embedq); refusing to quantize it "
                              "(pick another --dir or remove it)")
        # built in a staging folder, marked, then renamed: a Ctrl-C or kill mid-build leaves
        # no half-built demo-model (the next run clears the staging folder), only a whole one
        try:
            base.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise EmbedqError(f"{base}: cannot create the --dir folder ({e.strerror or e})") from None
        staging.clean_leftovers(base)
        with staging.staging_dir(base, "demo", output=model) as tmp:
            build_demo_model(tmp / "m")
            (tmp / "m" / DEMO_MARKER).write_text("made by `embedq demo`; a rerun may re-quantize this folder\n")
            staging.fsync_dir(tmp / "m")
            if model.is_dir():
                model.rmdir()  # empty (checked above)
            os.rename(tmp / "m", model)
            staging.fsync_dir(base)
    report = quantize_checkpoint(model, recipe)
    verify_overlay(model)
    return report
