"""Run onnxruntime-genai's model builder (``python -m onnxruntime_genai.models.builder``)
with one compatibility shim; same arguments as the builder.

onnxruntime-genai 0.18's builder imports transformers 5 (it needs >= 5.x classes) but
reads Gemma 3's RoPE settings the transformers 4 way: ``config.rope_parameters`` flat
and ``config.rope_local_base_freq``. transformers 5 nests them per layer type
(``{"full_attention": {...}, "sliding_attention": {...}}``), and the builder stops with
``KeyError: 'rope_type'``. The shim gives the builder's own config object the flat view
(global layers' RoPE; local layers' theta as rope_local_base_freq); the weights are
loaded by the builder separately and are not touched.

    PYTHONPATH=$(bash scripts/setup_genai_onnx.sh) python scripts/genai_build.py -i MODEL -o OUT -p fp32 -e cpu
"""

from __future__ import annotations

import runpy


def _flatten_rope(config) -> None:
    rp = getattr(config, "rope_parameters", None)
    if isinstance(rp, dict) and isinstance(rp.get("full_attention"), dict):
        local = rp.get("sliding_attention") or rp["full_attention"]
        config.rope_local_base_freq = local.get("rope_theta", 10000.0)
        config.rope_parameters = dict(rp["full_attention"])
        config.rope_theta = config.rope_parameters.get("rope_theta", 10000.0)


def main() -> None:
    import importlib
    import onnxruntime_genai.models  # noqa: F401  (puts its folder on sys.path)
    # builder.py imports its builders as the top-level package ``builders``
    base = importlib.import_module("builders.base")
    orig = base.Model.__init__

    def init(self, config, *args, **kwargs):
        _flatten_rope(config)
        orig(self, config, *args, **kwargs)
    base.Model.__init__ = init
    runpy.run_module("onnxruntime_genai.models.builder", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
