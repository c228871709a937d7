"""Sleep and wake with an fp8 KV cache: the pool comes back in the KV dtype, not the weights'.

An RL loop on an accelerator runs exactly this pair (fp8 pages to fit more rollouts, sleep
between rollouts and training). The engine is its own (fp8 pages), with the shared small shapes.
"""

from __future__ import annotations

import jax.numpy as jnp

from conftest import make_llm
from jaxserve import SamplingParams

PROMPTS = [[5, 9, 13, 17, 21], list(range(30, 70))]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def test_fp8_kv_sleep_wake_keeps_the_kv_dtype_and_the_tokens():
    llm = make_llm(seed=0, kv_cache_dtype="fp8")
    try:
        before = [o.token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
        dtypes = [a.dtype for a in llm.engine.runner.kv]
        assert all(d == jnp.float8_e4m3fn for d in dtypes), f"pages are {dtypes}, not fp8"
        llm.sleep(level=1)
        llm.wake_up()
        after_dtypes = [a.dtype for a in llm.engine.runner.kv]
        assert after_dtypes == dtypes, f"wake_up rebuilt the pool as {after_dtypes}"
        after = [o.token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
        assert after == before, "tokens after an fp8 sleep / wake cycle differ"
    finally:
        llm.close()
