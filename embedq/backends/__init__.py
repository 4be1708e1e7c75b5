"""Layer 4, serving back ends (transformers, vLLM, ONNX Runtime). Each reads overlays
through ``embedq.format`` (reader, codec, fast path); none re-parses the format."""
