"""TokenPrefix: a request's first `length` tokens (prompt, then outputs) as PageManager.commit
reads them, a page at a time, with no copy of the whole history per committed page. Plain
Python over the request's lists.
"""

from __future__ import annotations

from jaxserve.core.request import Request


class TokenPrefix:
    __slots__ = ("prompt", "outputs", "length")

    def __init__(self, request: Request, length: int):
        self.prompt, self.outputs = request.prompt_token_ids, request.output_token_ids
        self.length = min(length, len(self.prompt) + len(self.outputs))  # as a list's [:length]

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: slice) -> list[int]:
        start, stop, step = index.indices(self.length)
        if step != 1:
            raise ValueError("a token prefix slices with step 1 only")
        n = len(self.prompt)
        if stop <= n:
            return self.prompt[start:stop]
        if start >= n:
            return self.outputs[start - n:stop - n]
        return self.prompt[start:] + self.outputs[:stop - n]
