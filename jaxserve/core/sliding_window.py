"""Which of a request's KV pages a sliding window has left behind, given back: kv_window().

When every layer of every model sharing the page tables attends over a window (Mistral,
Qwen2's max_window_layers, a draft model alike: reusable_window), keys older than the window
are never read again, so a request's pages wholly before it go back to the pool after each
step (PageManager.release_window), and a swap moves only the pages still in the window
(SlidingWindow). With no such window no page ever dies (NoWindow). Plain Python over the page
manager's integers: no jax, no requests' other state.
"""

from __future__ import annotations

from jaxserve.core.page_manager import PageManager


def reusable_window(*models_layer_windows) -> int | None:
    """The window past which a request's KV pages are dead for every model sharing the page
    tables (a target and its draft): the largest window when every layer of every model has
    one, else None (some layer reads the whole prefix, so no page ever dies)."""
    windows = [w for layer_windows in models_layer_windows for w in layer_windows]
    return None if not windows or None in windows else max(windows)


class NoWindow:
    """Every key may be read again: no page dies; a step's KV is committed only when it
    filled a page."""

    window = None

    def __init__(self, pages: PageManager):
        self.page_size = pages.page_size

    def commits(self, start: int, kv_len: int) -> bool:
        """Whether a step that wrote positions start..kv_len-1 has anything to commit."""
        return kv_len // self.page_size > start // self.page_size

    def num_dead_pages(self, num_computed_tokens: int) -> int:
        return 0

    def release(self, request_id: str, kv_len: int) -> int:
        return 0


class SlidingWindow:
    def __init__(self, pages: PageManager, window: int):
        self.pages = pages
        self.window = window

    def commits(self, start: int, kv_len: int) -> bool:
        return True  # the window moved: pages may die even when none filled

    def num_dead_pages(self, num_computed_tokens: int) -> int:
        """Leading pages no later query reads: all their keys are before the first one the
        next query (at num_computed_tokens) sees, num_computed_tokens - window + 1."""
        return max(num_computed_tokens - self.window + 1, 0) // self.pages.page_size

    def release(self, request_id: str, kv_len: int) -> int:
        """Give back the request's dead pages (after commit) for a query at kv_len; the
        NULL_PAGE entries its table has now."""
        return self.pages.release_window(request_id, kv_len - self.window + 1)


def kv_window(pages: PageManager, window: int | None) -> NoWindow | SlidingWindow:
    return NoWindow(pages) if window is None else SlidingWindow(pages, window)
