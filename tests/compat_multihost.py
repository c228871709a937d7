"""The compatibility matrix's multi-host runs: one covering configuration
(compat_table.MH_COVERING) on a two-process JAX cluster on this host, one CPU device each and
tensor parallelism across the two, as `jaxserve serve --coordinator-address ... --num-processes
2` runs it: process 0 schedules and serves compat_engines.EngineRun's requests through LLM (its
runner a LeaderRunner), process 1 follows its plans (entrypoints/distributed.follow).
tests/compat_engines.py starts both with `MultiHostRun` and reads process 0's results; no
assertion here.

    python tests/compat_multihost.py DIRS_JSON COORDINATOR PROCESS_ID INDEX OUT.json
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

NUM_PROCESSES = 2
TIMEOUT_S = 900


class MultiHostRun:
    """compat_engines' run interface (run, close, failures) over the two processes."""

    def __init__(self, config: dict, dirs: dict, oracle=None):
        import compat_table

        self.config, self.dirs, self.failures = config, dirs, []
        self.index = compat_table.MH_COVERING.index(config)

    def run(self) -> dict:
        with tempfile.TemporaryDirectory() as tmp:
            dirs_json, out = Path(tmp) / "dirs.json", Path(tmp) / "out.json"
            dirs_json.write_text(json.dumps({k: str(v) for k, v in self.dirs.items()}))
            from scale_out_fixtures import free_port

            address = f"127.0.0.1:{free_port()}"
            env = dict(os.environ, JAX_PLATFORMS="cpu",
                       XLA_FLAGS="--xla_force_host_platform_device_count=1")
            procs = [subprocess.Popen(
                [sys.executable, __file__, str(dirs_json), address, str(i), str(self.index),
                 str(out)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                text=True) for i in range(NUM_PROCESSES)]
            logs = []
            for proc in procs:
                try:
                    logs.append(proc.communicate(timeout=TIMEOUT_S)[1])
                except subprocess.TimeoutExpired:
                    proc.kill()
                    logs.append(proc.communicate()[1] + f"\n(killed after {TIMEOUT_S} s)")
            codes = [p.returncode for p in procs]
            if codes != [0] * NUM_PROCESSES or not out.exists():
                self.failures.append(f"the cluster's processes exited with {codes}:\n" + "\n".join(
                    f"--- process {i}:\n{log[-3000:]}" for i, log in enumerate(logs)))
                return {"config": self.config, "failures": self.failures}
            return json.loads(out.read_text())

    def close(self) -> None:
        """Both processes have exited when run returns."""


def main(dirs_json: str, address: str, process_id: int, index: int, out_path: str) -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import conftest  # noqa: F401  (the persistent compilation cache, before jax starts)
    import compat_table
    from compat_engines import OneEngineRun, engine_settings

    from jaxserve.entrypoints import distributed

    config = compat_table.MH_COVERING[index]
    dirs = {k: Path(v) for k, v in json.loads(Path(dirs_json).read_text()).items()}
    distributed.join_cluster(distributed.ClusterSettings(address, NUM_PROCESSES, process_id))
    if not distributed.is_leader():
        from jaxserve.config import EngineConfig
        return distributed.follow(EngineConfig.from_kwargs(model=str(dirs[config["model"]]),
                                                           **engine_settings(config)))
    import torch

    import compat_oracle

    torch.set_num_threads(1)
    oracle = compat_oracle.Oracle(dirs, config["model"], config["weights"], config["kv"], False)
    run = OneEngineRun(config, dirs, oracle)
    try:
        result = run.run()
    finally:
        run.close()  # the follower stops with the leader's engine
    Path(out_path).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]))
