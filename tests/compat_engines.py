"""Runs the compatibility matrix's covering engines (compat_table.COVERING) and compares every
output with the oracle (compat_oracle.py). Run as a script in a fresh interpreter with two
virtual CPU devices (tensor and expert parallelism need them before jax starts):

    XLA_FLAGS=--xla_force_host_platform_device_count=2 python tests/compat_engines.py OUT.json

Each engine serves, in one batch, plain greedy prompts (every other one under a LoRA adapter
when LoRA is on), a regex-constrained request, a request whose grammar starts after a token
sequence (what a reasoning parser asks of the engine), and a named tool call (the JSON schema
the OpenAI front end makes of it), the last three with n=2 and logprobs=2; then prompts
sharing prefixes with the first batch; then pause / sleep / wake / update_weights / resume
and the first batch again. The page pool is small enough that requests are preempted. OUT.json
gets, per engine, the mismatches with the oracle and what each engine exercised; the assertions
are tests/test_compatibility_matrix.py's.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import conftest  # noqa: E402,F401  (the persistent compilation cache, before jax starts)
import arch_oracle  # noqa: E402
import compat_oracle  # noqa: E402
import compat_table  # noqa: E402

NUM_TOKENS = 12
LETTERS = "bcdfgkm"  # one token each in the tiny BPE (no merge starts or ends with them)
# The pool (27 usable pages of 4 tokens) holds the longest request (the tool call: 3 + 90
# tokens) but not the batch, so requests are preempted.
ENGINE = dict(max_num_seqs=4, max_num_batched_tokens=16, token_buckets=(16,), seq_buckets=(4,),
              max_model_len=128, page_size=4, num_pages=28, int8_activations="off",
              swap_space=1 << 20)
TOOL = {"type": "function", "function": {"name": "pick", "parameters": {
    "type": "object", "properties": {"x": {"enum": ["bc", "dk"]}}, "required": ["x"],
    "additionalProperties": False}}}


def engine_settings(config: dict) -> dict:
    """LLM(...) keywords for one covering configuration (compat_table.FACTORS levels)."""
    s = dict(ENGINE)
    s["enable_prefix_caching"] = config["prefix"] != "off"
    if config["prefix"] == "host":
        s["host_prefix_cache_size"] = 1 << 20
    s["preemption_mode"] = config["preemption"]
    s["enable_chunked_prefill"] = config["chunked"] == "on"
    s["async_scheduling"] = config["async"] == "on"
    if config["spec"] != "none":
        s.update(speculative_method=config["spec"], num_speculative_tokens=2)
        if config["spec"] == "draft":
            s["speculative_draft"] = "layers:1"
    s["quantization"] = {"float": "none"}.get(config["weights"], config["weights"])
    if config["kv"] == "fp8":
        s["kv_cache_dtype"] = "fp8"
    if config["lora"] == "on":
        s.update(enable_lora=True, max_loras=1, max_lora_rank=4)
    if config["parallel"] != "1":
        s["tensor_parallel_size"] = 2
    if config["parallel"] == "ep":
        s["enable_expert_parallel"] = True
    if config["kv_events"] == "on":  # a zmq publisher on a fresh socket file
        endpoint = f"ipc://{tempfile.mkdtemp(prefix='kv-events-')}/pub"
        s["kv_events_config"] = json.dumps({"enable_kv_cache_events": True,
                                            "publisher": "zmq", "endpoint": endpoint})
    return s


class EngineRun:
    """One covering configuration's requests, its oracle, and the mismatches found; `serve`
    is how the configuration's server answers a batch."""

    def __init__(self, config: dict, dirs: dict, oracle, tokenizer, eos: tuple):
        self.config, self.dirs, self.oracle = config, dirs, oracle
        self.tokenizer, self.eos = tokenizer, tuple(eos)
        self.lora = config["lora"] == "on"
        self.failures: list[str] = []
        self.prompts = arch_oracle.prompts(0, compat_oracle.VOCAB)
        self.compiler = None

    def serve(self, batch: list[tuple]) -> list:
        """The batch's final RequestOutputs, in order."""
        raise NotImplementedError

    def adapter(self, i: int):
        return "a1" if self.lora and i % 2 == 0 else None

    def lora_request(self, name):
        from jaxserve import LoRARequest
        return None if name is None else LoRARequest(name, 1, str(self.dirs[
            self.config["model"] + "-lora"]))

    def grammar(self, so, after=()):
        from jaxserve.structured.compiler import GrammarCompiler
        from jaxserve.structured.deferred import request_matcher

        if self.compiler is None:
            self.compiler = GrammarCompiler(self.tokenizer, compat_oracle.VOCAB)
        return request_matcher(self.compiler.get(so), after)

    def requests(self) -> list[tuple]:
        """(prompt, SamplingParams, adapter, grammar maker or None, label)."""
        from jaxserve import SamplingParams
        from jaxserve.entrypoints.openai.tools import plan_tools
        from jaxserve.structured.params import StructuredOutputs

        plain = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True)
        out = [(p, plain, self.adapter(i), None, f"plain prompt {i}")
               for i, p in enumerate(self.prompts)]
        regex = StructuredOutputs(regex=f"[{LETTERS}]{{4}}")
        free, _ = self.oracle.greedy(self.prompts[1], 2, self.adapter(0))
        after = (free[1],)  # a token the free greedy output reaches: the grammar starts there
        tool = plan_tools([TOOL], {"type": "function", "function": {"name": "pick"}},
                          parallel_tool_calls=False).structured_outputs
        # the tool call's budget: its JSON's 5 gaps of at most 16 whitespace characters each
        # (structured/compiler.py) and its 9 other tokens, after the 2 free ones
        for label, prompt, so, aft, steps in (
                ("structured", self.prompts[1], regex, (), 16),
                ("reasoning", self.prompts[1], regex, after, 16),
                ("tools", self.prompts[1], tool, after, 90)):
            params = SamplingParams(max_tokens=steps, temperature=0.0, n=2, logprobs=2,
                                    structured_outputs=so, structured_outputs_after=aft)
            out.append((prompt, params, self.adapter(0), (so, aft), label))
        return out

    def check_batch(self, batch: list[tuple], stage: str) -> list:
        """Serve `batch` at once, note every mismatch with the oracle; the outputs."""
        import numpy as np

        outs = self.serve(batch)
        for (prompt, params, adapter, grammar, label), out in zip(batch, outs):
            if out.error:
                self.failures.append(f"{stage}, {label}: error {out.error}")
                continue
            matcher = None if grammar is None else self.grammar(*grammar)
            want, want_lp = self.oracle.greedy(prompt, params.max_tokens, adapter, matcher,
                                               self.eos, key=label)
            for sample in out.outputs:
                if sample.token_ids != want:
                    self.failures.append(f"{stage}, {label} (adapter {adapter}), sample "
                                         f"{sample.index}: got {sample.token_ids}, oracle {want}")
                elif params.logprobs is not None:
                    err = np.abs(np.asarray(sample.logprobs) - np.asarray(want_lp)).max()
                    if not err <= 2e-3:
                        self.failures.append(f"{stage}, {label}: logprobs differ from the "
                                             f"oracle's by up to {err:.2e}")
            if label == "tools":
                self.check_tool_text(out.outputs[0].token_ids, grammar[1], stage)
        return outs

    def check_tool_text(self, token_ids: list[int], after: tuple, stage: str) -> None:
        """The tokens after the grammar's start sequence are the named tool's arguments."""
        start = token_ids.index(after[0]) + 1 if after[0] in token_ids else 0
        text = self.tokenizer.decode(token_ids[start:], skip_special_tokens=True)
        try:
            call = json.loads(text)
        except ValueError:
            self.failures.append(f"{stage}, tools: the output {text!r} holds no JSON arguments")
            return
        if call.get("x") not in ("bc", "dk"):
            self.failures.append(f"{stage}, tools: arguments {call} break the tool's schema")

    def shared_prefix_batches(self) -> list[list[tuple]]:
        """Prompt 3 alone, then two prompts that begin with it: the second batch can read
        prompt 3's pages from the prefix cache."""
        from jaxserve import SamplingParams

        plain = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True)
        p, adapter = self.prompts[3], self.adapter(3)
        return [[(p, plain, adapter, None, "prompt 3")],
                [(p + tail, plain, adapter, None, f"prompt 3 + {tail}")
                 for tail in ([7, 8, 9], [11, 12])]]

    def check_requests(self) -> tuple[list[tuple], int]:
        """The first batch, then the shared-prefix batches, each checked; (the first batch,
        the tokens the prompts sharing a prefix read from the cache)."""
        batch = self.requests()
        self.check_batch(batch, "first batch")
        first, second = self.shared_prefix_batches()
        self.check_batch(first, "a prefix")
        outs = self.check_batch(second, "prompts sharing it")
        return batch, sum(o.num_cached_tokens for o in outs)


