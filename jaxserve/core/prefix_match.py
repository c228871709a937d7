"""The prefix cache's lookup: the longest cached chain of full pages that a prompt starts with,
on the device and then in the host tier.

A read of a PageManager's fields only (it changes nothing; page_manager.py imports this module,
so this one does not import page_manager.py). A chain key only names a candidate: every hit
compares the page's stored token ids and its parent's registration serial, so neither a hash
collision nor a re-registered parent can return KV of another prefix. No jax.
"""

from __future__ import annotations

from typing import Sequence

from jaxserve.core.page_stats import NULL_PAGE, prefix_root


def match_prefix(pm, token_ids: Sequence[int], lora_id: int = 0) -> list[tuple[int, int]]:
    """[(device page, key)] of the longest cached chain of `pm` (a PageManager) matching a
    prefix of token_ids under LoRA adapter lora_id (0: none); NULL_PAGE: found in the host
    tier. At least the last token is left to compute."""
    if not pm.enable_prefix_caching:
        return []
    ps, host, hash_fn = pm.page_size, pm.host_tier, pm._hash_fn
    cached, tokens, serials, parent_serials = pm._cached, pm._tokens, pm._serial, pm._parent_serial
    matched: list[tuple[int, int]] = []
    key, serial = prefix_root(hash_fn, lora_id)
    for i in range((len(token_ids) - 1) // ps):  # never the whole prompt: one token computes
        page_tokens = tuple(token_ids[i * ps:(i + 1) * ps])
        key = hash_fn(key, page_tokens)
        page = cached.get(key)
        if page is not None:
            if tokens[page] != page_tokens or parent_serials[page] != serial:
                break
            matched.append((page, key))
            serial = serials[page]
            continue
        entry = None if host is None else host.get(key)
        if (entry is None or entry.tokens != page_tokens or entry.parent_serial != serial
                or entry.slot in pm._pending_stores):
            break
        matched.append((NULL_PAGE, key))
        serial = entry.serial
    return matched
