"""Layer 5, capacity: the KV-cache plan (``embedq plan``)."""
