"""The two forms of the batched LoRA delta (model/decoder/lora.py), measured against the base
model's
projections alone on the CPU.

    python scripts/lora_matmul_options.py [--rows 1,16,256] [--rank 16] [--max-loras 4]
        [--repeats 10] [--json scripts/bench_results/lora_matmul_options.json]

SmolLM2-135M's shapes (hidden 576, intermediate 1536, 9 / 3 heads of 64, 30 layers), float32,
layers unrolled with their own base weights as the CPU engine runs them: every layer's seven
projections (q, k, v, o, gate, up, down) chained as a decoder layer chains them (o after q,
down after gate * up, the residual carried, RMS-normalized per layer). Options, each one jitted
function of (x [T, 576], row slots [T], weights): `base` (the projections alone), `gather` and
`masked` (the same plus every projection's adapter delta, model/decoder/lora.py, from max_loras
slots
of rank R held per layer as the engine holds them; rows spread over slots 0..max_loras, slot 0
the base model), and `masked_stacked` (the masked form with each target's slots stacked over
layers, [L, in, N * R], and sliced per layer). Every round calls every option once, in turn,
so load on the shared machine hits all alike; medians over `repeats` rounds. It prints each
option's time and the LoRA options' cost over `base`; the choice it informs is
model/decoder/lora.py's
choose_form and lora/device.py's layout.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from jaxserve.model.decoder.lora import LoRAStacks, StepAdapters, layer_weights  # noqa: E402

D, F, Q, KV, L = 576, 1536, 576, 192, 30
PROJ = {"wq": (D, Q), "wk": (D, KV), "wv": (D, KV), "wo": (Q, D), "w_gate": (D, F),
        "w_up": (D, F), "w_down": (F, D)}
OPTIONS = ("base", "gather", "masked", "masked_stacked")


def forward(x, slots, base, stacks, form):
    """Every layer's projections, chained; form None: no adapters."""
    adapters = None if form is None else StepAdapters(stacks, slots, x.dtype, form=form)
    for i, w in enumerate(base):
        x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-5)
        lw = layer_weights(stacks, i)

        def proj(h, key):
            y = h @ w[key]
            return y if adapters is None else adapters.add(y, h, lw, key)

        q, k, v = proj(x, "wq"), proj(x, "wk"), proj(x, "wv")
        attn = q + jnp.tile(k + v, (1, Q // KV))  # stands in for attention: [T, Q]
        x = x + proj(attn, "wo")
        x = x + proj(jax.nn.silu(proj(x, "w_gate")) * proj(x, "w_up"), "w_down")
    return x


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,16,256")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--max-loras", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    n, r = args.max_loras, args.rank
    base = [{k: jnp.asarray(0.03 * rng.standard_normal(shape), jnp.float32)
             for k, shape in PROJ.items()} for _ in range(L)]
    stacked = {k: (0.03 * rng.standard_normal((L, i, n * r)).astype(np.float32),
                   0.03 * rng.standard_normal((L, n * r, o)).astype(np.float32))
               for k, (i, o) in PROJ.items()}
    per_layer = LoRAStacks({k: (tuple(jnp.asarray(x) for x in a), tuple(jnp.asarray(x) for x in b))
                            for k, (a, b) in stacked.items()}, n)
    as_stacked = LoRAStacks({k: (jnp.asarray(a), jnp.asarray(b))
                             for k, (a, b) in stacked.items()}, n)
    weights = {"base": per_layer, "gather": per_layer, "masked": per_layer,
               "masked_stacked": as_stacked}
    forms = {"base": None, "gather": "gather", "masked": "masked", "masked_stacked": "masked"}
    fns = {name: jax.jit(lambda x, slots, base, stacks, form=forms[name]:
                         forward(x, slots, base, stacks, form)) for name in OPTIONS}
    results = {}
    for t in (int(v) for v in args.rows.split(",")):
        x = jnp.asarray(rng.standard_normal((t, D)), jnp.float32)
        slots = jnp.asarray(np.arange(t) % (n + 1), jnp.int32)
        outs = {name: fn(x, slots, base, weights[name]).block_until_ready()
                for name, fn in fns.items()}  # compile, and check the forms agree
        for name in ("gather", "masked_stacked"):
            np.testing.assert_allclose(np.asarray(outs[name]), np.asarray(outs["masked"]),
                                       rtol=1e-3, atol=1e-3)
        times = {name: [] for name in OPTIONS}
        for _ in range(args.repeats):
            for name, fn in fns.items():
                start = time.perf_counter()
                fn(x, slots, base, weights[name]).block_until_ready()
                times[name].append(time.perf_counter() - start)
        med = {name: statistics.median(v) * 1e3 for name, v in times.items()}
        results[t] = med
        print(f"T={t:4d}: " + ", ".join(f"{n} {med[n]:.2f} ms" for n in OPTIONS)
              + "; LoRA cost over base: " + ", ".join(
                  f"{n} +{med[n] - med['base']:.2f} ms ({med[n] / med['base']:.2f}x)"
                  for n in OPTIONS[1:]), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"rank": r, "max_loras": args.max_loras, "repeats": args.repeats,
             "backend": jax.default_backend(),
             "median_ms": {str(t): v for t, v in results.items()}}, indent=2))


if __name__ == "__main__":
    main()
