"""The suite's speculative-decoding A/B: n-gram speculation on vs off, same server settings.

Workload: the speculative helper's bundled `repeat` prompts (answers that mostly copy the
prompt, where n-gram drafts can hit), as token ids through the chat template, ending at EOS,
served at low concurrency (speculation buys latency when the batch is small). When the engine
cannot speculate (jaxserve.spec missing, or EngineConfig rejecting the method) the scenario
says "not available" and why, instead of a number.
"""

from __future__ import annotations

from jaxserve.bench import scenarios as sc
from jaxserve.bench.datasets import ServeRequest

SPEC = dict(speculative_method="ngram", num_speculative_tokens=4)


def spec_requests(tokenizer, num_requests: int, output_len: int) -> list[ServeRequest]:
    from jaxserve.bench.spec_workload import repeat_workload
    return [ServeRequest(r.max_tokens, prompt_token_ids=tuple(r.prompt_token_ids))
            for r in repeat_workload(tokenizer, num_requests, output_len)]


def unavailable(loaded) -> str | None:
    try:
        spec_requests(loaded.tokenizer, 1, 4)
        from jaxserve.config import EngineConfig
        EngineConfig.from_kwargs(**{**sc.BASE, **SPEC})
    except Exception as exc:  # ImportError, a rejected setting: either way, not available
        return f"{type(exc).__name__}: {exc}"
    return None


def serve_spec(served, requests, max_concurrency: int) -> dict:
    from jaxserve.bench import spec_metrics as spec_bench

    before = spec_bench.snapshot(served.engine)
    result = served.serve(requests, ignore_eos=False, max_concurrency=max_concurrency)
    result.update(spec_bench.metrics(served.engine, before))
    return result


def run_speculative_ab(loaded, requests, base, max_concurrency: int, log) -> dict:
    """A: base (a BASE engine, serving), B: the same settings plus SPEC, back to back."""
    reason = unavailable(loaded)
    if reason is not None:
        log(f"speculative decoding: not available ({reason})")
        return {"available": False, "reason": reason}
    engine = sc.build_engine(loaded, sc.BASE, **SPEC)
    if getattr(getattr(engine, "speculation", None), "policy", None) is None:
        sc.release(engine)
        return {"available": False, "reason": "the engine built without a speculation policy"}
    log(f"speculative decoding engine up in {engine.startup_s:.0f} s")
    startup_s, on = engine.startup_s, sc.Served(engine)
    runs = {}
    for label, served in (("off", base), ("on", on)):
        log(f"speculative decoding: {label}")
        runs[label] = serve_spec(served, requests, max_concurrency)
    on.close()
    return {"available": True, "settings": SPEC, "max_concurrency": max_concurrency,
            "startup_s": startup_s, "runs": runs}
