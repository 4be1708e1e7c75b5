"""Layer 1, the on-disk contract: constants, the validated config, scheme, codec (the one
decoder), reader, streaming safetensors writer, checkpoint access. Imports only
``embedq.errors`` and third-party libraries."""
