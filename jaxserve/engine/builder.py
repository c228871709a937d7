"""build_engine: everything an Engine runs on, wired from an EngineConfig in one place.

Loading (sharded straight into the tensor-parallel mesh), the speculation settings, the KV page
pool's size, the page manager, host swap space, scheduler and batching policy, the runner (plain
or speculative, warmed up, then wrapped for multi-host) and the frozen EngineInfo. The Engine
only runs the loop over these parts; tests can build parts of their own. Nothing here runs a
step or touches a request.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass

from jaxserve.config import CacheConfig, EngineConfig, compatibility
from jaxserve.engine import device_memory, memory_profile
from jaxserve.engine.phases import phase
from jaxserve.engine.info import EngineInfo
from jaxserve.config.kv_events import parse_kv_events_config
from jaxserve.core.host_prefix_tier import HostPrefixTier
from jaxserve.core.kv_events import KVEventLog
from jaxserve.core.page_manager import PageManager
from jaxserve.core.scheduler import Scheduler
from jaxserve.core.sliding_window import reusable_window
from jaxserve.core.swap_space import HostSwapSpace

log = logging.getLogger(__name__)
DEFAULT_KV_CACHE_MEMORY = 1 << 30


@dataclass
class EngineParts:
    config: EngineConfig          # validated
    model_config: object          # ModelConfig
    tokenizer: object
    max_model_len: int
    dtype_name: str
    mesh: object                  # a ("tp",) or ("ep", "tp") Mesh, or None on one device
    speculation: object           # spec.setup.Speculation
    pages: PageManager
    scheduler: Scheduler
    runner: object                # runner.protocol.Runner
    info: EngineInfo
    lora_registry: object = None  # lora.registry.LoRARegistry (None: enable_lora off)


def size_page_pool(config: EngineConfig, kv_bytes_per_token: int, max_model_len: int,
                   page_bytes: int | None = None) -> int:
    """Pages for the KV pool: given directly, or from kv_cache_memory's byte budget (page 0
    included). page_bytes: one page as the devices lay it out (device_memory.kv_page_bytes;
    default page_size x kv_bytes_per_token, unpadded). gpu_memory_utilization's pool is sized
    after profiling (memory_profile.py)."""
    cache = config.cache
    if cache.num_pages is not None:
        return cache.num_pages
    page_bytes = page_bytes or cache.page_size * kv_bytes_per_token
    budget = cache.kv_cache_memory
    if budget is None:  # enough for every sequence at full length, within a default budget
        budget = min(DEFAULT_KV_CACHE_MEMORY, config.scheduler.max_num_seqs
                     * (max_model_len + cache.page_size) * page_bytes // cache.page_size)
    num_pages = budget // page_bytes
    if num_pages < 2:
        raise ValueError(f"kv_cache_memory={budget} bytes holds {num_pages} pages of "
                         f"{cache.page_size} tokens; at least 2 are needed")
    return int(num_pages)


def host_prefix_tier(cache: CacheConfig, bytes_per_page: int,
                     num_processes: int) -> HostPrefixTier | None:
    """The prefix cache's host tier from host_prefix_cache_size (None when 0). Its bytes and
    swap_space's follow one rule (whole pages of bytes_per_page), and together they must fit
    the host's memory."""
    size = cache.host_prefix_cache_size
    if size == 0:
        return None
    compatibility.check_processes(num_processes, host_prefix_cache_size=size)
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if size + cache.swap_space > total:
        raise ValueError(f"host_prefix_cache_size={size} plus swap_space={cache.swap_space} "
                         f"bytes exceed this host's memory ({total} bytes)")
    tier = HostPrefixTier(size, bytes_per_page)
    if tier.num_slots == 0:
        raise ValueError(f"host_prefix_cache_size={size} bytes holds no page of "
                         f"{bytes_per_page} bytes; give at least that, or 0 for no host tier")
    log.info("prefix cache host tier: %d pages, %.1f MiB", tier.num_slots,
             tier.num_slots * bytes_per_page / 2**20)
    return tier


def lora_adapters(config: EngineConfig, model_config, num_processes: int):
    """The host's LoRA adapters (lora/registry.py), lora_modules read (ids 1, 2, ... in
    order; a bad adapter is a ValueError before anything compiles); None: enable_lora off."""
    lora = config.lora
    if not lora.enable_lora:
        return None
    compatibility.check_processes(num_processes, enable_lora=True)
    from jaxserve.lora.registry import LoRARegistry
    from jaxserve.lora.request import LoRARequest

    registry = LoRARegistry(model_config, lora.max_lora_rank, lora.num_cpu_loras)
    # every module is read (and checked) once here; past max_cpu_loras the least recently
    # used are dropped from host memory again and read back when a request names them
    for lora_id, (name, path) in enumerate(lora.modules(), 1):
        registry.queued(registry.resolve(LoRARequest(name, lora_id, path)))
    log.info("LoRA: up to %d adapters on the device, %d in host memory, rank <= %d; read at "
             "start: %s", lora.max_loras, lora.num_cpu_loras, lora.max_lora_rank,
             ", ".join(r.lora_name for r in registry.requests) or "none")
    return registry


