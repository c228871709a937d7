"""A toy policy-gradient loop in one process: jaxserve generates the rollouts, Optax trains, and
the new weights go back into the engine with update_weights every step (docs/rollouts.md).

    python scripts/rl_loop_example.py            # the default model (SmolLM2-135M), CPU: minutes
    python scripts/rl_loop_example.py --tiny     # a tiny random model (tests/test_rl_example.py)

The reward is the fraction of a completion's tokens that equal one token (the commonest in the
first step's samples), with REINFORCE and the batch's mean reward as baseline. Each step: sample a batch (temperature 1, logprobs=0),
sleep the engine (its KV pool, and its weights, leave the device while the trainer works), take
one Adam step on the engine's own state pytree with a teacher-forced forward of the engine's own
model, wake it up and swap the new weights in. Prints the mean reward of each step; the
trainer's logprobs of the sampled tokens are checked against the engine's on the first step.
Not a benchmark: a demonstration that the pieces fit.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from jaxserve import SamplingParams  # noqa: E402
from jaxserve.entrypoints.llm import LLM  # noqa: E402
from jaxserve.model.cpu import ffi as cpu_ffi  # noqa: E402
from jaxserve.model.decoder.decoder import init_kv_cache  # noqa: E402
from jaxserve.model.decoder.step_inputs import AttentionMetadata, ModelInputs  # noqa: E402

PAGE_SIZE = 16


class CausalAttention:
    """Dense causal attention over B sequences of L tokens each (the trainer's batch), read from
    the pages the layer has just written; differentiable, unlike the serving paths (their
    kernels and loops have no gradients). No sliding window, soft-cap or sinks (SmolLM2 has
    none)."""

    def __init__(self, batch: int, length: int, table: np.ndarray, group: int):
        self.batch, self.length, self.table, self.group = batch, length, jnp.asarray(table), group

    def prepare(self, metadata, num_tokens: int):
        return None

    def __call__(self, q, k_pages, v_pages, layer, prepared, *, sm_scale=None, **unused):
        b, n = self.batch, self.length
        def gather(pages):  # [B, L, Hkv, Dh] -> [B, L, Hq, Dh]
            x = pages[layer][self.table].reshape(b, -1, *pages.shape[3:])[:, :n]
            return jnp.repeat(x, self.group, axis=2)
        q = q.reshape(b, n, -1, q.shape[-1])  # [B, L, Hq, Dh]
        scale = q.shape[-1] ** -0.5 if sm_scale is None else sm_scale
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, gather(k_pages)).astype(jnp.float32) * scale
        causal = jnp.tril(jnp.ones((n, n), bool))
        probs = jax.nn.softmax(jnp.where(causal, scores, -jnp.inf), axis=-1)
        out = jnp.einsum("bhqk,bkhd->bqhd", probs.astype(q.dtype), gather(v_pages))
        return out.reshape(b * n, *out.shape[2:])


def make_logprob_fn(llm: LLM, batch: int, length: int):
    """logprob_fn(state, tokens [B, L]) -> [B, L - 1]: each next token's logprob under the
    engine's own model (its graph and weights layout; dense causal attention), one step."""
    runner = llm.engine.runner
    config, graphdef = runner.model_config, runner.graphdef
    pages_per_seq = -(-length // PAGE_SIZE)
    num_pages = 1 + pages_per_seq * batch
    table = np.arange(1, num_pages, dtype=np.int32).reshape(batch, pages_per_seq)
    pos = np.tile(np.arange(length, dtype=np.int32), batch)  # [B * L]
    slots = (table[np.repeat(np.arange(batch), length), pos // PAGE_SIZE] * PAGE_SIZE
             + pos % PAGE_SIZE).astype(np.int32)
    metadata = AttentionMetadata(*map(jnp.asarray, (
        np.arange(0, batch * length + 1, length, dtype=np.int32),
        np.full(batch, length, np.int32), table, np.int32(batch), np.int32(0))))
    attention = CausalAttention(batch, length, table, config.num_heads // config.num_kv_heads)
    dtype = runner.dtype

    @jax.jit
    def logprob_fn(state, tokens):
        model = nnx.merge(graphdef, state)
        inputs = ModelInputs(tokens.reshape(-1), jnp.asarray(pos), jnp.asarray(slots),
                             jnp.arange(batch * length, dtype=jnp.int32))
        kv = init_kv_cache(config, num_pages, PAGE_SIZE, dtype)
        with cpu_ffi.using(cpu_ffi.KernelSettings(mode="off")):  # XLA's ops: differentiable
            logits, _ = model(inputs, metadata, kv, attention)  # [B * L, V]
        logp = jax.nn.log_softmax(logits.reshape(batch, length, -1)[:, :-1], axis=-1)
        return jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]

    return logprob_fn


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="a tiny random model (seconds)")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--learning-rate", type=float, default=None)
    args = parser.parse_args(argv)
    if args.tiny:
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
        from tiny_models import tiny_loaded
        llm = LLM(loaded=tiny_loaded(0), progress=False, max_num_seqs=16, page_size=PAGE_SIZE,
                  max_num_batched_tokens=128, max_model_len=128, num_pages=64,
                  token_buckets=(16, 128), seq_buckets=(16,))
        prompt = [5, 9, 13, 17]
        steps, lr = args.steps or 8, args.learning_rate or 3e-2
    else:
        llm = LLM(progress=False, max_num_seqs=16, max_num_batched_tokens=128,
                  max_model_len=256, dtype="float32")
        prompt = llm.tokenizer.encode("Write one word, many times:")
        steps, lr = args.steps or 6, args.learning_rate or 2e-4
    target = None  # the rewarded token: the commonest of the first step's samples
    length = len(prompt) + args.max_tokens
    logprob_fn = make_logprob_fn(llm, args.batch, length)
    state = llm.get_weights()  # the trainer's copy, in the engine's own layout
    optimizer = optax.adam(lr)
    opt_state = optimizer.init(state)

    def loss_fn(state, tokens, advantages):
        logp = logprob_fn(state, tokens)[:, len(prompt) - 1:]  # the completion's tokens
        return -jnp.mean(advantages[:, None] * logp)

    grad_fn = jax.jit(jax.grad(loss_fn))
    rewards = []
    for step in range(steps):
        params = [SamplingParams(temperature=1.0, seed=step * 1000 + i, logprobs=0,
                                 max_tokens=args.max_tokens, ignore_eos=True)
                  for i in range(args.batch)]
        outs = llm.generate([prompt] * args.batch, params, use_tqdm=False)
        completions = np.asarray([o.token_ids for o in outs], np.int32)
        if target is None:
            target = int(np.bincount(completions.reshape(-1)).argmax())
        reward = (completions == target).mean(axis=1)
        rewards.append(float(reward.mean()))
        print(f"step {step}: mean reward {reward.mean():.3f} (weight version "
              f"{outs[0].weight_version})", flush=True)
        tokens = jnp.asarray(np.concatenate([np.tile(prompt, (args.batch, 1)), completions], 1))
        if step == 0:  # the trainer's logprobs are the engine's (docs/rollouts.md)
            engine_lp = np.asarray([o.logprobs for o in outs])
            trainer_lp = np.asarray(logprob_fn(state, tokens))[:, len(prompt) - 1:]
            print(f"max |engine - trainer| logprob: {np.abs(engine_lp - trainer_lp).max():.2e}")
        llm.sleep(level=1)  # the KV pool and the engine's weights leave the device
        advantages = jnp.asarray(reward - reward.mean(), jnp.float32)
        updates, opt_state = optimizer.update(grad_fn(state, tokens, advantages), opt_state)
        state = optax.apply_updates(state, updates)
        llm.wake_up(tags=["kv_cache"])
        llm.update_weights(state)  # the new policy: on the device, no compilation
    print("rewards:", " ".join(f"{r:.3f}" for r in rewards))
    llm.close()
    return 0 if rewards[-1] > rewards[0] else 1


if __name__ == "__main__":
    sys.exit(main())
