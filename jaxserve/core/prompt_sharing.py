"""PromptSharing: the samples of an n > 1 request share the KV pages of sample 0's prompt.

Samples 1..n-1 (Request.shares_prompt_of names sample 0) are held out of the waiting queue
until sample 0 has computed the prompt; then they are queued and, when admitted while sample 0
still holds its pages, fork its whole prompt pages (PageManager.fork: by ref count) and compute
only the last, partial page and what follows. A sample whose source has finished, or given
pages back, admits like any request (its cached prefix). Plain Python: no jax; it only holds
requests and answers for the scheduler, which owns their lifecycle.
"""

from __future__ import annotations

from jaxserve.core.page_manager import PageManager
from jaxserve.core.request import Request


class PromptSharing:
    def __init__(self, pages: PageManager, requests: dict[str, Request]):
        self.pages = pages
        self.requests = requests  # the scheduler's live requests, by id
        self.held: dict[str, list[Request]] = {}  # sample 0's id -> its samples held back

    @property
    def num_held(self) -> int:
        return sum(len(samples) for samples in self.held.values())

    def hold(self, request: Request) -> bool:
        """Hold a sample back while the sample it shares the prompt of has no output yet."""
        source = self.requests.get(request.shares_prompt_of or "")
        if source is None or source.output_token_ids:
            return False
        self.held.setdefault(source.request_id, []).append(request)
        return True

    def release(self, request_id: str) -> tuple[Request, ...] | list[Request]:
        """The samples held for this request's prompt, now free to queue."""
        return self.held.pop(request_id, ())

    def drop(self, request: Request) -> bool:
        """Forget a held sample (it finished while held); False if it is not held."""
        samples = self.held.get(request.shares_prompt_of or "")
        if not samples or request not in samples:
            return False
        samples.remove(request)
        return True

    def source_of(self, request: Request) -> Request | None:
        """The sample whose computed prompt pages this one may fork now, or None."""
        source = self.requests.get(request.shares_prompt_of or "")
        if (source is None or not self.pages.has_request(source.request_id)
                or source.num_computed_tokens < len(request.prompt_token_ids)):
            return None
        return source

    def fork(self, source: Request, request: Request, num_shared: int,
             num_new: int) -> int | None:
        """request takes source's first num_shared tokens' pages, and fresh pages for num_new
        more; the tokens whose KV it has, or None, holding nothing, when pages run out."""
        got = self.pages.fork(source.request_id, request.request_id, num_shared)
        if not self.pages.append_slots(request.request_id, got + num_new):
            self.pages.free(request.request_id)
            return None
        return got

    def num_shared_tokens(self, request: Request) -> int:
        """Tokens of whole prompt pages a fork shares (the last, partial page is recomputed)."""
        page_size = self.pages.page_size
        return (len(request.prompt_token_ids) - 1) // page_size * page_size
