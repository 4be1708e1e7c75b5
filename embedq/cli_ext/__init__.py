"""CLI extensions: each module here defines ``register(app: typer.Typer)``.

Kept separate so that each back end owns its commands and imports its heavy
dependencies (onnx, huggingface_hub, ...) only inside the command bodies.
"""

TOPICS = ("onnx", "quality", "publish", "auto")
