"""transformers + peft as the LoRA oracle: a tiny random checkpoint of one architecture
(arch_oracle.hf_checkpoint), three random PEFT adapters of different ranks and target sets (one
rsLoRA) written by peft's own save_pretrained, and transformers' answers for a batch of prompts,
each under its adapter (or none): last-position logits and greedy tokens.

Everything is offline (float32 torch on CPU, eager attention).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np

import arch_oracle

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# name -> peft.LoraConfig keywords; ids are 1, 2, 3 in this order
ADAPTERS = {
    "a1": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    "a2": dict(r=8, lora_alpha=16, target_modules=ALL, use_rslora=True),
    "a3": dict(r=16, lora_alpha=16, target_modules=["k_proj", "o_proj", "gate_proj",
                                                    "down_proj"]),
}
MAX_LORA_RANK = 16
# prompt i (arch_oracle.PROMPT_LENGTHS) runs under ASSIGN[i]; None: the base model
ASSIGN = ("a1", None, "a2", "a3", "a1")


def lora_id(name: str) -> int:
    return list(ADAPTERS).index(name) + 1


def make_adapter(base_dir: Path, out_dir: Path, seed: int, **lora_kw) -> Path:
    """A random PEFT adapter on the checkpoint at base_dir, saved by peft to out_dir."""
    import peft
    import torch
    import transformers

    base = transformers.AutoModelForCausalLM.from_pretrained(
        base_dir, dtype=torch.float32, attn_implementation="eager")
    model = peft.get_peft_model(base, peft.LoraConfig(init_lora_weights=False, **lora_kw))
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(0.1 * torch.randn_like(p))
    model.save_pretrained(out_dir)
    return out_dir


@dataclasses.dataclass
class LoRACase:
    base_dir: Path
    adapter_dirs: dict      # name -> adapter directory
    batch: list             # prompts, prompt i under ASSIGN[i]
    want_logits: np.ndarray  # [len(batch), V] transformers + peft, last position
    want_greedy: list       # greedy tokens per prompt
    peft_model: object      # every adapter loaded (set_adapter / disable_adapter)
    _loaded: object = None

    def load(self):
        from jaxserve.model.loaders.loader import load_model
        if self._loaded is None:
            self._loaded = load_model(str(self.base_dir), progress=False)
        return self._loaded

    def lora_request(self, name: str | None):
        from jaxserve import LoRARequest
        return None if name is None else LoRARequest(name, lora_id(name),
                                                     str(self.adapter_dirs[name]))

    def requests(self) -> list:
        return [self.lora_request(name) for name in ASSIGN]

    def hf_greedy(self, name: str | None, prompt, num_tokens: int) -> list[int]:
        """transformers' greedy tokens under adapter `name` (None: the base model)."""
        if name is None:
            with self.peft_model.disable_adapter():
                return arch_oracle.hf_greedy(self.peft_model, prompt, num_tokens)
        self.peft_model.set_adapter(name)
        return arch_oracle.hf_greedy(self.peft_model, prompt, num_tokens)


def make_lora_case(directory: Path, model_type: str, *, seed: int = 0, **config_kw) -> LoRACase:
    import peft
    import torch
    import transformers

    base_dir = directory / "base"
    arch_oracle.hf_checkpoint(base_dir, model_type, seed=seed, **config_kw)
    dirs = {name: make_adapter(base_dir, directory / name, seed + i + 1, **kw)
            for i, (name, kw) in enumerate(ADAPTERS.items())}
    base = transformers.AutoModelForCausalLM.from_pretrained(
        base_dir, dtype=torch.float32, attn_implementation="eager")
    names = list(dirs)
    model = peft.PeftModel.from_pretrained(base, dirs[names[0]], adapter_name=names[0])
    for name in names[1:]:
        model.load_adapter(dirs[name], adapter_name=name)
    model.eval()
    batch = arch_oracle.prompts(seed)
    case = LoRACase(base_dir, dirs, batch, None, None, model)
    logits = []
    for name, prompt in zip(ASSIGN, batch):
        if name is None:
            with model.disable_adapter():
                logits.append(arch_oracle.hf_last_logits(model, [prompt])[0])
        else:
            model.set_adapter(name)
            logits.append(arch_oracle.hf_last_logits(model, [prompt])[0])
    case.want_logits = np.stack(logits)
    case.want_greedy = [case.hf_greedy(name, p, arch_oracle.NUM_GREEDY)
                        for name, p in zip(ASSIGN, batch)]
    return case


def device_stacks(loaded, case: LoRACase, per_layer: bool):
    """The three adapters read by jaxserve and written into device slots 1..3: the LoRAStacks
    a step reads."""
    from jaxserve.lora.device import DeviceLoRA
    from jaxserve.lora.peft import read_adapter

    device = DeviceLoRA(loaded.config, len(ADAPTERS), MAX_LORA_RANK, per_layer=per_layer)
    for name, path in case.adapter_dirs.items():
        device.write(lora_id(name), read_adapter(path, loaded.config, MAX_LORA_RANK))
    return device.arrays


def slots() -> np.ndarray:
    """Each prompt's device slot (0: the base model)."""
    return np.array([0 if name is None else lora_id(name) for name in ASSIGN], np.int32)


def engine_greedy_tp(case: LoRACase, tensor_parallel_size: int,
                     **settings) -> tuple[list[list[int]], dict]:
    """The engine's greedy tokens for case.batch under ASSIGN's adapters on
    tensor_parallel_size fake CPU devices (XLA_FLAGS must be set before jax starts, hence a
    fresh interpreter), and how the adapter stacks were placed: target -> {"a" | "b":
    [PartitionSpec entries, one device's shard shape, the full shape]} of layer 0's arrays."""
    import json
    import os
    import subprocess
    import sys

    spec = {"base": str(case.base_dir), "batch": case.batch, "settings": settings,
            "tp": tensor_parallel_size,
            "loras": [None if n is None else [n, lora_id(n), str(case.adapter_dirs[n])]
                      for n in ASSIGN]}
    script = (f"import json, sys; sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
              "import conftest\n"
              "from jaxserve import LoRARequest, SamplingParams\n"
              "from jaxserve.entrypoints.llm import LLM\n"
              "spec = json.loads(sys.stdin.read())\n"
              "llm = LLM(spec['base'], progress=False, tensor_parallel_size=spec['tp'],\n"
              "          **spec['settings'])\n"
              "params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)\n"
              "loras = [None if x is None else LoRARequest(*x) for x in spec['loras']]\n"
              "outs = llm.generate(spec['batch'], params, use_tqdm=False, lora_request=loras)\n"
              "def placed(x):\n"
              "    return [list(x.sharding.spec), list(x.sharding.shard_shape(x.shape)),\n"
              "            list(x.shape)]\n"
              "first = lambda x: x[0] if isinstance(x, tuple) else x\n"
              "stacks = llm.engine.runner.adapters.arrays.weights\n"
              "placement = {name: {'a': placed(first(a)), 'b': placed(first(b))}\n"
              "             for name, (a, b) in stacks.items()}\n"
              "print(json.dumps([[o.token_ids for o in outs], placement]))\n")
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=f"--xla_force_host_platform_device_count={tensor_parallel_size}")
    proc = subprocess.run([sys.executable, "-c", script], input=json.dumps(spec),
                          capture_output=True, text=True, env=env, timeout=600,
                          cwd=Path(__file__).parent.parent)
    assert proc.returncode == 0, f"tensor-parallel LoRA engine failed:\n{proc.stderr[-4000:]}"
    tokens, placement = json.loads(proc.stdout.strip().splitlines()[-1])
    return tokens, placement
