"""Multi-LoRA serving: adapters on one base model, batched in the compiled step.

request.py: LoRARequest (as vLLM's), how a request names its adapter. peft.py: a PEFT adapter
directory read and checked against the base model, on the host (no jax). registry.py: the
host's adapters by id, bounded by max_cpu_loras (no jax). device.py: the resident adapters'
stacked A/B weights on the device, one slot each (the runner's). The in-step math is
model/decoder/lora.py's; which adapter holds which device slot is the scheduler's
(core/lora_slots.py).
This package imports nothing on import: each module is imported by name.
"""