class OneEngineRun(EngineRun):
    """A covering configuration in one engine (LLM), with its lifecycle calls and counters."""

    def __init__(self, config: dict, dirs: dict, oracle):
        from jaxserve.entrypoints.llm import LLM

        # from the path, as `jaxserve serve` loads it (a multi-host follower loads it so too:
        # both processes must quantize the same way, collective for collective)
        self.llm = LLM(str(dirs[config["model"]]), progress=False, **engine_settings(config))
        super().__init__(config, dirs, oracle, self.llm.tokenizer,
                         self.llm.engine.model_config.eos_token_ids)
        self.events: list = []
        publish = self.llm.engine.kv_events.publish
        self.llm.engine.kv_events.publish = lambda ev: (self.events.extend(ev), publish(ev))

    def serve(self, batch: list[tuple]) -> list:
        return self.llm.generate([b[0] for b in batch], [b[1] for b in batch], use_tqdm=False,
                                 lora_request=[self.lora_request(b[2]) for b in batch])

    def close(self) -> None:
        self.llm.close()

    def lifecycle(self) -> None:
        llm = self.llm
        llm.pause_generation("wait")
        llm.sleep(level=1)
        llm.wake_up()
        llm.resume_generation()
        llm.update_weights(llm.get_weights())

    def run(self) -> dict:
        batch, cached = self.check_requests()
        refusal = None
        if self.config["spec"] != "none":
            try:
                self.llm.sleep(level=1)
            except NotImplementedError as err:
                refusal = str(err)
        if self.config["lifecycle"] == "on":
            self.lifecycle()
            self.check_batch(batch, "after sleep / wake / update_weights")
        tier = self.llm.engine.pages.host_tier
        return {"config": self.config, "failures": self.failures,
                "host_tier_pages": [0, 0] if tier is None else [tier.stored_pages,
                                                                 tier.loaded_pages],
                "preemptions": int(self.llm.engine.scheduler.num_preemptions),
                "kv_events": len(self.events), "cached_tokens": cached,
                "lifecycle_refusal": refusal}


