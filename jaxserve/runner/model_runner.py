"""ModelRunner: owns every device array of a plain step (weights, KV pages, host swap copies,
the logits processors' state, the InputBatch's per-slot page tables and last tokens, the
resident LoRA adapters' stacks: lora/device.py, written before the step whose plan loads them,
or NoAdapters when the engine serves none: the step is then compiled without them).

It turns a StepPlan into StepInputs laid out in one buffer (runner/prepare_inputs.py, which
updates the persistent InputBatch (runner/input_batch.py) from the plan; step_layout.py)
and one call of its CompiledStep (unpack -> forward -> logits processors -> grammar bitmasks ->
sample, KV and processor state donated),
and returns plain numpy results: execute(plan) at once, or dispatch(plan) now and collect() its
results later (async scheduling: the device runs it while the host plans the next step; a row
whose token is still on the device reads it from the InputBatch's LastTokens). Dispatched steps are launched
in order by a StepLauncher (runner/launcher.py): from the engine's thread when XLA will only
queue the step, else from a launcher thread, so the engine's thread never sits in a step that
XLA runs inline. Every (tokens, requests)
bucket is compiled ahead of time; a shape outside the table raises instead of compiling. It
never decides what runs: that is the scheduler's job. runner/protocol.py declares what every
runner (plain, speculative, multi-host leader / follower) offers the engine.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
from concurrent.futures import Future
from contextlib import nullcontext

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve.model.device import select as device_select
from jaxserve.model.quant import kv as kv_quant
from jaxserve.model.quant import qlinear
from jaxserve.model.quant import cache as quant_cache
from jaxserve.model.quant import measure as quant_measure
from jaxserve.model.quant import select as quant_select
from jaxserve.model.decoder.attention import resolve_attention_impl
from jaxserve.model.config import ModelConfig
from jaxserve.core.plan import StepPlan
from jaxserve.runner import input_batch, kv_calibration, logits_processors, packed_inputs
from jaxserve.runner.buckets import BucketTable
from jaxserve.runner.compiled_step import CompiledStep
from jaxserve.runner.input_batch import InputBatch
from jaxserve.runner.prepare_inputs import build_step_inputs
from jaxserve.runner.grammar_mask import maybe_apply_bitmask
from jaxserve.runner.kv_cache import DeviceKV
from jaxserve.runner.launcher import StepLauncher
from jaxserve.runner.logits_processors import ProcessorState
from jaxserve.runner.protocol import StepResult
from jaxserve.runner.sampler import prompt_logprobs, sample, top_logprobs
from jaxserve.runner.tensor_parallel import Placement
from jaxserve.model.decoder.lora import Adapters
from jaxserve.model.decoder.step_layout import PackedStepInputs, layouts_for
from jaxserve.lora.device import DeviceLoRA, NoAdapters

log = logging.getLogger(__name__)


def resolve_dtype(dtype: str, backend: str):
    """"auto" -> the dtype for the first device of `backend` (model/device/select.py), logged
    once with the reason; an explicit one the device can't run natively is a ValueError."""
    device = device_select.DeviceDescription.current(backend)
    chosen = device_select.select(dtype=dtype, device=device)
    device_select.log_choice("dtype", chosen.dtype, chosen.dtype_reason, device)
    return {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}[chosen.dtype]


def resolve_layer_loop(layer_loop: str, backend: str) -> str:
    # Measured on the 2-core CPU: unrolled layers beat scan's per-layer weight slices.
    if layer_loop == "auto":
        return "unroll" if backend == "cpu" else "scan"
    return layer_loop


def compile_cache_path(cache_dir: str | None) -> str | None:
    """The persistent compile cache directory a runner given `cache_dir` uses (None: off)."""
    if cache_dir == "":
        return None
    if jax.config.jax_compilation_cache_dir:
        return jax.config.jax_compilation_cache_dir  # someone (a test, the user) chose one
    return cache_dir or os.path.join(os.path.expanduser("~"), ".cache", "jaxserve", "xla")


