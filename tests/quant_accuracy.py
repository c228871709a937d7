"""Teacher-forced accuracy of quantized weights against float32 on the default model.

    python tests/quant_accuracy.py       # prints every form's figures (docs/quantization.md's table)
    python tests/quant_accuracy.py --kv  # fp8 KV pages' figures, scales 1.0 and calibrated

`Forward` runs one Llama (float or quantized params; scanned layers: a quarter of the unrolled
compile time) through two compiled shapes: a 256-row prefill over up to 32 requests (the KL text
goes through it in chunks) and a 32-request decode step. `teacher_forced` prefills 32
prompts in both models and then feeds both the float32 model's greedy tokens for 64 positions,
so every position of the quantized model is predicted from the float32 continuation so far (one
early difference does not cascade); it returns the fraction of positions whose argmax agrees.
`mean_kl` is the mean KL(float32 || quantized) of the next-token distributions over a
1,000-token text (the docstrings of argparse and unittest, fixed for a Python version).
tests/test_quant_default.py asserts on these; this module only measures.
"""

from __future__ import annotations

import argparse
import sys
import unittest
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from jaxserve.model.decoder.attention import ReferenceAttention  # noqa: E402
from jaxserve.model.decoder.decoder import Llama, init_kv_cache  # noqa: E402
from jaxserve.model.decoder.step_inputs import AttentionMetadata, ModelInputs  # noqa: E402

S, T_PREFILL, NEW_TOKENS = 32, 256, 64
# Request i of a step owns pages 1 + i * pages_per_seq onwards: SEQ_PAGES each when S requests
# share a step (a prompt and its NEW_TOKENS fit in 128 tokens), TEXT_PAGES for the KL text's
# one request. Every page a step names is in the pool (a page past it would drop the writes
# and clamp the reads: a request without its own KV).
PAGE_SIZE, SEQ_PAGES, TEXT_PAGES = 16, 8, 64
NUM_PAGES = 1 + max(S * SEQ_PAGES, TEXT_PAGES)
PROMPTS = [
    "The capital of France is", "def fibonacci(n):", "Once upon a time", "List three colors:",
    "The theory of relativity says", "How do I bake bread?", "Write a haiku about the sea.",
    "The best way to learn Python is", "Explain photosynthesis to a child.",
    "import numpy as np\n", "The quick brown fox", "Translate to French: good morning",
    "What is the speed of light?", "Here is a recipe for pancakes:", "SELECT * FROM users WHERE",
    "My favourite book is", "The weather today is", "In 1492, Columbus", "Dear hiring manager,",
    "The main causes of World War I were", "A list of prime numbers: 2, 3, 5,",
    "Why is the sky blue?", "class Stack:\n", "The mitochondria is", "Tips for a good night's "
    "sleep:", "The stock market", "Summarize the plot of Hamlet.", "To be or not to be",
    "What are the benefits of exercise?", "The largest planet in our solar system",
    "function add(a, b) {", "Describe a sunset over the mountains.",
]

# Teacher-forced prompts for the fp8 KV scales that are neither PROMPTS nor the calibration text
# (runner/kv_calibration.py's CALIBRATION_TEXT): prose, code, figures, a shell session, a letter.
# 252 tokens in all: one T_PREFILL prefill.
HELD_OUT = [
    "The lighthouse keeper wrote in his log that the fog had not lifted for nine days, and "
    "the supply boat was late again.",
    "for (int i = 0; i < n; ++i) {\n    if (buf[i] == '\\n') lines++;\n    total += buf[i];\n}",
    "Population in 2020: 8,336,817. Median age: 36.9 years. Households: 3,191,691. Growth "
    "since 2010:",
    "Photosynthesis is not the only way organisms capture energy; deep-sea bacteria near "
    "hydrothermal vents rely on",
    "git commit -m \"fix off-by-one in parser\" && git push origin main\nerror: failed to push "
    "some refs",
    "Dear committee, I am writing to appeal the decision regarding my scholarship, which was "
    "withdrawn after",
    "x = [3.14, 2.718, 1.414, 1.732]\nprint(sum(x) / len(x))  # prints",
    "In chess, the Sicilian Defence begins with 1. e4 c5, and White's most common reply is",
]


def kl_text(tokenizer, num_tokens: int = 1000) -> list[int]:
    ids = tokenizer.encode(argparse.__doc__ + "\n\n" + unittest.__doc__, add_special_tokens=False)
    if len(ids) < num_tokens:
        raise ValueError(f"the KL text has {len(ids)} tokens, fewer than {num_tokens}")
    return ids[:num_tokens]


