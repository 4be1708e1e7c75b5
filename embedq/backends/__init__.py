"""Back ends that read embedq overlays: vLLM, ONNX Runtime, transformers."""
