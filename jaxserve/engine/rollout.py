"""Rollout: the engine's verbs for reinforcement-learning post-training, as vLLM names them:
update_weights, sleep / wake_up, pause_generation / resume_generation.

States. *Paused*: no step runs; requests may still be added (they wait for resume). Pausing
first settles the step in flight, then by mode: "abort" ends every request (their final
outputs, partial, are returned), "wait" steps until every request already added has finished
(their outputs are returned), "keep" leaves them where they are (a resumed request continues
as if never paused). *Asleep*: the KV pool is deleted (level 1 and 2) and the weights too (level
1 keeps them in host memory, level 2 discards them: vLLM's meanings); no step runs until
wake_up() has put both back (after level 2, the weights come from update_weights or
update_weights_from_disk, which may be called while asleep). Sleeping or updating weights is
refused while requests would run: pause first. Requests kept by a pause lose their KV when the
engine sleeps and are recomputed on resume (the scheduler's recompute preemption); across a
weight update they keep it, as vLLM's "keep" does (the prefix cache is flushed: its KV belongs
to the old weights). Every output carries the weight version that sampled its newest tokens.

Engine-thread only (AsyncEngine runs these through its inbox); device arrays are
runner/rollout_memory.py's, what is scheduled the scheduler's.
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)

PAUSE_MODES = ("abort", "wait", "keep")
WAKE_TAGS = ("weights", "kv_cache")


class Rollout:
    def __init__(self, engine):
        self.engine = engine
        self.paused = False
        self.sleep_level = 0  # the deepest level slept at since the engine was last awake
        self.weight_version = 0
        self._memory = None

    @property
    def memory(self):
        """The runner's RunnerMemory (runner/protocol.py's rollout_memory: a runner that has
        none says why, as a NotImplementedError)."""
        if self._memory is None:
            self._memory = self.engine.runner.rollout_memory()
        return self._memory

    @property
    def is_sleeping(self) -> bool:
        m = self._memory
        return m is not None and (not m.kv_on_device or m.weights != "device")

    @property
    def holds_steps(self) -> bool:
        """No step may run: paused, asleep, or the weights discarded and not yet replaced."""
        return self.paused or self.is_sleeping

    # ---- pause ------------------------------------------------------------------------
    def pause(self, mode: str = "abort") -> list:
        """Pause generation; returns the outputs made while pausing (abort: every request's
        final output; wait: the outputs of the steps that finished the requests)."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"mode={mode!r} is not one of {PAUSE_MODES}")
        engine = self.engine
        outputs = engine.settle()
        if mode == "abort":
            for request_id in engine.unfinished_request_ids():
                out = engine.abort(request_id)
                if out is not None:
                    outputs.append(out)
        elif mode == "wait" and not self.is_sleeping:
            self.paused = False
            while engine.has_unfinished():
                outputs += engine.step()
            outputs += engine.settle()
        self.paused = True
        log.info("generation paused (mode %s): %d request(s) kept", mode,
                 len(engine.unfinished_request_ids()))
        return outputs

    def resume(self) -> None:
        self.paused = False

    # ---- sleep ------------------------------------------------------------------------
    def _refuse_if_running(self, verb: str) -> None:
        num = len(self.engine.unfinished_request_ids())
        if num and not self.paused:
            raise RuntimeError(f"{verb} with {num} request(s) unfinished: pause_generation() "
                               f"first (mode 'abort', 'wait' or 'keep'), or let them finish")

    def sleep(self, level: int = 1) -> None:
        """Free the KV pool and the prefix cache (and the weights: to host memory at level 1,
        discarded at level 2)."""
        if level not in (1, 2):
            raise ValueError(f"level={level!r} must be 1 (weights kept in host memory) or 2 "
                             f"(weights discarded)")
        memory, engine = self.memory, self.engine
        engine.settle()
        self._refuse_if_running("sleep()")
        engine.scheduler.release_all_kv()  # kept requests recompute on resume
        engine.pages.reset_prefix_cache()
        memory.free_kv()
        if level == 1:
            memory.offload_weights()
        else:
            memory.discard_weights()
        self.sleep_level = max(self.sleep_level, level)
        log.info("asleep (level %d): KV pool freed, weights %s", level, memory.weights)

    def wake_up(self, tags=None) -> None:
        """Put back what sleep freed: tags "weights" (from host memory; after level 2 they come
        from update_weights) and "kv_cache" (a zeroed pool); None: both."""
        tags = list(WAKE_TAGS if tags is None else tags)
        unknown = [t for t in tags if t not in WAKE_TAGS]
        if unknown:
            raise ValueError(f"tags={unknown} are not among {WAKE_TAGS}")
        memory = self.memory
        if "weights" in tags and not memory.restore_weights():
            log.warning("wake_up: the weights were discarded (sleep level 2); the engine "
                        "waits for update_weights or update_weights_from_disk")
        if "kv_cache" in tags:
            memory.restore_kv()
        if not self.is_sleeping:
            self.sleep_level = 0

    # ---- weights ----------------------------------------------------------------------
    def update_weights(self, params) -> int:
        """Swap in new weights (runner/weight_update.py's layouts); returns the new weight
        version. Checked in full before anything changes."""
        memory, engine = self.memory, self.engine
        engine.settle()
        self._refuse_if_running("update_weights()")
        new = memory.build(params)
        memory.swap_in(new)
        engine.pages.reset_prefix_cache()
        self.weight_version += 1
        engine.set_weight_version(self.weight_version)
        log.info("weights updated: version %d", self.weight_version)
        return self.weight_version

    def update_weights_from_disk(self, path: str | None = None) -> int:
        """update_weights from a safetensors directory, a jaxserve (Orbax) checkpoint or a GGUF
        file (None: the model the engine started from), read on the host and quantized as the
        engine's own weights were at load."""
        return self.update_weights(read_weights(self.engine, path))

    def get_weights(self):
        """A device copy of the weights in the engine's state pytree."""
        return self.memory.get()


def read_weights(engine, path: str | None = None) -> dict:
    """The host params of `path` (None: the engine's own model), in the param layout, for
    update_weights: safe to call off the engine thread (it touches no engine state)."""
    from jaxserve.model.loaders.loader import load_model

    spec = engine.config.model.model if path is None else str(path)
    loaded = load_model(spec, progress=False, quantization=engine.config.model.quantization)
    if loaded.config.param_shapes() != engine.model_config.param_shapes():
        raise ValueError(f"{spec} is a different model: its parameter shapes differ from the "
                         f"engine's ({engine.model_config.name})")
    return loaded.params
