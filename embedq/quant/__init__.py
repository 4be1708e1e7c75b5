"""Layer 2, the math: round-to-nearest, MSE and head-aware GPTQ quantizers, the fused
kernels and the streaming pipeline over rows. Imports ``embedq.format`` only."""
