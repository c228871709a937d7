"""The real default model (SmolLM2-135M-Instruct) generates what transformers generates.

Greedy 32-token continuations of varied prompts must equal transformers' greedy output on the
same GGUF; where a token differs, transformers' two top logits at that point must be within
1e-3 (a near-tie), and that may happen for at most one prompt.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

pytestmark = pytest.mark.slow
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from model_fixtures import hf_default_model, real_default_model  # noqa: E402

from jaxserve import SamplingParams  # noqa: E402

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colors are",
    "Water boils at a temperature of",
    "Translate to French: Good morning, how are you?",
    "1, 2, 3, 4, 5,",
    "The best way to learn a new language is",
    "Photosynthesis is the process by which",
]
NUM_TOKENS = 32


@pytest.fixture(scope="module")
def hf():
    return hf_default_model()


@pytest.fixture(scope="module")
def ours():
    from jaxserve.entrypoints.llm import LLM
    llm = LLM(loaded=real_default_model(), progress=False, max_num_seqs=16,
              max_num_batched_tokens=64, token_buckets=(64,), layer_loop="scan")
    params = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True)
    prompts = [llm.tokenizer.encode(p) for p in PROMPTS]
    return prompts, [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def hf_greedy(model, prompt: list[int], num_tokens: int):
    """Plain greedy decoding with transformers (EOS not special: ignore_eos on both sides)."""
    ids, gaps, past, feed = list(prompt), [], None, list(prompt)
    with torch.no_grad():
        for _ in range(num_tokens):
            out = model(torch.tensor([feed]), past_key_values=past, use_cache=True)
            past, logits = out.past_key_values, out.logits[0, -1].numpy()
            top2 = np.sort(logits)[-2:]
            gaps.append(float(top2[1] - top2[0]))
            ids.append(int(np.argmax(logits)))
            feed = ids[-1:]
    return ids[len(prompt):], gaps


def test_greedy_continuations_equal_transformers(hf, ours):
    prompts, outputs = ours
    differing = []
    for prompt, got in zip(prompts, outputs):
        want, gaps = hf_greedy(hf, prompt, NUM_TOKENS)
        if got == want:
            continue
        i = next(j for j, (a, b) in enumerate(zip(got, want)) if a != b)
        assert gaps[i] <= 1e-3, (f"prompt {prompt}: token {i} differs ({got[i]} vs {want[i]}) "
                                 f"and the top-2 logit gap is {gaps[i]:.2e}, not a near-tie")
        differing.append(i)
    assert len(differing) <= 1, f"{len(differing)} prompts differ (near-ties at {differing})"


def test_cli_generate_offline_says_paris():
    # --layer-loop scan only to compile faster in CI; the tokens do not depend on it.
    out = subprocess.run(
        [sys.executable, "-m", "jaxserve.entrypoints.cli", "generate", "--offline", "--quiet",
         "--layer-loop", "scan", "--max-tokens", "8", "--temperature", "0",
         "The capital of France is"],
        capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith(" Paris"), repr(out.stdout)
