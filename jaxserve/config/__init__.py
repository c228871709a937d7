"""The engine's settings: EngineConfig (engine.py) holds one frozen group per concern
(groups.py: model, cache, scheduler, parallel, speculative, runner; lora.py: LoRA adapters),
each field documented with `setting()` (settings.py), which the CLI's help and docs/cli.md's
table are made from.
SecurityConfig (security.py) holds the servers' API keys and TLS files, outside EngineConfig.

Plain data and validation only: no jax import, no defaults that depend on the device.
"""

from jaxserve.config.engine import GROUPS, EngineConfig, Setting
from jaxserve.config.security import ENV_API_KEY, SecurityConfig, parse_api_keys
from jaxserve.config.groups import (CacheConfig, ModelSettings, ParallelConfig, RunnerConfig,
                                    SchedulerConfig, SpeculativeConfig)
from jaxserve.config.lora import LoRAConfig
from jaxserve.config.settings import (BATCHING_MODES, CPU_KERNEL_MODES, DTYPES, LAYER_LOOPS,
                                      PREEMPTION_MODES, QUANTIZATIONS, SIZE_UNITS,
                                      SPECULATIVE_METHODS, parse_size, setting)

__all__ = ["EngineConfig", "GROUPS", "Setting", "ModelSettings", "CacheConfig",
           "SchedulerConfig", "ParallelConfig", "SpeculativeConfig", "RunnerConfig", "LoRAConfig",
           "parse_size", "setting", "SecurityConfig", "ENV_API_KEY", "parse_api_keys",
           "BATCHING_MODES", "CPU_KERNEL_MODES", "DTYPES", "LAYER_LOOPS", "PREEMPTION_MODES",
           "QUANTIZATIONS", "SIZE_UNITS", "SPECULATIVE_METHODS"]
