"""The `repeat` benchmark workload: bundled prompts whose answers mostly repeat the prompt
(copy, edit, rename, reformat), sent through the model's chat template.

Host code over the tokenizer only; it builds requests and never runs them.
"""

from __future__ import annotations

import json
from importlib import resources

from jaxserve.bench.workloads import BenchRequest


def repeat_prompts() -> list[str]:
    text = resources.files("jaxserve.bench").joinpath("data/repeat_prompts.json").read_text()
    return list(json.loads(text)["prompts"])


def repeat_workload(tokenizer, num_requests: int, output_len: int) -> list[BenchRequest]:
    """num_requests requests cycling through the bundled prompts, each with max_tokens
    output_len (they usually stop earlier, at the end of the repeated text)."""
    prompts = repeat_prompts()
    requests = []
    for i in range(num_requests):
        message = [{"role": "user", "content": prompts[i % len(prompts)]}]
        text = tokenizer.apply_chat_template(message, add_generation_prompt=True)
        requests.append(BenchRequest(tokenizer.encode(text, add_special_tokens=False),
                                     output_len))
    return requests