def main(out_path: str, only: list[str] | None = None) -> None:
    """Run every covering configuration (or those named in `only`: "3" is COVERING[3], "dp0"
    DP_COVERING[0], "mh1" MH_COVERING[1]); results to out_path: {"engines": [...],
    "data_parallel": [...], "multi_host": [...]}."""
    import torch

    from compat_data_parallel import DataParallelRun
    from compat_multihost import MultiHostRun

    # The oracle's matrices are tiny: torch's thread pool costs more than it shares (its
    # spinning threads also compete with XLA's for the two cores).
    torch.set_num_threads(1)
    runs = [("engines", str(i), c, OneEngineRun) for i, c in enumerate(compat_table.COVERING)]
    runs += [("data_parallel", f"dp{i}", c, DataParallelRun)
             for i, c in enumerate(compat_table.DP_COVERING)]
    runs += [("multi_host", f"mh{i}", c, MultiHostRun)
             for i, c in enumerate(compat_table.MH_COVERING)]
    results: dict = {"engines": [], "data_parallel": [], "multi_host": []}
    with tempfile.TemporaryDirectory() as tmp:
        dirs = compat_oracle.make_checkpoints(Path(tmp))
        oracles: dict = {}
        for kind, name, config, run_class in runs:
            if only is not None and name not in only:
                continue
            key = (config["model"], config["weights"], config["kv"], config["lora"] == "on")
            start, run = time.perf_counter(), None
            try:
                if key not in oracles:
                    oracles[key] = compat_oracle.Oracle(dirs, *key)
                run = run_class(config, dirs, oracles[key])
                try:
                    results[kind].append(run.run())
                finally:
                    run.close()
            except Exception:  # one engine failing must not hide the others
                failures = [] if run is None else run.failures
                results[kind].append({"config": config, "failures": failures + [
                    traceback.format_exc()], "preemptions": 0, "kv_events": 0,
                    "cached_tokens": 0, "lifecycle_refusal": None, "host_tier_pages": [0, 0]})
            print(f"engine {name}: {time.perf_counter() - start:.0f} s, "
                  f"{len(results[kind][-1]['failures'])} failures", file=sys.stderr, flush=True)
    Path(out_path).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:] or None)