def device_page_bytes(model_config, speculation, page_size: int, kv_dtype, devices) -> int:
    """One KV page of the target's (and a separate draft's) layers over `devices`, as they lay
    it out: heads split over the devices, tile-padded on a TPU (device_memory.kv_page_bytes)."""
    platform = device_memory.platform_of(devices[0])
    configs = [model_config]
    if speculation.draft is not None and not speculation.draft[2]:
        configs.append(speculation.draft[0])
    return sum(device_memory.kv_page_bytes(
        c.num_layers, page_size, device_memory.heads_per_device(c.num_kv_heads, len(devices)),
        c.head_dim, kv_dtype, platform, len(devices)) for c in configs)


def check_scalar_memory(model_config, config: EngineConfig, max_model_len: int, dtype,
                        device) -> None:
    """On a TPU running the Pallas kernels: refuse, before anything compiles, a max_num_seqs
    and max_model_len whose page table does not fit the kernels' scalar memory
    (device_memory.check_tpu_scalar_memory)."""
    from jaxserve.model.device.select import DeviceDescription, select
    from jaxserve.runner.buckets import BucketTable
    from pallas_kernels import tuning

    description = DeviceDescription.from_device(device)
    run, sched, cache = config.runner, config.scheduler, config.cache
    if description.platform != "tpu" or select(attention_impl=run.attention_impl, dtype=dtype,
                                                device=description).attention_impl != "pallas":
        return
    buckets = BucketTable.build(sched.max_num_batched_tokens, sched.max_num_seqs, max_model_len,
                                cache.page_size, run.token_buckets, run.seq_buckets)
    sizes = tuning.block_sizes("tpu")
    group = model_config.num_heads // model_config.num_kv_heads
    device_memory.check_tpu_scalar_memory(
        buckets.shapes(), buckets.max_pages_per_request, cache.page_size, max_model_len,
        sched.max_num_seqs, tuning.tokens_per_block(group, sizes.q_block_rows),
        sizes.max_kv_splits)


def with_device_defaults(config: EngineConfig, device) -> EngineConfig:
    """config with the per-device defaults (model/device/defaults.py) for what the user left
    unset on `device` (a jax Device), each choice logged with its reason."""
    from jaxserve.model.device import defaults as device_defaults
    from jaxserve.model.device import select as device_select

    description = device_select.DeviceDescription.from_device(device)
    config, choices = device_defaults.apply(config, description,
                                            memory_profile.device_memory_bytes(device))
    for choice in choices:
        device_select.log_choice(choice.field, str(choice.value), choice.reason, description)
    return config


def make_scheduler(config: EngineConfig, pages: PageManager, swap: HostSwapSpace,
                   max_model_len: int, speculation, model_config, lora_registry) -> Scheduler:
    """The scheduler over the page pool, with the speculation, sliding-window and LoRA seams
    the engine's parts need."""
    sched = config.scheduler
    # Pages no layer of the target (nor of a draft sharing its page tables) can see again
    # go back to the pool as requests advance: only when every layer has a sliding window.
    draft_windows = () if speculation.draft is None else (speculation.draft[0].layer_windows,)
    return Scheduler(
        pages, max_num_seqs=sched.max_num_seqs,
        max_num_batched_tokens=sched.max_num_batched_tokens, max_model_len=max_model_len,
        preemption_mode=sched.preemption_mode, enable_chunked_prefill=sched.enable_chunked_prefill,
        batching=sched.batching, swap_space=swap, speculation=speculation.policy,
        kv_window=reusable_window(model_config.layer_windows, *draft_windows),
        # steady decoders as plan.DecodeRows: ModelRunner's plain steps lay them out (the
        # speculative runner and static batching's padding read chunks)
        decode_rows=speculation.policy is None and sched.batching == "continuous",
        max_loras=config.lora.max_loras if lora_registry is not None else 0)


