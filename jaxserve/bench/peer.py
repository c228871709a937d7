"""The peer in the benchmark suite: Hugging Face transformers on the same model and prompts.

Runs the default model through transformers' static batched `generate` (one left-padded batch)
and its continuous-batching `generate_batch`, greedy, EOS ignored, so each request produces
exactly `max_new_tokens`. Timing excludes loading and a small warm-up call, as jaxserve's
excludes compiling. Optional: `unavailable()` says why it cannot run (transformers or torch
missing: `pip install 'jaxserve[bench]'`). It never imports jax.
"""

from __future__ import annotations

import os
import time


def unavailable() -> str | None:
    """None when transformers and torch import, else the reason."""
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as exc:
        return f"{exc.name} is not installed (pip install 'jaxserve[bench]')"
    return None


def versions() -> dict[str, str]:
    import torch
    import transformers
    return {"transformers": transformers.__version__, "torch": torch.__version__,
            "torch_threads": str(torch.get_num_threads()),
            "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "")}


def load_gguf_model(gguf_path: str):
    """The GGUF file dequantized to float32 by transformers' own loader."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(gguf_path), gguf_file=os.path.basename(gguf_path),
        dtype=torch.float32)
    return model.eval()


def _greedy_config(max_new_tokens: int, pad_token_id: int):
    from transformers import GenerationConfig

    # eos_token_id=None: never stop early, like jaxserve's ignore_eos.
    return GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None,
                            pad_token_id=pad_token_id)


def static_generate(model, prompts: list[list[int]], max_new_tokens: int,
                    pad_token_id: int = 0) -> dict:
    """One left-padded batch of every prompt through model.generate."""
    import torch

    config = _greedy_config(max_new_tokens, pad_token_id)
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_token_id] * (width - len(p)) + list(p) for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.inference_mode():
        model.generate(input_ids=ids[:1], attention_mask=mask[:1],
                       generation_config=_greedy_config(2, pad_token_id))  # warm-up
        start = time.perf_counter()
        out = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
        duration = time.perf_counter() - start
    num_out = int((out.shape[1] - width) * out.shape[0])
    return {"duration_s": duration, "total_output_tokens": num_out,
            "output_throughput": num_out / duration, "batch_size": len(prompts)}


def continuous_generate(model, prompts: list[list[int]], max_new_tokens: int,
                        pad_token_id: int = 0, page_size: int = 16, max_batch_tokens: int = 256,
                        max_requests_per_batch: int = 16) -> dict:
    """Every prompt through model.generate_batch (transformers' continuous batching), with
    jaxserve's page size, step token budget and batch size. The KV cache is sized to the
    requests: left to itself on a CPU, transformers sizes it from free host RAM (tens of GB)."""
    import torch
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    pages_per_request = -(-(max(len(p) for p in prompts) + max_new_tokens) // page_size)
    cb_config = ContinuousBatchingConfig(
        page_size=page_size, num_blocks=pages_per_request * max_requests_per_batch + 1,
        max_batch_tokens=max_batch_tokens, max_requests_per_batch=max_requests_per_batch)
    config = _greedy_config(max_new_tokens, pad_token_id)
    with torch.inference_mode():
        model.generate_batch(inputs=[list(p) for p in prompts[:2]],  # warm-up
                             generation_config=_greedy_config(2, pad_token_id),
                             continuous_batching_config=cb_config)
        start = time.perf_counter()
        outputs = model.generate_batch(inputs=[list(p) for p in prompts],
                                       generation_config=config,
                                       continuous_batching_config=cb_config)
        duration = time.perf_counter() - start
    num_out = sum(len(o.generated_tokens) for o in outputs.values())
    failed = sum(1 for o in outputs.values() if o.error is not None)
    return {"duration_s": duration, "total_output_tokens": num_out,
            "output_throughput": num_out / duration, "failed": failed + len(prompts)
            - len(outputs)}