class Forward:
    """A model (float or quantized params) stepped over its own paged KV cache."""

    def __init__(self, config, params, kv_dtype=jnp.float32, kv_scales=None, form=None):
        """kv_dtype: the KV pages' dtype (fp8: quantized with kv_scales, [2, L] or None);
        form: how quantized matrices are multiplied (model/quant_select.MatmulForm; None: this
        backend's "auto")."""
        graphdef, self.state = nnx.split(Llama(config, params, jnp.float32, "scan",
                                               kv_scales=kv_scales, quant_form=form))
        attention = ReferenceAttention()

        def run(state, kv, inputs, metadata):
            return nnx.merge(graphdef, state)(inputs, metadata, kv, attention)

        self.run = jax.jit(run, donate_argnums=1)
        self.kv = init_kv_cache(config, NUM_PAGES, PAGE_SIZE, kv_dtype)

    def step(self, seqs: list[tuple[list[int], int]], bucket: int, num_logits: int,
             logit_rows=None, pages_per_seq: int | None = None) -> np.ndarray:
        """seqs: (new tokens, tokens already cached) per request i, whose pages are
        1 + i * pages_per_seq (default SEQ_PAGES) onwards. Returns logits [num_logits, V] of
        `logit_rows` (default: each request's last row)."""
        pages_per_seq = pages_per_seq or SEQ_PAGES
        if 1 + len(seqs) * pages_per_seq > NUM_PAGES:
            raise ValueError(f"{len(seqs)} requests of {pages_per_seq} pages: more than the "
                             f"pool's {NUM_PAGES - 1}")
        tokens, positions, slots, cu, lens = [], [], [], [0], []
        for i, (new, cached) in enumerate(seqs):
            if cached + len(new) > pages_per_seq * PAGE_SIZE:
                raise ValueError(f"request {i} reaches {cached + len(new)} tokens: more than "
                                 f"its {pages_per_seq} pages hold")
            pos = np.arange(cached, cached + len(new))
            tokens += new
            positions += pos.tolist()
            slots += ((1 + i * pages_per_seq + pos // PAGE_SIZE) * PAGE_SIZE
                      + pos % PAGE_SIZE).tolist()
            cu.append(cu[-1] + len(new))
            lens.append(cached + len(new))
        rows = np.asarray(cu[1:]) - 1 if logit_rows is None else np.asarray(logit_rows)
        pad = lambda a, n: jnp.asarray(np.pad(np.asarray(a, np.int32), (0, n - len(a))))
        inputs = ModelInputs.empty(bucket, num_logits)
        inputs.token_ids, inputs.positions = pad(tokens, bucket), pad(positions, bucket)
        inputs.slot_mapping, inputs.logits_indices = pad(slots, bucket), pad(rows, num_logits)
        table = 1 + np.arange(S)[:, None] * pages_per_seq + np.arange(pages_per_seq)[None, :]
        table = np.minimum(table, NUM_PAGES - 1)  # rows past len(seqs) are never read
        cu_q = np.concatenate([cu, np.full(S + 1 - len(cu), cu[-1])])
        decode = int(all(len(new) == 1 for new, _ in seqs))
        metadata = AttentionMetadata(jnp.asarray(cu_q, jnp.int32), pad(lens, S),
                                     jnp.asarray(table, jnp.int32), jnp.int32(len(seqs)),
                                     jnp.int32(len(seqs) if decode else 0))
        logits, self.kv = self.run(self.state, self.kv, inputs, metadata)
        return np.asarray(logits)


def teacher_forced_agreement(reference: Forward, candidate: Forward, prompts: list[list[int]],
                             new_tokens: int = NEW_TOKENS) -> float:
    """Fraction of the new_tokens positions of each prompt where candidate's argmax equals the
    reference's, both fed the reference's greedy tokens."""
    seqs = [(p, 0) for p in prompts]
    ref = reference.step(seqs, T_PREFILL, T_PREFILL)[:len(prompts)]
    cand = candidate.step(seqs, T_PREFILL, T_PREFILL)[:len(prompts)]
    lengths = [len(p) for p in prompts]
    agree = 0
    for _ in range(new_tokens):
        greedy = ref.argmax(-1)
        agree += int((cand.argmax(-1) == greedy).sum())
        seqs = [([int(t)], n) for t, n in zip(greedy, lengths)]
        lengths = [n + 1 for n in lengths]
        ref = reference.step(seqs, S, S)[:len(prompts)]
        cand = candidate.step(seqs, S, S)[:len(prompts)]
    return agree / (new_tokens * len(prompts))


def mean_kl(reference: Forward, candidate: Forward, text: list[int]) -> float:
    """Mean over the text's positions of KL(reference || candidate), next-token distributions
    (the text prefilled in chunks of T_PREFILL tokens)."""
    total = 0.0
    for start in range(0, len(text), T_PREFILL):
        chunk = text[start:start + T_PREFILL]
        seqs, rows = [(chunk, start)], list(range(len(chunk)))
        p = jax.nn.log_softmax(reference.step(seqs, T_PREFILL, T_PREFILL, rows,
                                              TEXT_PAGES)[:len(chunk)])
        q = jax.nn.log_softmax(candidate.step(seqs, T_PREFILL, T_PREFILL, rows,
                                              TEXT_PAGES)[:len(chunk)])
        total += float(jnp.sum(jnp.exp(p) * (p - q)))
    return total / len(text)


def measure(loaded, forms: dict, form=None) -> dict:
    """{form: (argmax agreement, mean KL)} against loaded's float32 params; forms: {name:
    params}; form: the MatmulForm the candidates run (None: this backend's "auto")."""
    prompts = [loaded.tokenizer.encode(p, add_special_tokens=False) for p in PROMPTS]
    text = kl_text(loaded.tokenizer)
    reference = Forward(loaded.config, loaded.params)
    results = {}
    for name, params in forms.items():
        candidate = Forward(loaded.config, params, form=form)
        results[name] = (teacher_forced_agreement(reference, candidate, prompts),
                         mean_kl(reference, candidate, text))
    return results


def calibrated_kv_scales(loaded, page_dtype) -> np.ndarray:
    """[2, L] fp8 KV scales as the engine computes them with calculate_kv_scales (the
    calibration pass of runner/kv_calibration.py over loaded's float32 params)."""
    from jaxserve.runner import kv_calibration
    from jaxserve.runner.tensor_parallel import Placement

    placement = Placement(None, loaded.config)
    graphdef, state = placement.model(loaded.params, jnp.float32, "scan")
    tokens = kv_calibration.calibration_tokens(loaded.tokenizer, 2048)
    amax = kv_calibration.calibration_amax(graphdef, state, placement, tokens, PAGE_SIZE,
                                           jnp.float32)
    return kv_calibration.scales_from_amax(amax, page_dtype)


def kv_figures(loaded) -> None:
    """Prints fp8 e4m3 KV's agreement with float32 pages, scales 1.0 and calibrated, on PROMPTS
    and on HELD_OUT (docs/quantization.md, "fp8 KV cache")."""
    sets = {name: [loaded.tokenizer.encode(p, add_special_tokens=False) for p in texts]
            for name, texts in (("PROMPTS", PROMPTS), ("HELD_OUT", HELD_OUT))}
    reference = Forward(loaded.config, loaded.params)
    e4m3 = jnp.float8_e4m3fn
    for label, scales in (("scales 1.0", None),
                          ("calibrated", calibrated_kv_scales(loaded, e4m3))):
        candidate = Forward(loaded.config, loaded.params, kv_dtype=e4m3, kv_scales=scales)
        for name, prompts in sets.items():
            agree = teacher_forced_agreement(reference, candidate, prompts)
            print(f"fp8 e4m3 KV, {label:10} {name:8} ({len(prompts)} prompts x {NEW_TOKENS}) "
                  f"argmax agreement {agree:.4f}", flush=True)


if __name__ == "__main__":
    from jaxserve.model.quant import formats as quant
    from jaxserve.model.loaders.loader import load_model

    base = load_model("default", progress=False)
    if sys.argv[1:] == ["--kv"]:  # the fp8 KV cache's figures instead of the weight forms'
        kv_figures(base)
        sys.exit(0)
    forms = {"int8 (GGUF blocks)": load_model("default", progress=False,
                                              quantization="int8").params,
             "int4 (GGUF blocks)": load_model("default", progress=False,
                                              quantization="int4").params,
             "int8 (from float32)": quant.quantize_params(base.params, "int8"),
             "int8 (GGUF requantized per channel)": load_model(
                 "default", progress=False, quantization="int8", int8_per_channel=True).params,
             "int4 (from float32)": quant.quantize_params(base.params, "int4")}
    for name, (agree, kl) in measure(base, forms).items():
        print(f"{name:22} argmax agreement {agree:.4f}  mean KL {kl:.5f}", flush=True)
