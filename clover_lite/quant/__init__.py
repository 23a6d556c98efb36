"""Offline INT4 quantization (GPTQ format) and the 16-bit/NF4 baselines."""
