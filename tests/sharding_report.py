"""How arrays are placed on a mesh, as plain JSON-able dicts: what the multi-device check scripts
(tests/tp_check.py, tests/ep_check.py) report from their subprocesses for the tests to read."""

from __future__ import annotations

import jax


def describe(array) -> dict:
    sharding = array.sharding
    return {"shape": list(array.shape), "spec": str(getattr(sharding, "spec", None)),
            "shard_shape": list(array.addressable_shards[0].data.shape),
            "devices": len(sharding.device_set),
            "replicated": bool(sharding.is_fully_replicated)}


def watched_shardings(state, watched) -> dict:
    """The leaves of an NNX state named in `watched`, layer 0's (or the stacked arrays) ->
    describe(leaf)."""
    found = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
        keys = [k.key for k in path if isinstance(k, jax.tree_util.DictKey)]
        if keys[-1] in watched and (len(keys) < 3 or keys[1] == 0):
            found[keys[-1]] = describe(leaf)
    return found
