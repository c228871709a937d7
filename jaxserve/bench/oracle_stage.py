"""Device-check stage: greedy agreement of tiny transformers models (the oracle) with jaxserve
on the device.

A child process on the CPU (CUDA_VISIBLE_DEVICES empty, JAX_PLATFORMS=cpu) builds each model
from transformers' own config class with random float32 weights (norms about 1, the rest wide
enough that logits are far from ties), runs torch's greedy generate on a few token-id prompts
and saves config.json, the weights (safetensors) and its tokens. The stage then loads the same
weights through jaxserve's HF reader and generates greedily through the engine on the device,
in float32 (the oracle's precision: agreement should be all but complete) and in bfloat16 (the
serving dtype, with the attention path the device selection picks: reported, judged LOW below
half). Agreement is device_check.agreement: tokens matched before each prompt's first
divergence. Without the device: the first model only, float32 only, fewer tokens.
Runs in a stage process of stage_runner.py; the files live in a temporary folder.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

# (name, transformers model_type, config keywords): head_dim 64 and 128, as the kernels take
CASES = (
    ("llama D64 Hkv2", "llama", dict(num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                                     hidden_size=256)),
    ("qwen3 D128 Hkv1", "qwen3", dict(num_attention_heads=2, num_key_value_heads=1,
                                      head_dim=128, hidden_size=256)),
    ("qwen2 D64 Hkv2 (q/k/v bias)", "qwen2", dict(num_attention_heads=4,
                                                 num_key_value_heads=2, hidden_size=256)),
)
COMMON = dict(vocab_size=512, intermediate_size=512, num_hidden_layers=2,
              max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=0,
              tie_word_embeddings=False)
PROMPT_LENGTHS = (7, 19, 33, 50)
FLOAT32_OK = 0.9   # float32 on both sides: only a near-tie may flip a token
BF16_LOW = 0.5


def prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    import numpy as np

    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab, n).tolist() for n in PROMPT_LENGTHS]


def agreement(rec, cfg: dict) -> None:
    import jax

    device = jax.default_backend() == cfg["platform"]
    cases = CASES if device else CASES[:1]
    num_tokens = cfg.get("tokens", 16) if device else 6
    dtypes = ("float32", "bfloat16") if device else ("float32",)
    with tempfile.TemporaryDirectory(prefix="oracle-") as tmp:
        spec = {"cases": [[name, kind, kw] for name, kind, kw in cases],
                "prompts": prompts(COMMON["vocab_size"]), "num_tokens": num_tokens}
        (Path(tmp) / "spec.json").write_text(json.dumps(spec))
        env = dict(os.environ, CUDA_VISIBLE_DEVICES="", JAX_PLATFORMS="cpu")
        done = subprocess.run([sys.executable, "-m", "jaxserve.bench.oracle_stage", "oracle",
                               tmp], capture_output=True, text=True, env=env,
                              timeout=max(rec.left() * 0.5, 1))
        if done.returncode:
            raise RuntimeError(f"the transformers oracle failed: {done.stderr.strip()[-1500:]}")
        for name, _, _ in cases:
            folder = Path(tmp) / _folder(name)
            want = json.loads((folder / "tokens.json").read_text())
            loaded = _load(folder)
            for dtype in dtypes:
                if rec.left() <= 0:
                    rec.row(f"agreement {name} {dtype}", "not run: the stage's budget ran out",
                            "CUT")
                    continue
                got, impl = _greedy(loaded, spec["prompts"], num_tokens, dtype)
                rate = agreement_rate(got, want)
                limit = FLOAT32_OK if dtype == "float32" else BF16_LOW
                verdict = "OK" if rate >= limit else ("FAIL" if dtype == "float32" else "LOW")
                rec.row(f"agreement {name} {dtype}", f"{100 * rate:.1f}% of oracle tokens "
                        f"({len(want)} prompts x {num_tokens}, attention {impl})", verdict,
                        rate=rate, got=got, want=want)


def agreement_rate(got, want) -> float:
    from jaxserve.bench.device_check import agreement as rate

    return rate(got, want)


def _folder(name: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in name)


def _load(folder: Path):
    from safetensors.numpy import load_file

    from jaxserve.bench.model_stages import IdTokenizer
    from jaxserve.model.config import ModelConfig
    from jaxserve.model.loaders.safetensors_loader import params_from_hf
    from jaxserve.model.loaders.weights import LoadedModel

    config = ModelConfig.from_hf_dict(json.loads((folder / "config.json").read_text()),
                                      name=folder.name)
    params = params_from_hf(config, load_file(str(folder / "model.safetensors")))
    return LoadedModel(config=config, params=params, source=str(folder),
                       tokenizer=IdTokenizer(config.vocab_size, config.eos_token_ids))


def _greedy(loaded, batch, num_tokens: int, dtype: str):
    from jaxserve.core.request import SamplingParams
    from jaxserve.entrypoints.llm import LLM
    from jaxserve.model.device.select import select

    params = SamplingParams(max_tokens=num_tokens, temperature=0.0, ignore_eos=True)
    with LLM("oracle-check", loaded=loaded, progress=False, dtype=dtype,
             max_num_seqs=len(batch), max_num_batched_tokens=64,
             token_buckets=(64,), max_model_len=128, page_size=16,
             num_pages=len(batch) * 8 + 2, enable_prefix_caching=False) as llm:
        outputs = llm.generate(batch, params, use_tqdm=False)
    # the engine's attention_impl "auto" resolves as select does for this dtype
    return [list(o.outputs[0].token_ids) for o in outputs], select(dtype=dtype).attention_impl


def _oracle_main(folder: str) -> None:
    """In the child: each case's transformers model, its greedy tokens and its files."""
    import numpy as np
    import torch
    import transformers
    from safetensors.numpy import save_file

    spec = json.loads((Path(folder) / "spec.json").read_text())
    torch.manual_seed(0)
    for name, model_type, kw in spec["cases"]:
        config = transformers.AutoConfig.for_model(model_type, **{**COMMON, **kw})
        config._attn_implementation = "eager"
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        with torch.no_grad():
            for param_name, p in model.named_parameters():
                if "norm" in param_name:
                    p.add_(0.1 * torch.randn_like(p))
                else:
                    p.copy_(0.15 * torch.randn_like(p))
        model.eval()
        model.generation_config.eos_token_id = None  # the full length, as ignore_eos
        tokens = []
        with torch.no_grad():
            for prompt in spec["prompts"]:
                out = model.generate(torch.tensor([prompt]), max_new_tokens=spec["num_tokens"],
                                     do_sample=False, pad_token_id=0)
                tokens.append(out[0, len(prompt):].tolist())
        target = Path(folder) / _folder(name)
        target.mkdir()
        (target / "config.json").write_text(json.dumps(config.to_dict(), default=str))
        save_file({k: np.ascontiguousarray(v.detach().numpy())
                   for k, v in model.state_dict().items()}, str(target / "model.safetensors"))
        (target / "tokens.json").write_text(json.dumps(tokens))


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "oracle":
    _oracle_main(sys.argv[2])
