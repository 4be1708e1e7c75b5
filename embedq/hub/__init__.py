"""Layer 5, publishing: the Hub model card and ``push``."""
