"""Layer 5, quality: KLD evaluation against the float model and scheme selection."""
