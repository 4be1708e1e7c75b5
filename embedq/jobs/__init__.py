"""Layer 3, the jobs on a checkpoint folder: quantize (in place / derived), apply, remove,
verify, inspect, target discovery, calibration. Imports ``embedq.format`` and
``embedq.quant``."""
