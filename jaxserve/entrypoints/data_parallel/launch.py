"""Starting the data-parallel rank processes: which CPU cores and devices each rank gets, and
the spawn itself. Nothing here talks to a rank after it started (client.py does).

CPU cores: this process's CPU set (os.sched_getaffinity) split into num_ranks contiguous
shares, the remainder to the first ranks; with fewer cores than ranks, each rank gets one core,
ranks sharing them round-robin. A rank sets its CPU set before jax builds its CPU backend, and
XLA sizes its compute thread pool from the cores a process may run on, so each rank gets its
own XLA threads on its own cores (and its host loop runs on them too).

Devices: rank r sees devices [r * d, (r + 1) * d) of those this process sees, d =
tensor_parallel_size, through CUDA_VISIBLE_DEVICES (taken from this process's value when set).
TPU chips are not partitioned here (a TPU host's chips belong to one process unless
TPU_VISIBLE_CHIPS and its bounds are set: not done, not tested).
"""

from __future__ import annotations

import logging
import multiprocessing
import os

from jaxserve.entrypoints.data_parallel.rank import rank_main


def cpu_shares(cpus: list[int], num_ranks: int) -> list[list[int]]:
    """Each rank's CPU cores (see the module docstring)."""
    cpus = sorted(cpus)
    if len(cpus) < num_ranks:
        return [[cpus[r % len(cpus)]] for r in range(num_ranks)]
    base, extra = divmod(len(cpus), num_ranks)
    shares, start = [], 0
    for r in range(num_ranks):
        size = base + (r < extra)
        shares.append(cpus[start:start + size])
        start += size
    return shares


def device_environment(rank: int, devices_per_rank: int,
                       visible: str | None = None) -> dict[str, str]:
    """The environment that gives rank its own accelerator devices."""
    ids = ([d.strip() for d in visible.split(",") if d.strip()] if visible
           else [str(d) for d in range((rank + 1) * devices_per_rank)])
    mine = ids[rank * devices_per_rank:(rank + 1) * devices_per_rank]
    if len(mine) < devices_per_rank:
        raise ValueError(f"data_parallel_size: rank {rank} needs {devices_per_rank} device(s) "
                         f"of CUDA_VISIBLE_DEVICES={visible!r}, which has {len(ids)}")
    return {"CUDA_VISIBLE_DEVICES": ",".join(mine)}


def start_ranks(config, num_ranks: int, in_addresses: list[str], out_address: str,
                served_model_name: str | None = None) -> list:
    """Spawn the ranks (multiprocessing Process objects, started); served_model_name: the
    name their vllm:* metrics give as model_name (None: the model's own)."""
    context = multiprocessing.get_context("spawn")
    shares = cpu_shares(list(os.sched_getaffinity(0)), num_ranks)
    level = logging.getLevelName(logging.getLogger().getEffectiveLevel())
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    processes = []
    for rank in range(num_ranks):
        env = device_environment(rank, config.parallel.tensor_parallel_size, visible)
        proc = context.Process(
            target=rank_main, name=f"jaxserve-dp-rank-{rank}",
            args=(rank, config, in_addresses[rank], out_address, shares[rank], env, level,
                  served_model_name))
        proc.start()
        processes.append(proc)
    return processes
