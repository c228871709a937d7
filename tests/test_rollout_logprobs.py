"""Logprobs that match training: the sampled tokens' logprobs (logprobs=0) of a mixed batch run
with chunked prefill and preemption agree with a teacher-forced pass (prompt + outputs prefilled
in one step, prompt_logprobs=0) within docs/rollouts.md's float32 CPU tolerance."""

from __future__ import annotations

import numpy as np

from conftest import make_llm
from jaxserve import SamplingParams

FLOAT32_CPU_TOLERANCE = 1e-5  # docs/rollouts.md


def test_sampled_logprobs_match_a_teacher_forced_pass_over_mixed_batches_with_preemption():
    rng = np.random.default_rng(0)
    lengths = [3, 45, 9, 38, 17, 60, 5, 29]  # decodes beside chunked prefills (budget 32)
    prompts = [rng.integers(3, 128, n).tolist() for n in lengths]
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=24, ignore_eos=True,
                             logprobs=0) for i in range(len(prompts))]
    # 12 pages of 16 tokens for 8 requests of up to 84 tokens: requests are preempted
    rollout = make_llm(num_pages=12, max_num_batched_tokens=32)
    try:
        outs = rollout.generate(prompts, params, use_tqdm=False)
        assert rollout.engine.scheduler.num_preemptions > 0, "no request was preempted"
    finally:
        rollout.close()
    teacher = make_llm(max_num_batched_tokens=128, token_buckets=(16, 32, 128))
    try:
        full = [p + o.token_ids for p, o in zip(prompts, outs)]
        forced = teacher.generate(full, SamplingParams(max_tokens=1, prompt_logprobs=0),
                                  use_tqdm=False)
    finally:
        teacher.close()
    worst = 0.0
    for prompt, out, tf in zip(prompts, outs, forced):
        assert len(out.logprobs) == len(out.token_ids) == 24
        for i, (token, logprob) in enumerate(zip(out.token_ids, out.logprobs)):
            want = tf.prompt_logprobs[len(prompt) + i][token]
            worst = max(worst, abs(logprob - want))
    print(f"max |sampled - teacher-forced| = {worst:.2e}")
    assert worst <= FLOAT32_CPU_TOLERANCE, f"max |sampled - teacher-forced| = {worst:.2e}"
