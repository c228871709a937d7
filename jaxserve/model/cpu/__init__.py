"""jaxserve's CPU kernels (C++ through XLA's FFI): attention and the int8 matmul, built on first
use."""
