"""One `jaxserve bench overhead` measurement: the engine's host time per decode step.

Run as a script in a fresh process (`python overhead_probe.py N STEPS [PROMPT_LEN]`), from a
copy outside any checkout, with PYTHONPATH set to the checkout it measures: `bench overhead
--baseline COMMIT` runs it inside an old commit's worktree too, so it uses only the API every
baseline commit has: LLM / EngineConfig settings, LoadedModel, random_params,
Engine.add_request / step / has_unfinished, runner.step.run (and runner.wait where present;
Scheduler(decode_rows=True) and StepPlan.num_seqs where present, as the engine has them),
each module found where that commit keeps it (_attr).
It prints one JSON line; it never compares.

The model is a tiny random Llama (4 layers, hidden 64, vocabulary 256, the default model's
tokenizer so that detokenizing costs what it costs users), so the device's share of a step is
small and the host's work shows. N requests of PROMPT_LEN prompt tokens (default 8; more shows
the host work that grows with a request's context) are all prefilled (at most PREFILL_BUDGET
tokens a step), then STEPS decode steps of all N are timed (greedy, ignore_eos). Reported per
step:

* wall_ms: wall time per decode step; tokens_per_s = N / wall.
* host_ms: the host's share. Where the engine keeps its own phase timings (engine.timings:
  schedule / build / dispatch / wait / update / emit), it is their sum less `wait`. An engine
  without them runs strictly serially, so host = wall - wait, where wait is measured by
  blocking on each step's output right after dispatch (what its np.asarray did anyway).
* device_ms: the step's executable alone on the same inputs, back to back (the device's busy
  time per step), and device_busy = device_ms / wall_ms.
* host_only_ms: the same host work (schedule, layout, update, emit) with no device at all, for
  N requests decoding, caches warm; host_only_cold_ms: the same with every cache flushed before
  each step. On a CPU the engine's own phases meet caches that the step's compute has just
  flushed (they run as long in the synchronous loop, where no compute overlaps them), and
  the cold figure is about theirs. The engine's heap freeze (frozen_heap, where it has one)
  applies to both alike.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import json
import statistics
import sys
import time
from pathlib import Path

TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=4, num_heads=4,
            num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0,
            tie_word_embeddings=False, max_position_embeddings=512, bos_token_id=1,
            eos_token_ids=(2,), name="tiny-overhead")
PROMPT_LEN = 8
PREFILL_BUDGET = 8192  # tokens a prefill step (chunked), for long prompts


def max_tokens(n: int, steps: int) -> int:
    """Enough that no request ends before the timed steps do: a request that had its first
    token in an early prefill step decodes while the others' prefill goes on."""
    return steps + 1 + -(-PROMPT_LEN * n // PREFILL_BUDGET)


def build_llm(n: int, steps: int, tokenizer):
    LLM = _attr("LLM", "jaxserve.entrypoints.llm", "jaxserve.llm")
    from jaxserve.model.config import ModelConfig
    from jaxserve.model.decoder.decoder import random_params
    from jaxserve.model.loaders.weights import LoadedModel

    config = ModelConfig(**TINY)
    loaded = LoadedModel(config, random_params(config, seed=0, scale=0.08), tokenizer, "random")
    prefill = min(max(64, PROMPT_LEN * n), PREFILL_BUDGET)
    max_len = PROMPT_LEN + max_tokens(n, steps) + 14
    pages_each = -(-max_len // 16)
    return LLM("tiny", loaded=loaded, progress=False, max_num_seqs=n,
               max_num_batched_tokens=prefill, token_buckets=tuple(sorted({n, prefill})),
               seq_buckets=(n,), max_model_len=max_len, num_pages=n * pages_each + 2,
               enable_prefix_caching=False)


def _wrap_serial_wait(step, waits: list[float]):
    """An engine without phase timings: time the wait for each step's output after dispatch."""
    import jax

    run = step.run

    def timed_run(inputs):
        out = run(inputs)
        start = time.perf_counter()
        jax.block_until_ready(out[0] if isinstance(out, tuple) else out)
        waits.append(time.perf_counter() - start)
        return out
    step.run = timed_run


def _device_ms(step, inputs, repeats: int = 20) -> float:
    """The executable alone on one decode step's inputs, back to back (median ms)."""
    import jax

    times = []
    for _ in range(repeats + 2):
        start = time.perf_counter()
        out = step.run(inputs)
        jax.block_until_ready(out)
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times[2:])


def _attr(name: str, *modules: str):
    """`name` from the first of `modules` that the measured checkout has: the package's layout
    (and so a module's path) differs across the commits the probe measures. Only files of
    the imported jaxserve package count (an editable install elsewhere would mix commits)."""
    import jaxserve

    root = Path(jaxserve.__file__).parent
    for module in modules:
        path = root.joinpath(*module.split(".")[1:])
        if path.with_suffix(".py").is_file() or (path / "__init__.py").is_file():
            return getattr(importlib.import_module(module), name)
    raise ImportError(f"{name}: none of {modules} is in {root}")


def _frozen_heap(fallback):
    try:
        return _attr("frozen_heap", "jaxserve.engine.engine", "jaxserve.engine")
    except ImportError:
        return fallback


FLUSH_BYTES = 64 << 20  # twice this VM's L3 (32 MiB): nothing of the host's state survives


@contextlib.contextmanager
def _gc_frozen():
    """Where the engine has no frozen_heap: the freeze alone."""
    import gc

    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def host_only(n: int, steps: int, tokenizer, cold: bool = False) -> dict:
    """The same loop's host work with no device at all: scheduler, input layout, update with a
    fixed token, output processing (ms per step). cold: before each timed step (outside the
    timing) FLUSH_BYTES are read, evicting the host's objects from every cache, as a CPU step's
    compute does between the engine's host phases; the engine's own phases at 256 requests
    run about as long as these, the warm ones about 0.6x."""
    import gc

    import numpy as np

    from jaxserve.runner.buckets import BucketTable

    build_step_inputs = _attr("build_step_inputs", "jaxserve.runner.prepare_inputs",
                              "jaxserve.runner.batch")

    OutputProcessor = _attr("OutputProcessor", "jaxserve.engine.output_processor",
                            "jaxserve.output_processor")
    PageManager = _attr("PageManager", "jaxserve.core.page_manager", "jaxserve.page_manager")
    Request = _attr("Request", "jaxserve.core.request", "jaxserve.request")
    SamplingParams = _attr("SamplingParams", "jaxserve.core.request", "jaxserve.request")
    Scheduler = _attr("Scheduler", "jaxserve.core.scheduler", "jaxserve.scheduler")
    StepResult = _attr("StepResult", "jaxserve.core.plan", "jaxserve.runner.protocol")

    max_len = PROMPT_LEN + max_tokens(n, steps) + 14
    pages = PageManager(num_pages=n * (-(-max_len // 16)) + 2, page_size=16)
    prefill = min(max(64, PROMPT_LEN * n), PREFILL_BUDGET)
    as_engine = ({"decode_rows": True}  # as the engine's builder makes it, where it has it
                 if "decode_rows" in inspect.signature(Scheduler).parameters else {})
    sched = Scheduler(pages, max_num_seqs=n, max_num_batched_tokens=prefill,
                      max_model_len=max_len, **as_engine)
    finishes = len(inspect.signature(OutputProcessor).parameters) > 1  # (a callback, before)
    outputs = OutputProcessor(tokenizer, sched.finish) if finishes else OutputProcessor(tokenizer)
    takes_result = "result" in inspect.signature(sched.update).parameters
    params = SamplingParams(max_tokens=max_tokens(n, steps), temperature=0.0, ignore_eos=True)
    for i in range(n):
        request = Request(f"r{i}", [3 + (7 * i + j) % 250 for j in range(PROMPT_LEN)], params, 0)
        outputs.add([request])
        sched.add(request)
    table = BucketTable.build(prefill, n, max_len, 16, tuple(sorted({n, prefill})), (n,))
    takes = inspect.signature(build_step_inputs).parameters
    if "batch" in takes:  # the runner's persistent rows as one InputBatch
        InputBatch = _attr("InputBatch", "jaxserve.runner.input_batch")
        transient = (n,) if "max_num_rows" in inspect.signature(InputBatch).parameters else ()
        layout = {"batch": InputBatch(n, table.max_pages_per_request, *transient)}
    else:  # before it: the persistent rows, where the commit has them, one by one
        try:
            from jaxserve.runner.host_page_tables import HostPageTables
            layout = {"tables": HostPageTables(n + 1, table.max_pages_per_request)}
        except ImportError:
            layout = {}
        if "device_tables" in takes:  # as its runner
            layout = {"tables": HostPageTables(n + 1, table.max_pages_per_request, n),
                      "device_tables": True}
        if "samplers" in takes:
            from jaxserve.runner.host_sampling import HostSamplingRows
            layout["samplers"] = HostSamplingRows(n + 1 + n)
    if "layouts" in takes:  # one buffer per step
        layouts_for = _attr("layouts_for", "jaxserve.model.decoder.step_layout",
                            "jaxserve.step_layout")
        layout["layouts"] = layouts_for(table.shapes(), table.max_pages_per_request, 1)
    totals = dict.fromkeys(("schedule", "build", "update", "emit"), 0.0)
    flush = np.ones(FLUSH_BYTES if cold else 0, np.uint8)  # (ones: real pages, not the zero page)

    def one(record: bool) -> None:
        if record and cold:
            flush[::64].sum()  # a read of every cache line (clean: nothing to write back later)
        t0 = time.perf_counter()
        plan = sched.schedule()
        t1 = time.perf_counter()
        build_step_inputs(plan, table, 16, **layout)
        t2 = time.perf_counter()
        num_seqs = getattr(plan, "num_seqs", len(plan.chunks))
        tokens = np.full(num_seqs, 100, np.int32)
        logprobs = np.zeros(num_seqs, np.float32)
        events = sched.update(plan, *((StepResult(tokens, logprobs),) if takes_result
                                      else (tokens, logprobs)))
        t3 = time.perf_counter()
        outputs.process(events, lambda *_: None)
        t4 = time.perf_counter()
        if record:
            for name, dt in zip(totals, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
                totals[name] += dt

    while not all(r.output_token_ids for r in sched.requests.values()):
        one(False)  # the prefill steps
    gc.collect()
    # the heap freeze (and young-collection threshold) the engine's serving loops use
    with _frozen_heap(_gc_frozen)():
        for _ in range(steps):
            one(True)
    return {name: 1000 * t / steps for name, t in totals.items()}


def measure(n: int, steps: int) -> dict:
    import jax

    import jaxserve
    from jaxserve.model.loaders.loader import load_model
    SamplingParams = _attr("SamplingParams", "jaxserve.core.request", "jaxserve.request")
    tokenizer = load_model("default", progress=False).tokenizer
    llm = build_llm(n, steps, tokenizer)
    engine = llm.engine
    step = engine.runner.step
    captured = []
    run = step.run
    step.run = lambda inputs: (captured.append(inputs), run(inputs))[1]
    params = SamplingParams(max_tokens=max_tokens(n, steps), temperature=0.0, ignore_eos=True)
    ids = [engine.add_request([3 + (7 * i + j) % 250 for j in range(PROMPT_LEN)], params)
           for i in range(n)]
    waiting = set(ids)
    while waiting:  # prefill: until every request has its first token
        waiting -= {o.request_id for o in engine.step() if o.new_token_ids}
    timings = getattr(engine, "timings", None)
    waits: list[float] = []
    if timings is None:
        step.run = lambda inputs: (captured.append(inputs), run(inputs))[1]
        _wrap_serial_wait(step, waits)
    else:
        timings.reset()
    num_tokens, first_timed = 0, len(captured)
    with _frozen_heap(contextlib.nullcontext)():  # where the engine has it, as its loops
        start = time.perf_counter()
        for _ in range(steps):
            num_tokens += sum(len(o.new_token_ids) for o in engine.step())
        wall = time.perf_counter() - start
    result = {"n": n, "steps": steps, "prompt_len": PROMPT_LEN, "wall_ms": 1000 * wall / steps,
              "tokens_per_s": num_tokens / wall, "jaxserve_path": jaxserve.__file__,
              "backend": jax.default_backend()}
    if timings is not None:
        phases = timings.per_step_ms(steps)
        result["phases_ms"] = phases
        result["host_ms"] = sum(v for k, v in phases.items() if k != "wait")
    else:
        result["phases_ms"] = {"wait": 1000 * sum(waits) / steps}
        result["host_ms"] = result["wall_ms"] - result["phases_ms"]["wait"]
    # The step alone: the last timed step, replayed before the requests finish (a step taken
    # after them was the last of the drain, which with chunked prefill's staggered requests
    # holds one request, not N). The K/V the replays rewrite are of no further use here. First
    # every launched step is done: a replay on this thread beside a launch on the runner's
    # launcher thread would donate the same buffers.
    getattr(engine.runner, "wait", lambda: None)()
    step.run = run
    decode_inputs = [x for x in captured[first_timed:] if x.shape == (n, n)][-1]
    result["device_ms"] = _device_ms(step, decode_inputs)
    result["device_busy"] = min(1.0, result["device_ms"] / result["wall_ms"])
    while engine.has_unfinished():
        engine.step()
    llm.close()
    result["host_only_ms"] = host_only(n, steps, tokenizer)
    result["host_only_total_ms"] = sum(result["host_only_ms"].values())
    result["host_only_cold_ms"] = host_only(n, steps, tokenizer, cold=True)
    result["host_only_cold_total_ms"] = sum(result["host_only_cold_ms"].values())
    return result


if __name__ == "__main__":
    if len(sys.argv) > 3:
        PROMPT_LEN = int(sys.argv[3])
    print(json.dumps(measure(int(sys.argv[1]), int(sys.argv[2]))))
