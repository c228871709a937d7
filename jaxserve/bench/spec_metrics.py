"""Speculative-decoding figures for `jaxserve bench offline`: acceptance metrics of a run, and
`--compare-speculative`, the same requests with and without speculation, side by side.

Both engines are built first; then the runs alternate (off, on, off, on, ...) so that load from
elsewhere on the host hits both alike, and each mode reports its best round. It only drives
engines and reports; it changes nothing in how they run.
"""

from __future__ import annotations

import dataclasses

from jaxserve.spec.policy import SpecStats


def snapshot(engine) -> SpecStats | None:
    policy = engine.speculation.policy
    return None if policy is None else dataclasses.replace(policy.stats)


def metrics(engine, before: SpecStats | None) -> dict:
    """Acceptance figures of the run since `before` (empty without speculation)."""
    policy = engine.speculation.policy
    if policy is None:
        return {}
    now = policy.stats
    delta = SpecStats(**{f.name: getattr(now, f.name) - getattr(before, f.name)
                         for f in dataclasses.fields(SpecStats)})
    return {"speculative_method": policy.method,
            "num_speculative_tokens": policy.num_speculative_tokens,
            "verifications": delta.num_verifications,
            "draft_tokens": delta.num_draft_tokens,
            "accepted_tokens": delta.num_accepted_tokens,
            "acceptance_rate": delta.acceptance_rate,
            "mean_accepted_tokens_per_verification": delta.mean_accepted_tokens,
            "speculative_steps": delta.num_spec_steps,
            "steps_not_speculated_for_batch_size": delta.num_skipped_steps}


def print_metrics(result: dict) -> None:
    if "acceptance_rate" not in result:
        return
    print(f"  speculation     {result['speculative_method']} k={result['num_speculative_tokens']}:"
          f" acceptance {result['acceptance_rate']:.1%}, "
          f"{result['mean_accepted_tokens_per_verification']:.2f} accepted tokens per "
          f"verification ({result['verifications']} verifications, "
          f"{result['speculative_steps']} speculative steps, "
          f"{result['steps_not_speculated_for_batch_size']} steps off for batch size)")


def compare_speculative(config, loaded, requests, run_workload, print_run, *, rounds: int,
                        ignore_eos: bool, progress: bool) -> dict:
    """{'off': best run, 'on': best run, 'speculative_over_plain': tokens/s ratio}."""
    from jaxserve.engine.engine import Engine

    if config.speculative.speculative_method is None:
        raise ValueError("--compare-speculative needs --speculative-method (and "
                         "--num-speculative-tokens)")
    plain = config.replace(speculative_method=None, num_speculative_tokens=0,
                           speculative_draft=None)
    engines = {"off": Engine(plain, loaded=loaded, progress=progress),
               "on": Engine(config, loaded=loaded, progress=progress)}
    runs: dict[str, list[dict]] = {"off": [], "on": []}
    for _ in range(rounds):
        for mode, engine in engines.items():
            runs[mode].append(run_workload(engine, requests, ignore_eos=ignore_eos))
    best = {mode: max(rs, key=lambda r: r["output_throughput"]) for mode, rs in runs.items()}
    for mode, label in (("off", "without speculation"), ("on", "with speculation")):
        print_run(f"{label}, {len(requests)} requests, best of {rounds}", best[mode])
        print(f"  tokens/s rounds {[round(r['output_throughput'], 1) for r in runs[mode]]}")
    ratio = best["on"]["output_throughput"] / best["off"]["output_throughput"]
    same = best["on"]["total_output_tokens"] == best["off"]["total_output_tokens"]
    print(f"speculative / plain output tokens/s: {ratio:.2f}x"
          + ("" if same else "  (output token counts differ between the runs)"))
    return {"runs": runs, "best": best, "speculative_over_plain": ratio}
