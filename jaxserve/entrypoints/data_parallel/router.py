"""The data-parallel routing policy: which rank gets a request. Plain Python, no I/O, no jax.

Policy, in order:
1. the most prefix-cache overlap: the number of leading full pages of the prompt whose chained
   hash the rank's record holds. The record is the front end's own estimate, not the rank's
   cache: the page hashes of every prompt the front end has sent that rank, least recently sent
   dropped first once it holds as many pages as the rank's KV pool (the rank evicts least
   recently used pages too, so the estimate ages the same way; it misses evictions forced by
   long outputs, and never sees output pages);
2. then the fewest waiting tokens: prompt tokens of the rank's requests that have not produced a
   first token yet (prefill still to do), plus one per request already decoding;
3. then the fewest requests in flight, then the lowest rank index.
A dead rank is never chosen. Hashes are of token ids only (no adapter: LoRA is refused with data
parallelism), chained as the page manager chains them, so two prompts share a page's hash only
when they share every token up to its end.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field


def page_hashes(prompt_token_ids: list[int], page_size: int) -> list[int]:
    """The chained hash of each full page of the prompt (a partial last page has none)."""
    hashes, parent = [], 0
    for end in range(page_size, len(prompt_token_ids) + 1, page_size):
        parent = hash((parent, tuple(prompt_token_ids[end - page_size:end])))
        hashes.append(parent)
    return hashes


@dataclass
class RankLoad:
    """What the front end knows of one rank."""
    max_pages: int                          # the size of its record: its KV pool's pages
    alive: bool = True
    num_in_flight: int = 0
    waiting_tokens: int = 0                 # see the module docstring
    num_routed: int = 0                     # requests sent to it, ever
    record: OrderedDict = field(default_factory=OrderedDict)  # page hash -> None, LRU first

    def overlap(self, hashes: list[int]) -> int:
        """Leading pages of hashes this rank's record holds."""
        num = 0
        for h in hashes:
            if h not in self.record:
                break
            num += 1
        return num

    def remember(self, hashes: list[int]) -> None:
        for h in hashes:
            self.record[h] = None
            self.record.move_to_end(h)
        while len(self.record) > self.max_pages:
            self.record.popitem(last=False)


class Router:
    def __init__(self, num_ranks: int, page_size: int, pages_per_rank: int):
        self.page_size = page_size
        self.ranks = [RankLoad(pages_per_rank) for _ in range(num_ranks)]

    def choose(self, prompt_token_ids: list[int]) -> tuple[int, list[int]]:
        """(rank, the prompt's page hashes) for a new request; ValueError when no rank lives."""
        hashes = page_hashes(prompt_token_ids, self.page_size)
        live = [i for i, r in enumerate(self.ranks) if r.alive]
        if not live:
            raise ValueError("no data-parallel rank is alive")
        best = min(live, key=lambda i: (-self.ranks[i].overlap(hashes),
                                        self.ranks[i].waiting_tokens,
                                        self.ranks[i].num_in_flight, i))
        return best, hashes

    def sent(self, rank: int, hashes: list[int], num_prompt_tokens: int) -> None:
        r = self.ranks[rank]
        r.remember(hashes)
        r.num_in_flight += 1
        r.num_routed += 1
        r.waiting_tokens += num_prompt_tokens

    def started(self, rank: int, num_prompt_tokens: int) -> None:
        """The request's first token came: its prefill is done, it decodes one token a step."""
        self.ranks[rank].waiting_tokens -= num_prompt_tokens - 1

    def ended(self, rank: int, num_prompt_tokens: int, started: bool) -> None:
        r = self.ranks[rank]
        r.num_in_flight -= 1
        r.waiting_tokens -= 1 if started else num_prompt_tokens

    def died(self, rank: int) -> None:
        r = self.ranks[rank]
        r.alive = False
        r.record.clear()
