"""Prompt intake for the front ends: size limits checked before tokenizing, and a bounded pool
that tokenizes and renders chat templates off the event loop.

PromptLimits refuses a prompt that cannot fit before any tokenizer work: more characters than
max_model_len tokens could ever spell (the tokenizer's longest token, in characters, times
max_model_len), more token ids than max_model_len, or chat messages whose contents together are
over the character limit. Each refusal is a core.intake.RequestError naming the field and the
limit (the front ends map it to INVALID_ARGUMENT / 400); every check on the tokenized request
is core/intake.py's. `max_request_bytes` bounds a whole encoded request
(no valid prompt is longer, with room for sampling settings and grammars), so a front end can
refuse a huge message before decoding it: decoding 3 MiB of token ids takes ~30 ms.

TextPool runs tokenizer and template calls on a few worker threads; calls beyond them queue,
never refused: what can wait there is bounded by the front ends' own limits (request bodies by
max_request_bytes / --http-max-body-bytes, requests by --max-queued-requests-per-key), and a
prompt given as token ids never comes here (it is checked inline, which is cheap).
Hugging Face `tokenizers` holds the GIL in `encode` but releases it in `encode_batch`, so
`encode` here calls the batch form: a long prompt being tokenized does not stall the loop.
No engine state, no scheduling, no device work.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from jaxserve.core.intake import RequestError

# A tokenizer without a vocabulary to measure (a test's byte tokenizer): assume tokens are at
# most this many characters long.
DEFAULT_MAX_TOKEN_CHARS = 32
INLINE_MAX_CHARS = 4096   # shorter prompts are tokenized on the caller's thread (~1 ms)


def max_token_chars(tokenizer) -> int:
    """The most characters one token can stand for (its raw vocabulary string's length: a
    byte-level token's characters are bytes, so never fewer than the text it decodes to)."""
    backend = getattr(tokenizer, "backend", None)
    if backend is None or not hasattr(backend, "get_vocab"):
        return DEFAULT_MAX_TOKEN_CHARS
    vocab = backend.get_vocab(with_added_tokens=True)
    return max((len(token) for token in vocab), default=DEFAULT_MAX_TOKEN_CHARS) or 1


def encode(tokenizer, text: str, add_special_tokens: bool = True) -> list[int]:
    """tokenizer.encode(text), releasing the GIL while the Rust tokenizer runs when it can."""
    backend = getattr(tokenizer, "backend", None)
    if backend is not None and hasattr(backend, "encode_batch"):
        return backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
    return tokenizer.encode(text, add_special_tokens=add_special_tokens)


@dataclass(frozen=True)
class PromptLimits:
    max_prompt_tokens: int     # max_model_len: the prompt alone must leave room for an output
    max_prompt_chars: int      # no text longer than this can be max_prompt_tokens tokens

    @classmethod
    def for_engine(cls, max_model_len: int, tokenizer) -> "PromptLimits":
        return cls(max_model_len, max_model_len * max_token_chars(tokenizer))

    @property
    def max_request_bytes(self) -> int:
        """4 UTF-8 bytes per character, or 5 varint bytes per token id, plus 1 MiB."""
        return max(4 * self.max_prompt_chars, 5 * self.max_prompt_tokens) + (1 << 20)

    def check_text(self, text: str, field: str = "prompt") -> None:
        if len(text) > self.max_prompt_chars:
            raise RequestError(field, f"{field} has {len(text)} characters, over the limit "
                               f"of {self.max_prompt_chars} (max_prompt_chars: max_model_len "
                               f"{self.max_prompt_tokens} tokens of at most "
                               f"{self.max_prompt_chars // self.max_prompt_tokens} characters)")

    def check_num_tokens(self, num_tokens: int, field: str = "prompt_token_ids") -> None:
        if num_tokens > self.max_prompt_tokens:
            raise RequestError(field, f"{field} has {num_tokens} tokens, over the limit of "
                               f"{self.max_prompt_tokens} (max_model_len)")

    def check_messages(self, contents, field: str = "messages") -> None:
        """contents: each message's text (its parts' texts joined)."""
        total = sum(len(c) for c in contents)
        if total > self.max_prompt_chars:
            raise RequestError(field, f"{field} hold {total} characters in all, over the "
                               f"limit of {self.max_prompt_chars} (max_prompt_chars)")


class TextPool:
    """A few worker threads for tokenizer and template work; calls beyond them wait in
    order."""

    def __init__(self, num_workers: int = 2):
        self.num_workers = num_workers
        self._executor = ThreadPoolExecutor(num_workers, thread_name_prefix="jaxserve-text")

    async def run(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
