"""Measure the KV memory paging wastes on a mixed-length workload, next to contiguous reservation.

Each request is driven through the real PageManager step by step: the prefill step holds slots for
the prompt, each decode step one more token (the last sampled token is never written to the KV
cache). Waste = slots allocated but unused / slots allocated, summed over every step of every
request, so long-lived states weigh by how long they last. The contiguous baseline reserves
max_model_len slots per request for its whole life (a static, per-request KV buffer). This script
only measures host-side accounting; it does not touch jax or a device.

    python scripts/paging_waste.py [--num-requests 1000] [--page-size 16] [--max-model-len 2048]
"""

from __future__ import annotations

import argparse
import random
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jaxserve.core.page_manager import PageManager  # noqa: E402


@dataclass(frozen=True)
class Waste:
    paged: float  # unused / allocated slots, paged cache
    contiguous: float  # unused / allocated slots, max_model_len reserved per request
    reserved_exact: float  # unused / allocated slots, prompt + output reserved up front (oracle)
    num_steps: int


def mixed_workload(num_requests: int, seed: int = 0, min_prompt: int = 16, max_prompt: int = 512,
                   mean_output: float = 128, max_output: int = 512) -> list[tuple[int, int]]:
    """(prompt_len, output_len) pairs: prompts uniform, outputs exponential and capped."""
    rng = random.Random(seed)
    return [(rng.randint(min_prompt, max_prompt),
             min(max_output, max(1, round(rng.expovariate(1 / mean_output)))))
            for _ in range(num_requests)]


def measure_waste(workload: list[tuple[int, int]], page_size: int, max_model_len: int) -> Waste:
    pm = PageManager(max_model_len // page_size + 2, page_size, enable_prefix_caching=False)
    used = paged = contiguous = exact = steps = 0
    for i, (prompt_len, output_len) in enumerate(workload):
        if prompt_len + output_len > max_model_len:
            raise ValueError(f"request {i} needs {prompt_len + output_len} > {max_model_len} slots")
        rid = f"r{i}"
        if pm.allocate(rid, [0] * prompt_len, prompt_len) is None:
            raise RuntimeError(f"pool too small for request {i}")
        for num_tokens in range(prompt_len, prompt_len + output_len):  # KV held in each step
            if not pm.append_slots(rid, num_tokens):
                raise RuntimeError(f"pool too small for request {i}")
            used += num_tokens
            paged += len(pm.page_table(rid)) * page_size
            contiguous += max_model_len
            exact += prompt_len + output_len - 1
            steps += 1
        pm.free(rid)
    pm.check_invariants()
    return Waste(1 - used / paged, 1 - used / contiguous, 1 - used / exact, steps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num-requests", type=int, default=1000)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    workload = mixed_workload(args.num_requests, args.seed)
    waste = measure_waste(workload, args.page_size, args.max_model_len)
    mean_prompt = sum(p for p, _ in workload) / len(workload)
    mean_output = sum(o for _, o in workload) / len(workload)
    print(f"{len(workload)} requests (mean prompt {mean_prompt:.0f}, mean output {mean_output:.0f}"
          f" tokens), {waste.num_steps} request-steps, page_size {args.page_size}")
    print(f"paged KV cache:                      {waste.paged:6.2%} of allocated slots unused")
    print(f"contiguous, max_model_len={args.max_model_len}:     "
          f"{waste.contiguous:6.2%} of allocated slots unused")
    print(f"contiguous, prompt+output reserved:  {waste.reserved_exact:6.2%} "
          "of allocated slots unused (needs the output length in advance)")


if __name__ == "__main__":
    main()
