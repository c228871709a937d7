"""The decoder every family runs, its layers (attention, MoE, LoRA, RoPE), sharding rules and step
inputs."""
