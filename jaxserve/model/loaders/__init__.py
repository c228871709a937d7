"""Loading weights and configs: GGUF, safetensors, Orbax checkpoints, the hub cache, the embedded
default model."""
