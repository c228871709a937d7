"""Joining a JAX cluster for multi-host serving: the flags, jax.distributed.initialize, and the
main loop of the processes that follow process 0.

`--coordinator-address HOST:PORT --num-processes N --process-id I` join an explicit cluster;
`--distributed auto` lets JAX find it in the environment (Cloud TPU VM metadata,
TPU_WORKER_HOSTNAMES on GKE, SLURM, Open MPI). Joining must happen before anything touches a
JAX backend, so the CLI does it first. Process 0 then runs the command itself (scheduler, gRPC
server, benchmark); every other process runs `follow`: the same Engine, executing process 0's
plans (runner/multihost.py) until process 0's engine closes. This module holds no
serving logic and never decides shardings.
"""

from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ClusterSettings:
    coordinator_address: str | None = None  # "host:port" of process 0's coordinator service
    num_processes: int | None = None
    process_id: int | None = None
    auto: bool = False                      # let JAX detect the cluster from the environment

    @property
    def enabled(self) -> bool:
        return self.auto or self.coordinator_address is not None

    def validate(self) -> "ClusterSettings":
        explicit = (self.coordinator_address, self.num_processes, self.process_id)
        if any(v is not None for v in explicit) and any(v is None for v in explicit):
            raise ValueError("--coordinator-address, --num-processes and --process-id go "
                             f"together; got {explicit}")
        if self.num_processes is not None and not 0 <= self.process_id < self.num_processes:
            raise ValueError(f"process_id={self.process_id} must be in [0, num_processes="
                             f"{self.num_processes})")
        return self


def add_distributed_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("multi-host (one JAX process per host)")
    group.add_argument("--distributed", choices=("off", "auto"), default="off",
                       help="auto: join the cluster JAX detects (Cloud TPU VM slices, GKE, "
                            "SLURM); off unless the three flags below are given")
    group.add_argument("--coordinator-address", default=None,
                       help="host:port of process 0's JAX coordinator")
    group.add_argument("--num-processes", type=int, default=None,
                       help="JAX processes in the cluster, one per host")
    group.add_argument("--process-id", type=int, default=None,
                       help="this process's index in [0, --num-processes); 0 schedules")


def settings_from_args(args: argparse.Namespace) -> ClusterSettings:
    return ClusterSettings(getattr(args, "coordinator_address", None),
                           getattr(args, "num_processes", None),
                           getattr(args, "process_id", None),
                           getattr(args, "distributed", "off") == "auto").validate()


def join_cluster(settings: ClusterSettings) -> bool:
    """jax.distributed.initialize when configured; True when this job has several processes."""
    if not settings.enabled:
        return False
    import jax

    if settings.auto:
        jax.distributed.initialize()
    else:
        jax.distributed.initialize(settings.coordinator_address, settings.num_processes,
                                   settings.process_id)
    log.info("joined a JAX cluster: process %d of %d, %d local / %d global devices",
             jax.process_index(), jax.process_count(), jax.local_device_count(),
             jax.device_count())
    return jax.process_count() > 1


def is_leader() -> bool:
    import jax
    return jax.process_index() == 0


def follow(engine_config, loaded=None) -> int:
    """A non-zero process's whole job: build the Engine process 0 builds, run its plans until
    it stops. Returns the exit code."""
    import jax

    from jaxserve.engine.engine import Engine

    engine = Engine(engine_config, loaded=loaded, progress=False)
    log.info("process %d: engine ready, following process 0", jax.process_index())
    num_plans = engine.runner.follow()
    log.info("process %d: process 0 stopped after %d plans", jax.process_index(), num_plans)
    return 0

