"""Quantized weights and KV: host formats, on-device matmuls, the per-backend choice, the load
cache."""
