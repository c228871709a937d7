"""The settings that are refused together: every start-up refusal of a pair of features, each
error naming both settings (docs/compatibility.md is the whole matrix, checked by
tests/test_compatibility_matrix.py).

* check_engine: pairs the EngineConfig alone decides (EngineConfig.validate calls it);
* check_processes: pairs with several JAX processes (multi-host), at engine build;
* check_data_parallel: pairs with data_parallel_size > 1, before the server or its ranks
  start.
Refusals that only a request or a call can meet stay where they are met: tool_choice with
another output constraint (entrypoints/openai/tools.py), and sleep / wake_up / update_weights
on a speculative engine (runner/protocol.py's rollout_refusal).

Plain data checks: no jax import, no state.
"""

from __future__ import annotations


def check_engine(config) -> None:
    """Refuse setting pairs no engine can run (config: an EngineConfig)."""
    if config.lora.enable_lora and config.speculative.speculative_method == "draft":
        raise ValueError("enable_lora=True is invalid with speculative_method='draft': a "
                         "draft model has no adapter slots (speculative_method='ngram' "
                         "works with adapters)")


def check_processes(num_processes: int, *, host_prefix_cache_size: int = 0,
                    enable_lora: bool = False) -> None:
    """Refuse what several JAX processes (multi-host) cannot hold."""
    if num_processes <= 1:
        return
    size = host_prefix_cache_size
    if size:
        raise ValueError(f"host_prefix_cache_size={size} is not supported with several JAX "
                         f"processes ({num_processes}): each holds only its shard of the KV")
    if enable_lora:
        raise ValueError(f"enable_lora is not supported with several JAX processes "
                         f"({num_processes}) yet: each would need every adapter")


def check_data_parallel(num_ranks: int, *, enable_lora: bool = False, multi_host: bool = False,
                        rollout_endpoints: bool = False) -> None:
    """Refuse what data_parallel_size > 1 cannot run: multi_host, the --distributed flags are
    set; rollout_endpoints, the HTTP server's /sleep, /wake_up, /update_weights, /pause."""
    if num_ranks <= 1:
        return
    if multi_host:
        raise ValueError("--data-parallel-size > 1 runs on one host: it cannot be combined "
                         "with the multi-host --distributed flags")
    if enable_lora:
        raise ValueError("data_parallel_size > 1 is not supported with enable_lora yet: "
                         "each rank would need every adapter, loaded and unloaded together")
    if rollout_endpoints:
        raise ValueError("enable_rollout_endpoints is not supported with data_parallel_size "
                         f"{num_ranks}: sleep, wake_up and weight updates run on one engine")
