"""Attention sinks under tensor parallelism on 2 fake CPU devices; run by
tests/test_attention_sinks.py in a subprocess (XLA_FLAGS must ask for the devices before jax
starts).

    python tests/tp_sinks_check.py OUT.json

Runs the XLA attention backend as the runner shards it (runner/tensor_parallel.py: each device
attends with its own query and KV heads under shard_map) on a mixed decode/prefill batch with
a distinct sink per query head, and writes to OUT.json the device count and the largest error
against the dense oracle and against the same backend on one device. It asserts nothing: the
test reads the JSON and does.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=2")
os.environ["JAX_PLATFORMS"] = "cpu"
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402  (after XLA_FLAGS)
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import test_decode_attention as xla_cases  # noqa: E402
from test_attention_sinks import draw_sinks, oracle  # noqa: E402
from jaxserve.model.decoder import sharding  # noqa: E402
from jaxserve.model.decoder.attention import AttentionShape, ReferenceAttention  # noqa: E402
from jaxserve.runner.tensor_parallel import _ShardedAttention  # noqa: E402

TP, GROUP, KV_HEADS = 2, 2, 2


def attend(backend, q, k, v, md, sinks, **kw):
    return np.asarray(jax.jit(lambda q, k, v, md, sinks: backend(
        q, k, v, jnp.int32(1), backend.prepare(md, q.shape[0]), sinks=sinks, **kw))(
        q, k, v, md, sinks))


def main(out_path: str) -> None:
    q_lens, kv_lens = [1, 1, 1, 5, 7], [9, 36, 2, 20, 7]
    rng = np.random.default_rng(12)
    q, k, v, md = xla_cases.batch(rng, q_lens, kv_lens, KV_HEADS, 16, group=GROUP)
    sinks = draw_sinks(rng, GROUP * KV_HEADS)
    kw = dict(sm_scale=xla_cases.HEAD_DIM ** -0.5, soft_cap=4.0)
    mesh = sharding.make_mesh(TP)
    per_device = AttentionShape(GROUP, KV_HEADS // TP, xla_cases.PAGE_SIZE)
    sharded = _ShardedAttention(ReferenceAttention(per_device, cpu_kernel=False), mesh)
    one = ReferenceAttention(AttentionShape(GROUP, KV_HEADS, xla_cases.PAGE_SIZE),
                             cpu_kernel=False)
    got = attend(sharded, q, k, v, md, sinks, **kw)
    live = sum(q_lens)
    want = oracle(q, k, v, 1, kv_lens, md.page_table, q_lens, sinks=sinks, **kw)
    alone = attend(one, q, k, v, md, sinks, **kw)
    report = {"devices": int(mesh.devices.size),
              "error_vs_oracle": float(np.abs(got[:live] - want[:live]).max()),
              "error_vs_one_device": float(np.abs(got - alone).max())}
    Path(out_path).write_text(json.dumps(report))


if __name__ == "__main__":
    main(sys.argv[1])
