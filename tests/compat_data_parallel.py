"""The compatibility matrix's data-parallel runs: one covering configuration
(compat_table.DP_COVERING) served by two data-parallel ranks, each a process holding the
configuration's whole engine, driven through DataParallelClient as `jaxserve serve
--data-parallel-size 2` drives them (the prompt's route, intake, the wire between processes).
The requests and the oracle comparison are compat_engines.EngineRun's. Run by
tests/compat_engines.py, in its interpreter (the ranks inherit its two virtual CPU devices); no
assertion here.
"""

from __future__ import annotations

import asyncio

from compat_engines import EngineRun, engine_settings

NUM_RANKS = 2
# Requests split over two ranks press each rank's pool less than one engine's: each rank gets
# the fewest pages the longest request needs (the tool call's 93 tokens, 4 to a page), and the
# batch carries every prompt once more for LONG_TOKENS tokens, more than two ranks' pools hold
# at once, so both ranks preempt.
NUM_PAGES, LONG_TOKENS = 25, 40


class DataParallelRun(EngineRun):
    """A covering configuration behind DataParallelClient; the ranks' counters from their
    stats messages."""

    def __init__(self, config: dict, dirs: dict, oracle):
        from jaxserve.config import EngineConfig
        from jaxserve.entrypoints.data_parallel.client import DataParallelClient

        self.loop = asyncio.new_event_loop()
        engine_config = EngineConfig.from_kwargs(model=str(dirs[config["model"]]),
                                                 **{**engine_settings(config),
                                                    "num_pages": NUM_PAGES})
        self.client = self.loop.run_until_complete(
            DataParallelClient.launch(engine_config, NUM_RANKS))
        super().__init__(config, dirs, oracle, self.client.engine.tokenizer,
                         self.client.engine.info.eos_token_ids)

    def requests(self) -> list[tuple]:
        from jaxserve import SamplingParams

        long = SamplingParams(max_tokens=LONG_TOKENS, temperature=0.0, ignore_eos=True)
        return super().requests() + [(p, long, None, None, f"long prompt {i}")
                                     for i, p in enumerate(self.prompts)]

    def serve(self, batch: list[tuple]) -> list:
        """Every request at once, as concurrent callers of the server."""
        async def one(index: int, prompt: list[int], params):
            final = None
            async for out in self.client.generate(params=params, prompt_token_ids=prompt,
                                                  request_id=f"r{index}"):
                final = out
            return final

        async def all_of():
            return await asyncio.gather(*(one(i, b[0], b[1]) for i, b in enumerate(batch)))

        return self.loop.run_until_complete(all_of())

    def run(self) -> dict:
        self.check_requests()
        self.loop.run_until_complete(asyncio.sleep(1.0))  # the ranks' last stats messages
        stats = [rank.stats for rank in self.client.ranks]
        return {"config": self.config, "failures": self.failures,
                "preemptions": sum(s.num_preemptions for s in stats if s is not None),
                "requests_per_rank": [r.num_routed for r in self.client.router.ranks]}

    def close(self) -> None:
        self.client.stop(timeout=10.0)
        self.loop.close()