def build_engine(config: EngineConfig, loaded=None, progress: bool = True) -> EngineParts:
    """loaded: a LoadedModel (None: load config.model.model). Compiles every step before
    returning."""
    import jax

    from jaxserve.model.cpu import ffi as cpu_ffi
    from jaxserve.model.loaders import hub_cache
    from jaxserve.model.quant import kv as kv_quant
    from jaxserve.model.quant import select as quant_select
    from jaxserve.model.decoder.sharding import flat_mesh, make_mesh, parallel_sizes
    from jaxserve.runner import kv_calibration, multihost, tensor_parallel
    from jaxserve.runner.buckets import powers_of_two
    from jaxserve.runner.cpu_threads import lower_xla_cpu_threads
    from jaxserve.runner.model_runner import ModelRunner, quantized_cache_dir, resolve_dtype
    from jaxserve.spec.setup import Speculation
    from jaxserve.model.loaders.loader import quantize
    from jaxserve.model.quant.formats import report

    config = config.validate()
    # after the device defaults a fraction always reads as set: whether the user gave it decides
    # between a warning and an error when XLA's allocator holds less than it asks
    fraction_given = config.is_explicit("gpu_memory_utilization")
    config = with_device_defaults(config, jax.local_devices()[0])
    model, cache, sched, run = config.model, config.cache, config.scheduler, config.runner
    start = time.perf_counter()
    parallel = config.parallel
    # None: one device, unsharded; 2-D ("ep", "tp") with expert parallelism
    mesh = make_mesh(parallel.tensor_parallel_size, parallel.expert_parallel_groups)
    # int8 activations multiply per-channel int8 only: then every source's int8 is per channel
    per_channel = quant_select.select(run.int8_activations,
                                      run.dequant_form).form.int8_activations
    if loaded is None:  # a checkpoint is restored straight into the mesh's shardings
        with phase(log, f"loading model {model.model!r} on {jax.default_backend()}"):
            loaded = tensor_parallel.load_model(
                hub_cache.with_revision(model.model, model.revision), mesh,
                progress=progress, quantization=model.quantization,
                int8_per_channel=per_channel, cache_dir=quantized_cache_dir(
                    run.compile_cache_dir) if model.cache_quantized_weights else None)
    # a float LoadedModel given by the caller
    loaded = quantize(loaded, model.quantization, per_channel)
    loaded_s = time.perf_counter() - start
    mc = loaded.config
    if parallel.enable_expert_parallel and not mc.num_experts:  # as vLLM: ignored, said once
        log.warning("enable_expert_parallel is ignored: %s has no experts (a dense model); "
                    "its weights are tensor-parallel over %d device(s)", mc.name,
                    parallel.tensor_parallel_size)
        mesh = None if mesh is None else flat_mesh(mesh)  # a checkpoint's shards stay put
    max_model_len = model.max_model_len or min(mc.max_position_embeddings, 2048)
    if mc.max_exact_len is not None and model.max_model_len is None:
        max_model_len = min(max_model_len, mc.max_exact_len)  # where RoPE is exact
    mc.check_runnable(max_model_len)  # a longer max_model_len than that is refused
    dtype = resolve_dtype(model.dtype, jax.default_backend())
    speculation = Speculation.build(config, loaded, progress=progress)
    kv_dtype = kv_quant.resolve(cache.kv_cache_dtype, dtype)  # the pool counts its bytes
    itemsize = jax.numpy.dtype(kv_dtype).itemsize
    kv_per_token = mc.kv_bytes_per_token(itemsize) + speculation.draft_kv_bytes_per_token(itemsize)
    devices = list(mesh.devices.flat) if mesh is not None else jax.local_devices()[:1]
    local = memory_profile.local_devices(devices, jax.process_index())
    page_bytes = device_page_bytes(mc, speculation, cache.page_size, kv_dtype, devices)
    check_scalar_memory(mc, config, max_model_len, model.dtype, local[0])
    profile = (cache.gpu_memory_utilization is not None
               and memory_profile.memory_stats(local[0]) is not None)
    if cache.gpu_memory_utilization is not None and not profile:
        log.warning("gpu_memory_utilization=%s is ignored on the %s backend (no device "
                    "memory figures): set kv_cache_memory for the KV pool's size",
                    cache.gpu_memory_utilization, jax.default_backend())
    # profiling: the runner starts on a 2-page pool and gets its real one once the largest
    # step's memory is known
    num_pages = 2 if profile else size_page_pool(config, kv_per_token, max_model_len,
                                                  page_bytes)
    lora_registry = lora_adapters(config, mc, jax.process_count())
    checkpoint_scales = getattr(loaded, "kv_scales", None)
    calibration = (kv_calibration.calibration_tokens(loaded.tokenizer, max_model_len)
                   if kv_calibration.wanted(cache.calculate_kv_scales, kv_dtype,
                                            checkpoint_scales) else None)
    tier = host_prefix_tier(cache, cache.page_size * kv_per_token, jax.process_count())
    events = (KVEventLog(cache.page_size)
              if parse_kv_events_config(cache.kv_events_config).enabled else None)
    max_pages = -(-max_model_len // cache.page_size)
    # The steps are traced inside `using`: where the CPU kernels are built, and whether.
    kernels = cpu_ffi.KernelSettings(run.cpu_kernels, run.cpu_kernel_cache_dir,
                                     run.cpu_kernel_compiler)
    with cpu_ffi.using(kernels):
        base = ModelRunner(
            mc, loaded.params, num_pages=num_pages, page_size=cache.page_size,
            max_model_len=max_model_len, max_num_seqs=sched.max_num_seqs,
            max_num_batched_tokens=sched.max_num_batched_tokens, dtype=model.dtype,
            attention_impl=run.attention_impl, layer_loop=run.layer_loop,
            int8_activations=run.int8_activations, dequant_form=run.dequant_form,
            token_buckets=run.token_buckets, seq_buckets=run.seq_buckets,
            compile_cache_dir=run.compile_cache_dir, mesh=mesh,
            host_prefix_slots=0 if tier is None else tier.num_slots,
            max_loras=config.lora.max_loras if lora_registry is not None else 0,
            max_lora_rank=config.lora.max_lora_rank, lora_registry=lora_registry,
            kv_cache_dtype=cache.kv_cache_dtype, kv_scales=checkpoint_scales,
            kv_calibration_tokens=calibration)
        if profile:
            with phase(log, "memory profile: compile the largest bucket, size the KV pool"):
                plan = memory_profile.plan_pool(
                    cache.gpu_memory_utilization, local,
                    memory_profile.StepMemory.of(*base.profile_step_memory()),
                    page_bytes, cache.page_size, max_model_len, num_devices=len(devices),
                    strict=fraction_given)
            num_pages = memory_profile.agree_across_processes(plan.num_pages)
            log.info("%s", plan.describe())
            base.resize_kv_pool(num_pages)
        log.info("KV cache: %d pages x %d tokens = %d tokens, %.1f MiB of %s", num_pages - 1,
                 cache.page_size, (num_pages - 1) * cache.page_size,
                 num_pages * page_bytes / 2**20, kv_quant.describe(
                     kv_dtype, base.kv_scales, calibrated=calibration is not None))
        pages = PageManager(num_pages, cache.page_size, cache.enable_prefix_caching,
                            host_tier=tier, events=events)
        swap = HostSwapSpace(cache.swap_space, cache.page_size * kv_per_token,
                             page_buckets=powers_of_two(1, max_pages))
        scheduler = make_scheduler(config, pages, swap, max_model_len, speculation, mc,
                                   lora_registry)
        runner = speculation.wrap(base)
        with phase(log, "warm-up: trace, compile (or read the compile cache) and run every "
                        "step bucket"):
            runner.warmup(progress=progress)
    if jax.default_backend() == "cpu":  # the host loop keeps a core beside XLA's threads
        lower_xla_cpu_threads(run.xla_cpu_nice)
    # Several JAX processes: process 0 broadcasts each plan, the others follow it.
    runner = multihost.for_this_process(runner)
    dtype_name = jax.numpy.dtype(dtype).name
    weight_bytes, weight_formats = report(loaded.params, dtype)
    if any(fmt != dtype_name for _, fmt, _ in weight_formats):  # some weights are quantized
        quant_select.resolve(run.int8_activations, run.dequant_form)  # logged with reasons
    log.info("weights on device: %.1f MiB; %s", weight_bytes / 2**20, "; ".join(
        f"{group} {fmt} {size / 2**20:.1f} MiB" for group, fmt, size in weight_formats))
    info = EngineInfo(
        model_name=mc.name, architecture=mc.architecture, max_model_len=max_model_len,
        vocab_size=mc.vocab_size, dtype=dtype_name, page_size=cache.page_size,
        num_pages=num_pages, max_num_seqs=sched.max_num_seqs,
        max_num_batched_tokens=sched.max_num_batched_tokens,
        max_queued_requests=sched.max_queued_requests,
        eos_token_ids=tuple(int(t) for t in loaded.tokenizer.eos_token_ids),
        tensor_parallel_size=config.parallel.tensor_parallel_size,
        expert_parallel_size=1 if mesh is None else parallel_sizes(mesh)[1],
        speculative_method=config.speculative.speculative_method,
        quantization=model.quantization,
        weight_bytes=weight_bytes, weight_formats=weight_formats,
        quant_bucket_forms=tuple(sorted(getattr(base, "bucket_forms", {}).items())))
    total = time.perf_counter() - start
    log.info("engine ready in %.1f s: model %.1f s, page pool + warm-up %.1f s", total,
             loaded_s, total - loaded_s)
    return EngineParts(config, mc, loaded.tokenizer, max_model_len, dtype_name, mesh, speculation,
                       pages, scheduler, runner, info, lora_registry)
