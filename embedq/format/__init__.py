"""The overlay format's in-memory side: reading packed tables fast (see :mod:`.fastpath`)."""
