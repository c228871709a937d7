"""Benchmarks: offline (through LLM/Engine) and serving (a gRPC load generator)."""
