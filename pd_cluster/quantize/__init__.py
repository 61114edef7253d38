"""Offline quantization of checkpoints (``pd-cluster quantize``): GPTQ over calibration text, or
rounding to nearest, written as an FP8 checkpoint the nodes load as published."""
