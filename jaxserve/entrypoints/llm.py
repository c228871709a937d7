"""LLM: the offline Python API. LLM(model=..., **engine settings).generate(prompts, params).

A thin driver over Engine: adds every prompt, steps until all finish, returns outputs in
prompt order. It holds no scheduling or device logic of its own.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from tqdm.auto import tqdm

from jaxserve.engine import generation_defaults
from jaxserve.config import EngineConfig
from jaxserve.model.loaders import hub_cache
from jaxserve.engine.engine import Engine, frozen_heap
from jaxserve.engine.outputs import RequestOutput
from jaxserve.core.request import SamplingParams


def _as_prompt_list(prompts) -> list:
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(p, int) for p in prompts):
        return [prompts]  # one prompt given as token ids
    return prompts


class LLM:
    def __init__(self, model: str = "default", *, loaded=None, progress: bool = True, **settings):
        self.config = EngineConfig.from_kwargs(model=model, **settings)
        self.engine = Engine(self.config, loaded=loaded, progress=progress)
        # generate(prompts) without params: the model's generation_config.json, as vLLM does
        self.default_sampling_params = generation_defaults.sampling_params(
            {}, generation_defaults.read_generation_defaults(
                hub_cache.with_revision(model, self.config.model.revision)))

    def close(self) -> None:
        """Release the engine's runner (multi-host: stop the followers)."""
        self.engine.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: str | Sequence, sampling_params=None, *, use_tqdm: bool = True,
                 priorities: Sequence[int] | None = None,
                 lora_request=None) -> list[RequestOutput]:
        """lora_request: a LoRARequest for every prompt, or a list of one (or None) per
        prompt, as vLLM's (the engine must be started with enable_lora)."""
        prompts = _as_prompt_list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or self.default_sampling_params] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts")
        # Only finished outputs are read here: the engine makes no per-step snapshots for them
        # (as vLLM's LLM.generate asks for RequestOutputKind.FINAL_ONLY).
        final = {id(sp): dataclasses.replace(sp, output_kind="final_only") for sp in params}
        if isinstance(lora_request, (list, tuple)):
            if len(lora_request) != len(prompts):
                raise ValueError(f"got {len(lora_request)} lora_requests for {len(prompts)} "
                                 "prompts")
            loras = list(lora_request)
        else:
            loras = [lora_request] * len(prompts)
        if self.engine.rollout.holds_steps:
            raise RuntimeError("generation is paused or the engine is asleep: call "
                               "resume_generation() / wake_up() (and, after sleep(level=2), "
                               "update_weights) first")
        requests = [self.engine.make_request(p, final[id(sp)],
                                             priority=priorities[i] if priorities else 0,
                                             lora_request=loras[i])
                    for i, (p, sp) in enumerate(zip(prompts, params))]
        for request in requests:
            self.engine.add(request)
        results: dict[str, RequestOutput] = {}
        with tqdm(total=len(requests), desc="generating", disable=not use_tqdm) as bar, \
                frozen_heap():
            while len(results) < len(requests):
                for out in self.engine.step():
                    if out.finished:
                        results[out.request_id] = out
                        bar.update(1)
        return [results[r.external_id] for r in requests]

    def chat(self, messages: list[dict], sampling_params=None, **kwargs) -> RequestOutput:
        prompt = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        ids = self.tokenizer.encode(prompt, add_special_tokens=False)
        return self.generate([ids], sampling_params, **kwargs)[0]

    # ---- rollouts (engine/rollout.py; docs/rollouts.md) -----------------------------------
    def update_weights(self, params) -> int:
        """Swap in new weights: the engine's state pytree (get_weights()), a dict of our
        parameter names, or a flat dict of Hugging Face names; host or device arrays. No
        compilation; the prefix cache is flushed. Returns the new weight version."""
        return self.engine.rollout.update_weights(params)

    def update_weights_from_disk(self, path: str | None = None) -> int:
        """update_weights from a safetensors directory, a jaxserve (Orbax) checkpoint or a GGUF
        file (None: the model this LLM started from)."""
        return self.engine.rollout.update_weights_from_disk(path)

    def get_weights(self):
        """A device copy of the weights in the engine's state pytree (what a trainer updates
        and gives back to update_weights)."""
        return self.engine.rollout.get_weights()

    @property
    def weight_version(self) -> int:
        return self.engine.rollout.weight_version

    def sleep(self, level: int = 1) -> None:
        """Free the KV pool and prefix cache; level 1 moves the weights to host memory, level 2
        discards them. Refused while requests are unfinished and generation is not paused."""
        self.engine.rollout.sleep(level)

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Restore what sleep freed ("weights", "kv_cache"; None: both)."""
        self.engine.rollout.wake_up(tags)

    @property
    def is_sleeping(self) -> bool:
        return self.engine.rollout.is_sleeping

    def pause_generation(self, mode: str = "abort") -> list[RequestOutput]:
        """Stop scheduling: "abort" ends every request (their partial outputs are returned),
        "wait" finishes them first, "keep" keeps them for resume_generation()."""
        return self.engine.rollout.pause(mode)

    def resume_generation(self) -> None:
        self.engine.rollout.resume()

    @property
    def is_paused(self) -> bool:
        return self.engine.rollout.paused
