"""Speculation: builds speculative decoding from an EngineConfig for the Engine to plug in.

The Engine asks it three things: extra KV bytes per token (a separate draft's cache shares the
page pool's page ids, so it is sized with it), the policy to hand the scheduler, and to wrap the
ModelRunner. With speculation off every answer is neutral (0, None, the runner itself), so the
engine has no branch of its own. Loading only: nothing here runs a step.
"""

from __future__ import annotations

from jaxserve.config import EngineConfig
from jaxserve.spec.ngram import NgramProposer
from jaxserve.spec.policy import SpeculationPolicy


class Speculation:
    def __init__(self, config: EngineConfig, policy: SpeculationPolicy | None = None,
                 draft=None):
        self.config = config
        self.policy = policy
        self.draft = draft  # (ModelConfig, params, shares the target's weights) or None

    @classmethod
    def build(cls, config: EngineConfig, loaded, *, progress: bool = True) -> "Speculation":
        """loaded: the target's LoadedModel (the draft `layers:N` is cut from it)."""
        spec = config.speculative
        if spec.speculative_method is None:
            return cls(config)
        policy = SpeculationPolicy(
            spec.speculative_method, spec.num_speculative_tokens,
            ngram=NgramProposer(spec.speculative_ngram_min, spec.speculative_ngram_max),
            disable_by_batch_size=spec.speculative_disable_by_batch_size)
        draft = None
        if spec.speculative_method == "draft":
            from jaxserve.spec.draft import load_draft
            draft = load_draft(spec.speculative_draft, loaded, progress=progress)
        return cls(config, policy, draft)

    def draft_kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """0 without a draft, or for `layers:N` (it works in the target's cache)."""
        if self.draft is None or self.draft[2]:
            return 0
        return self.draft[0].kv_bytes_per_token(dtype_bytes)

    def wrap(self, runner):
        """The runner the engine steps: `runner` itself, or a SpeculativeRunner around it."""
        if self.policy is None:
            return runner
        from jaxserve.spec.runner import SpeculativeRunner
        return SpeculativeRunner(runner, self.policy, draft=self.draft)
