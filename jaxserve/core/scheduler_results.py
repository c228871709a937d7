"""The scheduler's half that takes a step's results in: sampled tokens -> TokenEvents.

A mixin of Scheduler (scheduler.py), kept apart so each file stays one job: schedule() plans
and counts a chunk's tokens as computed at once; update() here confirms them when the step's
tokens reach the host, which under async scheduling is one step later. Then a request may have
been preempted (its token is still taken: recompute re-reads it, a swap copied the KV that
holds it), or finished meanwhile (its token is dropped, with its KV slot: the pages went back
when it finished). Only KV written by steps whose results are in is ever committed to the
prefix cache. Plain Python: no jax, no device arrays, no text.
"""

from __future__ import annotations

import numpy as np

from jaxserve.core.plan import StepPlan, StepResult
from jaxserve.core.speculation import update_drafts
from jaxserve.core.token_prefix import TokenPrefix
from jaxserve.core.request import DecodeTokens, FinishReason, Request, RequestStatus, TokenEvent
from jaxserve.core.step_rows import prompt_logprob_entries, top_logprob_pairs


class SchedulerResults:
    def update(self, plan: StepPlan, result: StepResult) -> list[TokenEvent]:
        """Apply one step's results (index i belongs to the plan's i-th request: its decode
        rows first, then plan.chunks).

        result.token_ids[i] is one token, or (steps that verify drafts) a row of tokens: the
        accepted drafts, then the target's own next token, then -1 padding; logprobs[i] has
        the same shape. top_ids[i] / top_logprobs[i] (plain steps): the most likely
        alternatives, best first. prompt_ids / prompt_logprobs: [T, 1 + K] per token row (the
        next prompt token's, then the alternatives), when a chunk reports prompt logprobs."""
        events, chunk_events = [], []
        token_ids, logprobs = np.asarray(result.token_ids), np.asarray(result.logprobs)
        num_decode, num_chunks = plan.num_decode_rows, len(plan.chunks)
        self._update_decode_rows(plan.decode, token_ids[:num_decode].tolist(),
                                 logprobs[:num_decode].tolist(), events)
        # every chunk's row as a list: one token, or a verified run (-1 after it)
        rows = slice(num_decode, num_decode + num_chunks)
        token_rows = token_ids[rows].reshape(num_chunks, *token_ids.shape[1:] or (1,)).tolist()
        logprob_rows = logprobs[rows].reshape(num_chunks, *logprobs.shape[1:] or (1,)).tolist()
        top_ids, top_logprobs = result.top_ids, result.top_logprobs
        prompt = (result.prompt_ids, result.prompt_logprobs)
        requests, commits = self.requests, self.window.commits
        next_row = num_decode  # the chunk's token rows end there
        for i, chunk in enumerate(plan.chunks):
            num_rows = len(chunk.token_ids)
            next_row += num_rows
            request = requests.get(chunk.request_id)
            if request is None:
                continue  # finished (aborted, stopped) while the step ran: drop its tokens
            running = request.status == RequestStatus.RUNNING
            request.prompt_logprobs += prompt_logprob_entries(chunk, next_row - num_rows, prompt)
            if chunk.sampling is None:
                if running:
                    self._commit(request, chunk.start_position, chunk.kv_len)
                continue
            request.num_pending_tokens -= 1
            row, row_logprobs = token_rows[i], logprob_rows[i]
            new_tokens = row[:sum(t >= 0 for t in row)]
            reason = request.take_tokens(new_tokens)  # (cut after a stop token)
            new_logprobs = row_logprobs[:len(new_tokens)]
            if request.grammar is not None and not request.grammar.accept(new_tokens):
                request.error = f"the grammar refused sampled tokens {new_tokens}"
                reason = FinishReason.ERROR  # never expected: the step masked them
            # accepted drafts' KV is final (update_drafts gives the rejected ones' slots back)
            num_accepted = len(new_tokens) - 1
            request.num_computed_tokens += num_accepted
            start, kv_len = chunk.start_position, chunk.kv_len + num_accepted
            if running and commits(start, kv_len):
                self._commit(request, start, kv_len)
            self._release_held(request.request_id)  # its prompt KV is final: share it
            top = top_logprob_pairs(chunk, top_ids, top_logprobs, i + num_decode, new_tokens)
            chunk_events.append(TokenEvent(
                request.request_id, tuple(new_tokens), tuple(new_logprobs), reason,
                request.error if reason is FinishReason.ERROR else None, top))
        update_drafts(plan, chunk_events, requests, self.pages, self.speculation)
        for event in chunk_events:
            if event.finish_reason is not None:
                self._finish(requests[event.request_id], event.finish_reason)
        events += chunk_events
        return events

    def _update_decode_rows(self, decode, token_rows, logprob_rows, events) -> None:
        """update() of plan.DecodeRows (rows 0..D-1): one token each, of a plain request (no
        grammar, no top logprobs, no drafts), as update()'s one-token case. The tokens that
        finish nothing go out as one DecodeTokens event, first; the others each as a
        TokenEvent."""
        requests, commits, held = self.requests, self.window.commits, self.sharing.held
        positions = decode.meta[:, decode.POSITION].tolist()
        batch = DecodeTokens([], [], [])
        events.append(batch)
        ids, tokens, logprobs = batch.request_ids, batch.token_ids, batch.logprobs
        for request_id, token, logprob, start in zip(decode.request_ids, token_rows,
                                                     logprob_rows, positions):
            request = requests.get(request_id)
            if request is None:
                continue  # finished while the step ran: its token is dropped
            request.num_pending_tokens -= 1
            reason = request.take_token(token)
            if commits(start, start + 1) and request.status == RequestStatus.RUNNING:
                self._commit(request, start, start + 1)
            if held:  # (per request and step: no call unless some sample waits)
                self._release_held(request_id)
            if reason is None:
                ids.append(request_id)
                tokens.append(token)
                logprobs.append(logprob)
            else:
                self._finish(request, reason)
                events.append(TokenEvent(request_id, (token,), (logprob,), reason))

    def _commit(self, request: Request, start: int, kv_len: int) -> None:
        """KV of positions start..kv_len-1 is written (its step's results are in): cache the
        pages that filled (none when the step completed no page: the next one that does
        registers every full page since), and give back those wholly out of the window."""
        self.pages.commit(request.request_id, TokenPrefix(request, kv_len))
        self.window.release(request.request_id, kv_len)  # (not past what is committed: async lag)