def quantized_cache_dir(cache_dir: str | None) -> str | None:
    """Where weights quantized at load are kept (model/quant/cache.py): beside the compiled
    steps, in the compile cache directory; None when that cache is off."""
    path = compile_cache_path(cache_dir)
    return None if path is None else os.path.join(path, quant_cache.SUBDIR)


def enable_compile_cache(cache_dir: str | None) -> None:
    if cache_dir == "" or jax.config.jax_compilation_cache_dir:
        return  # off, or someone (a test, the user) already chose one
    cache_dir = compile_cache_path(cache_dir)
    os.makedirs(cache_dir, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", cache_dir)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


def pack(tokens, logprobs, top=None):
    """One packed i32 array -> one device-to-host copy per step: [2, S] (tokens, logprob bits),
    or with top = (ids, logprobs) [S, K]: [2, S, 1 + K] (the sampled token first)."""
    if top is not None:
        tokens = jnp.concatenate([tokens[:, None], top[0]], axis=1)
        logprobs = jnp.concatenate([logprobs[:, None], top[1]], axis=1)
    return jnp.stack([tokens, jax.lax.bitcast_convert_type(logprobs, jnp.int32)])


def unpack(packed: np.ndarray, num_chunks: int, with_top: bool = False) -> StepResult:
    """with_top: packed is pack(..., top) of a plain step; else [2, S, ...] rows as they are."""
    tokens, logprobs = packed[0, :num_chunks], packed[1, :num_chunks].view(np.float32)
    if not with_top:
        return StepResult(tokens.copy(), logprobs.copy())
    return StepResult(tokens[:, 0].copy(), logprobs[:, 0].copy(), tokens[:, 1:].copy(),
                      logprobs[:, 1:].copy())


def plain_step(graphdef, attention, bucket_forms, state, kv, inputs: PackedStepInputs):
    """unpack (step_layout.py) -> forward -> logits processors -> sample (+ top-k logprobs, +
    prompt logprobs). kv: (KV pages, processor state, last tokens and page tables by slot:
    input_batch.py, the LoRA stacks: lora/device.py, read only, or None: no adapters).
    bucket_forms: ((T, the MatmulForm measured for token bucket T), ...); a bucket not in it
    keeps the model's form. Returns ((packed [2, S, 1 + K] i32, prompt [2, T, 1 + K] i32), kv);
    the prompt part is fetched only by steps that asked for it."""
    inputs = packed_inputs.unpack(inputs)
    with qlinear.matmul_form(dict(bucket_forms).get(inputs.model.token_ids.shape[0])):
        return _plain_step(graphdef, attention, state, kv, inputs)


def _plain_step(graphdef, attention, state, kv, inputs):
    kv_pages, processors, last_tokens, tables, stacks = kv
    tables, page_table = input_batch.apply_table_updates(tables, inputs.tables)
    inputs = dataclasses.replace(inputs, attention=dataclasses.replace(
        inputs.attention, page_table=page_table))
    model = nnx.merge(graphdef, state)
    rows = dataclasses.replace(inputs.model, token_ids=input_batch.feed_tokens(
        inputs.model.token_ids, inputs.model.token_slots, last_tokens))
    logits, kv_pages, hidden = model(rows, inputs.attention, kv_pages, attention,
                                     return_hidden=True,
                                     adapters=Adapters.of(stacks, rows.adapter_slots))
    sp = inputs.sampling
    logits = logits_processors.apply_if_any(logits, sp, processors)
    logits = maybe_apply_bitmask(logits, sp.grammar_bitmask, sp.has_grammar, sp.any_grammar)
    tokens, logprobs = sample(logits, sp)
    processors = logits_processors.record_if_any(processors, sp, tokens)
    last_tokens = input_batch.record_tokens(last_tokens, sp.sample_slots, tokens)
    packed = pack(tokens, logprobs, top_logprobs(logits, sp))
    prompt_ids, prompt_lps = prompt_logprobs(model, hidden, sp)
    prompt = jnp.stack([prompt_ids, jax.lax.bitcast_convert_type(prompt_lps, jnp.int32)])
    return (packed, prompt), (kv_pages, processors, last_tokens, tables, stacks)


@dataclasses.dataclass
class PendingStep:
    """A dispatched plain step whose results the host has not read yet."""
    num_chunks: int
    launched: Future | None = None  # -> (packed, prompt) device arrays; None: no rows
    with_prompt: bool = False       # the step reports prompt logprobs


class ModelRunner:
    """The plain step's runner: dispatch lays the plan out and hands it to the launcher thread
    and returns at once (can_overlap); collect reads the step's packed results."""

    can_overlap = True
    timings = None  # a StepTimings (the engine's), or None

    def __init__(self, model_config: ModelConfig, params: dict[str, np.ndarray], *,
                 num_pages: int, page_size: int, max_model_len: int, max_num_seqs: int,
                 max_num_batched_tokens: int, dtype: str = "auto",
                 attention_impl: str = "auto", layer_loop: str = "auto",
                 int8_activations: str = "auto", dequant_form: str = "auto",
                 token_buckets=None, seq_buckets=None, compile_cache_dir: str | None = None,
                 mesh=None, host_prefix_slots: int = 0, max_loras: int = 0,
                 max_lora_rank: int = 16, lora_registry=None, kv_cache_dtype: str = "auto",
                 kv_scales=None, kv_calibration_tokens: list[int] | None = None):
        """mesh: a ("tp",) jax Mesh to shard weights, KV pages and the step over (None: one
        device); see runner/tensor_parallel.py. host_prefix_slots: pages of the prefix cache's
        host tier (runner/host_prefix_pool.py) each cache of this runner keeps. max_loras > 0:
        that many LoRA adapters resident at once, of rank up to max_lora_rank
        (lora/device.py), read from lora_registry (lora/registry.py) as plans load them.
        kv_cache_dtype: the KV pages' dtype (model/quant/kv.py; auto: dtype's); kv_scales:
        [2, L] k_scale and v_scale per layer for fp8 pages (None: 1.0); kv_calibration_tokens:
        fp8 pages take their scales from one prefill of these tokens instead
        (runner/kv_calibration.py; None: kv_scales)."""
        backend = jax.default_backend()
        enable_compile_cache(compile_cache_dir)
        self.model_config = model_config
        self.dtype = resolve_dtype(dtype, backend)
        self.kv_dtype = kv_quant.resolve(kv_cache_dtype, self.dtype)
        self.layer_loop = resolve_layer_loop(layer_loop, backend)
        self.quant_form = quant_select.select(int8_activations, dequant_form).form
        # measured at warm-up where int8_activations is "auto" (measure_bucket_forms)
        self._measure_forms = int8_activations == "auto"
        self.bucket_forms: dict[int, str] = {}  # token bucket -> quant_bucket_forms name
        self._bucket_form_table: tuple = ()     # ((T, MatmulForm), ...) the step is traced with
        self._compile_cache_dir = compile_cache_dir
        # The device alone refuses an impl here, before the weights load; "auto" is resolved
        # with the model's attention shape by placement.attention (model/device/kernel_fit.py).
        resolve_attention_impl(attention_impl, backend, dtype, log=False)
        self.attention_impl = attention_impl
        self.page_size = page_size
        self.num_pages = num_pages
        self.mesh = mesh
        self.host_prefix_slots = host_prefix_slots
        self.buckets = BucketTable.build(max_num_batched_tokens, max_num_seqs, max_model_len,
                                         page_size, token_buckets, seq_buckets)
        self.placement = Placement(mesh, model_config)
        self.graphdef, state = self.placement.model(params, self.dtype, self.layer_loop,
                                                    kv_scales, self.quant_form)
        if kv_calibration_tokens is not None and kv_quant.is_fp8(self.kv_dtype):
            amax = kv_calibration.calibration_amax(self.graphdef, state, self.placement,
                                                   kv_calibration_tokens, page_size, self.dtype)
            kv_scales = kv_calibration.scales_from_amax(amax, self.kv_dtype)
            state = kv_calibration.with_kv_scales(state, kv_scales)
        self.kv_scales = kv_scales  # [2, L] as served by fp8 pages (None: 1.0)
        self.cache = self.new_cache(self.placement)
        self.processors = ProcessorState(max_num_seqs + 1, model_config.vocab_size,
                                         self.placement.replicated)
        p = self.buckets.max_pages_per_request
        self.input_batch = InputBatch(max_num_seqs, p, self.placement.replicated)
        self._launcher = StepLauncher()
        self.attention = self.placement.attention(self.attention_impl, page_size, self.dtype,
                                                  self.kv_dtype)
        self.mask_words = -(-model_config.vocab_size // 32)  # grammar bitmask words per row
        self._unused_bitmasks: dict[tuple[int, int], jax.Array] = {}
        self.lora_registry = lora_registry
        self.adapters = (DeviceLoRA(model_config, max_loras, max_lora_rank, self.dtype,
                                    self.placement, per_layer=self.layer_loop == "unroll")
                         if max_loras else NoAdapters())
        self.layouts = layouts_for(self.buckets.shapes(), p, self.mask_words)
        self.step = self._compiled_step(state)

    def _compiled_step(self, state) -> CompiledStep:
        step = functools.partial(plain_step, self.graphdef, self.attention,
                                 self._bucket_form_table)
        caches = (self.cache, self.processors, self.input_batch.last_tokens,
                  self.input_batch.device_tables, self.adapters)
        return CompiledStep("step", step, state, caches,
                            self.buckets, lambda shape: self.layouts[shape].new(),
                            **self.placement.jit_shardings(
                                processor_state=True, adapters=(self.adapters.shardings,)))

    def profile_step_memory(self):
        """(the largest bucket, its step compiled, not kept): its memory_analysis() is what
        one step needs beside the weights and the KV pool (engine/memory_profile.py's
        StepMemory.of reads it)."""
        shape = max(self.buckets.shapes())
        return shape, self.step.compile_only(shape)

    def resize_kv_pool(self, num_pages: int) -> None:
        """A new zeroed pool of num_pages (before warm-up: start-up sizes the pool after
        profile_step_memory ran against a small one); the old pool is released first."""
        if self.step._executables:
            raise RuntimeError("resize_kv_pool must run before warmup()")
        self.cache.arrays = None
        self.num_pages = num_pages
        self.cache = self.new_cache(self.placement)
        self.step = self._compiled_step(self.step.state)

    def _place_unused_bitmasks(self) -> None:
        """A device-resident [S, W] bitmask per bucket, for steps without grammars, placed
        where the bucket's executable wants it (after compiling, before serving)."""
        for shape in self.buckets.shapes():
            sharding = self.step.input_shardings(shape).grammar_bitmask
            zeros = np.zeros((shape[1], self.mask_words), np.int32)
            self._unused_bitmasks[shape] = jax.device_put(zeros, sharding)

    def new_cache(self, placement: Placement) -> DeviceKV:
        """A zeroed KV cache for placement's model over this runner's page pool."""
        arrays = placement.kv_cache(self.num_pages, self.page_size, self.kv_dtype)
        return DeviceKV(arrays, self.buckets.max_pages_per_request, self.host_prefix_slots)

    def rollout_memory(self):
        """A RunnerMemory over this runner (one JAX process: the verbs run here alone)."""
        if jax.process_count() > 1:
            raise NotImplementedError(
                f"weight updates, sleep and wake_up are not supported with several JAX "
                f"processes ({jax.process_count()}) yet")
        from jaxserve.runner.rollout_memory import RunnerMemory
        return RunnerMemory(self)

    @property
    def state(self):
        return self.step.state

    @property
    def kv(self):
        return self.cache.arrays

    @property
    def num_host_swapped(self) -> int:
        return self.cache.num_host_swapped

    def measure_bucket_forms(self) -> None:
        """On one CPU device, for per-channel int8 weights under int8_activations "auto": the
        fastest int8 form of each token bucket, measured here or read from beside the compile
        cache (model/quant/measure.py), logged; the step is rebuilt to use them (before any
        bucket is compiled). Elsewhere nothing changes."""
        if (not self._measure_forms or jax.default_backend() != "cpu" or self.mesh is not None
                or jax.device_count() != 1 or self.step._executables):
            return
        model = nnx.merge(self.graphdef, self.state)
        if not quant_measure.has_per_channel_int8(model):
            return
        cache = compile_cache_path(self._compile_cache_dir)
        forms, self.bucket_forms, line = quant_measure.bucket_forms(
            model, self.buckets.shapes(), self.quant_form, cache, self.dtype)
        log.info("%s", line)
        self._bucket_form_table = tuple(sorted(forms.items()))
        self.step = self._compiled_step(self.step.state)

    def warmup(self, progress: bool = True) -> None:
        self.measure_bucket_forms()
        self.step.warmup(progress)
        self._place_unused_bitmasks()
        self.cache.warmup()
        self.processors.warmup()
        self.input_batch.warmup()
        self.adapters.warmup()

    def wait(self) -> None:
        self._launcher.drain()  # every launched step has its arrays
        arrays = jax.tree.leaves((self.state, self.kv, self.processors.arrays,
                                  self.input_batch.arrays))
        # (asleep, engine/rollout.py: the weights and KV pages are deleted buffers)
        jax.block_until_ready([a for a in arrays if not a.is_deleted()])

    def close(self) -> None:
        self._launcher.shutdown()

    def _phase(self, name: str):
        return nullcontext() if self.timings is None else self.timings.phase(name)

    def execute(self, plan: StepPlan) -> StepResult:
        return self.collect(self.dispatch(plan))

    def dispatch(self, plan: StepPlan) -> PendingStep:
        """Lay the plan out as inputs, hand it to the launcher and return at once."""
        with self._phase("build"):
            inputs, unsent = None, None
            self.input_batch.rows.release(plan)  # (a plan without rows frees rows too)
            if plan.num_seqs:
                inputs = build_step_inputs(plan, self.buckets, self.page_size,
                                           mask_words=self.mask_words, batch=self.input_batch,
                                           layouts=self.layouts)
                if inputs.grammar_bitmask is None:  # no grammar: no [S, W] bitmask to upload
                    inputs.grammar_bitmask = self._unused_bitmasks[inputs.shape]
                # more changed rows than the step carries: written before it
                unsent = self.input_batch.unsent_table_rows(
                    len(inputs.views.tables.update_slots))
        with self._phase("dispatch"):
            launched = self._launcher.submit(self._launch, plan, inputs, unsent)
        if inputs is None:
            launched.result()  # swaps only: done before the next plan is laid out
            return PendingStep(0)
        return PendingStep(plan.num_seqs, launched,
                           bool(inputs.views.sampling.any_prompt_logprobs))

    def _launch(self, plan: StepPlan, inputs: PackedStepInputs | None, unsent_rows=None):
        """On the launcher thread: the plan's swaps, processor fills and page-table rows the
        step does not carry, then its step."""
        self.cache.apply_swaps(plan)
        self.adapters.apply_loads(plan.lora_loads, self.lora_registry)
        self.processors.apply_inits(plan)
        self.input_batch.write_unsent(unsent_rows)
        return None if inputs is None else self.step.run(inputs)

    def collect(self, pending: PendingStep) -> StepResult:
        """The dispatched step's results on the host (blocks until the device has them)."""
        if pending.launched is None:
            return StepResult(np.zeros(0, np.int32), np.zeros(0, np.float32))
        with self._phase("wait"):
            packed, prompt = pending.launched.result()
            packed = np.asarray(packed)
            prompt = np.asarray(prompt) if pending.with_prompt else None
        result = unpack(packed, pending.num_chunks, with_top=True)
        if prompt is not None:
            result.prompt_ids, result.prompt_logprobs = prompt[0], prompt[1].view(np.float32)
        return result
