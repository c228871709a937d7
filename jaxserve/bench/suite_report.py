"""The benchmark suite's report: target checks and report.md from the suite's results dict.

Formatting only: every figure comes from the results of the run it describes.
"""

from __future__ import annotations

import math
from pathlib import Path


def _ms(seconds) -> str:
    return "-" if seconds is None or not math.isfinite(seconds) else f"{seconds * 1e3:,.0f}"


def _x(ratio) -> str:
    return "-" if ratio is None or not math.isfinite(ratio) else f"{ratio:.2f}x"


def _ratio(a, b):
    try:
        return a / b if b else None
    except TypeError:
        return None


def _burst(runs: list[dict]) -> dict | None:
    """The run with every request at t=0 (rate inf), if the sweep has one."""
    return next((r for r in runs if str(r["request_rate"]) == "inf"
                 or (isinstance(r["request_rate"], float) and math.isinf(r["request_rate"]))),
                None)


def _row(name: str, metric: str, a: float, b: float, lower_is_better: bool) -> dict:
    """A headline row: A, B and B's gain (B/A for rates, A/B for latencies)."""
    latency = metric.endswith("(ms)")
    show = _ms if latency else (lambda v: f"{v:.1f}")
    return dict(name=name, metric=metric, a=show(a), b=show(b),
                gain=_ratio(a, b) if lower_is_better else _ratio(b, a))


def headline(results: dict) -> list[dict]:
    """One row per A/B measurement; the gain is B's improvement over A (>1: B is better)."""
    s, sc, rows = results["scenarios"], results["scale"], []
    tput = lambda r: r["output_throughput"]  # noqa: E731
    sweeps = s["batching"]["sweeps"]
    if len(sweeps) == 2 and _burst(sweeps["continuous"]) and _burst(sweeps["static"]):
        name = "static vs continuous batching"
        rows.append(_row(name, "output tok/s, all at t=0", tput(_burst(sweeps["static"])),
                         tput(_burst(sweeps["continuous"])), False))
        at = {k: next((r for r in v if r["request_rate"] == sc["latency_rate"]), None)
              for k, v in sweeps.items()}
        if all(at.values()):
            rows.append(_row(name, f"p99 TTFT at {sc['latency_rate']:g} req/s (ms)",
                             at["static"]["ttft_s"]["p99"], at["continuous"]["ttft_s"]["p99"],
                             True))
    p = s["prefix_caching"]
    if len(p["rate"]) == 2:
        rows.append(_row("prefix caching off vs on", f"mean TTFT at {sc['prefix_rate']} req/s "
                         "(ms)", p["rate"]["off"]["ttft_s"]["mean"],
                         p["rate"]["on"]["ttft_s"]["mean"], True))
    if len(p["burst"]) == 2:
        rows.append(_row("prefix caching off vs on", "output tok/s, all at t=0",
                         tput(p["burst"]["off"]), tput(p["burst"]["on"]), False))
    c = s["chunked_prefill"]["runs"]
    if len(c) == 2:
        rows.append(_row("chunked prefill off vs on", "p99 ITL of running decodes (ms)",
                         c["off"]["itl_s"]["p99"], c["on"]["itl_s"]["p99"], True))
    pr = s["preemption"]["runs"]
    if len(pr) == 2:
        name = "recompute vs swap preemption"
        rows.append(_row(name, "output tok/s", tput(pr["recompute"]), tput(pr["swap"]), False))
        rows.append(_row(name, "p99 e2e latency (ms)", pr["recompute"]["e2e_s"]["p99"],
                         pr["swap"]["e2e_s"]["p99"], True))
    sp = s.get("speculative", {})
    if sp.get("available") and len(sp.get("runs", {})) == 2:
        rows.append(_row("speculative decoding off vs on",
                         f"mean TPOT, {sp['max_concurrency']} in flight (ms)",
                         sp["runs"]["off"]["tpot_s"]["mean"], sp["runs"]["on"]["tpot_s"]["mean"],
                         True))
    peer = results.get("peer", {})
    for key, label in (("hf_continuous", "transformers generate_batch"),
                       ("hf_static", "transformers generate (static)")):
        if key in peer and "jaxserve" in peer:
            rows.append(_row(f"{label} vs jaxserve", "output tok/s, offline", tput(peer[key]),
                             tput(peer["jaxserve"]), False))
    return rows


def targets(results: dict) -> list[dict]:
    rows = {(r["name"], r["metric"].split(" (")[0]): r["gain"] for r in headline(results)}
    find = lambda name, metric: next((g for (n, m), g in rows.items()  # noqa: E731
                                      if n == name and m.startswith(metric)), None)
    roof = results.get("roofline", {}).get("fraction_of_bound")
    checks = [
        ("continuous >= 2x static output tokens/s", 2.0,
         find("static vs continuous batching", "output tok/s")),
        ("prefix caching cuts mean TTFT on shared-prefix >= 3x", 3.0,
         find("prefix caching off vs on", "mean TTFT")),
        ("chunked prefill cuts p99 ITL while long prompts arrive >= 2x", 2.0,
         find("chunked prefill off vs on", "p99 ITL")),
        ("jaxserve >= 2x transformers continuous batching output tokens/s", 2.0,
         find("transformers generate_batch vs jaxserve", "output tok/s")),
        ("batch-1 decode within 70% of the bandwidth bound", 0.7, roof),
    ]
    return [{"name": name, "target": target, "value": value,
             "measured": "not measured" if value is None else
             (f"{value:.0%} of bound" if target < 1 else f"{value:.2f}x"),
             "met": None if value is None else bool(value >= target)}
            for name, target, value in checks]


def _cell(value) -> str:
    if value is None:
        return "-"
    return f"{value:.2f}" if isinstance(value, float) else str(value)


def _serve_table(runs: dict[str, dict], extra: tuple[str, ...] = ()) -> list[str]:
    head = ("| run | ok / failed | out tok/s | mean TTFT | p99 TTFT | mean TPOT | p99 ITL "
            "| p99 e2e |" + "".join(f" {e} |" for e in extra))
    lines = [head, "|" + "---|" * (8 + len(extra))]
    for label, r in runs.items():
        lines.append(f"| {label} | {r['completed']} / {r['failed']} | "
                     f"{r['output_throughput']:.1f} | {_ms(r['ttft_s']['mean'])} | "
                     f"{_ms(r['ttft_s']['p99'])} | {_ms(r['tpot_s']['mean'])} | "
                     f"{_ms(r['itl_s']['p99'])} | {_ms(r['e2e_s']['p99'])} |"
                     + "".join(f" {_cell(r.get(e))} |" for e in extra))
    return lines


def _rate(rate) -> str:
    return "inf (all at t=0)" if str(rate) == "inf" else f"{float(rate):g}"


def report_lines(results: dict) -> list[str]:
    m, sc, s = results["machine"], results["scale"], results["scenarios"]
    out = [f"# jaxserve benchmark suite: {results['model']['name']}", "",
           f"* date: {results['date']}; wall time {results['wall_s'] / 60:.1f} min",
           f"* command: `{results['command']}` (scale `{results['scale_name']}`)",
           f"* machine: {m['cpu']}, {m['cores']} cores, {m['ram_gib']} GiB RAM; {m['platform']};"
           f" Python {m['python']}, jax {m['jax']} ({m['backend']})",
           f"* load average at start {m['load_avg_start']}, at end {m.get('load_avg_end')} "
           "(the suite alone keeps the 1-minute figure near 1.5; more means other jobs shared "
           "the cores and the figures are noisy).",
           f"* A/Bs with a target run {sc['rounds']} round(s), A B B A, and each side reports "
           "its best round (all rounds are in results.json); the others run once.",
           "* engine settings shared by every A/B (each B changes one): "
           f"`{results['engine_settings']}`",
           f"* engine start-up (load + compile-cache hits + warm-up), s: "
           + ", ".join(f"{k} {v:.0f}" for k, v in results["startup_s"].items()), "",
           "## Headline", "", "| A/B | metric | A | B | B's gain |", "|---|---|---|---|---|"]
    for r in headline(results):
        out.append(f"| {r['name']} | {r['metric']} | {r['a']} | {r['b']} | {_x(r['gain'])} |")
    out += ["", "## Targets", "", "| target | measured | met |", "|---|---|---|"]
    for t in results["targets"]:
        met = {True: "yes", False: "**no**", None: "not measured"}[t["met"]]
        out.append(f"| {t['name']} | {t['measured']} | {met} |")
    rf = results.get("roofline", {})
    if rf:
        mr, b = rf["machine"], rf["bound"]
        out += ["", "## Roofline (batch-1 decode)", "",
                f"* memory: numpy copy {mr['copy_gbs']:.1f} GB/s (read + write), read "
                f"{mr['read_gbs']:.1f} GB/s (numpy sum), {mr['jax_read_gbs']:.1f} GB/s "
                f"(jnp.sum), {mr['matvec_read_gbs']:.1f} GB/s (a 1-row jnp matmul over a "
                f"512 MiB weight); "
                f"bound uses the best, {mr['bandwidth_gbs']:.1f} GB/s",
                f"* matmul: {mr['matmul_gflops']:.0f} GFLOP/s (f32 {mr['matmul_n']}^3 jnp.dot)",
                f"* bytes per step: weights {b['weight_bytes'] / 1e6:.0f} MB ({rf['dtype']}, the "
                f"active parameters) + KV "
                f"{b['kv_bytes'] / 1e6:.1f} MB -> bound {_ms(b['bound_s'])} ms per step",
                "* measured step (one-token bucket, T=1, S=1): median "
                f"{_ms(rf['decode_step_s']['median'])} ms, best {_ms(rf['decode_step_s']['min'])}"
                f" ms over {rf['decode_step_s']['num_steps']} steps -> "
                f"**{rf['fraction_of_bound']:.0%} of the bandwidth bound**"]
        if "serving_bucket_step_s" in rf:
            out.append("* in the serving engine's buckets (T=16, S=16 padded): " + ", ".join(
                f"{k} {_ms(v)} ms/step" for k, v in rf["serving_bucket_step_s"].items()))
    sweeps = s["batching"]["sweeps"]
    if sweeps:
        out += ["", "## Continuous vs static batching", "",
                f"{sc['batching_requests']} requests per rate, prompts of "
                f"{sc['batching_input_len']} random tokens (16 of them fill one 256-token step, "
                "so a static batch can hold 16), output lengths exponential (mean "
                f"{sc['batching_output_mean']}, clipped to 2..{sc['batching_output_max']}), "
                "greedy, EOS ignored.", "",
                "| rate (req/s) | batching | ok | out tok/s | mean TTFT | p99 TTFT | mean TPOT |"
                " p99 e2e | preemptions |", "|---|---|---|---|---|---|---|---|---|"]
        for label, runs in sweeps.items():
            for r in runs:
                out.append(f"| {_rate(r['request_rate'])} | {label} | {r['completed']} | "
                           f"{r['output_throughput']:.1f} | {_ms(r['ttft_s']['mean'])} | "
                           f"{_ms(r['ttft_s']['p99'])} | {_ms(r['tpot_s']['mean'])} | "
                           f"{_ms(r['e2e_s']['p99'])} | {r['preemptions']} |")
        out += ["", "![rate sweep](batching_rate_sweep.png)", "![CDFs](batching_cdf.png)"]
    p = s["prefix_caching"]
    if p["rate"]:
        out += ["", "## Prefix caching", "",
                f"{sc['prefix_requests']} requests sharing a {sc['prefix_len']}-token prefix, "
                f"{sc['prefix_suffix_len']}-token question each, {sc['prefix_output_len']} output "
                f"tokens; at {sc['prefix_rate']} req/s (Poisson) and all at t=0.", ""]
        runs = {f"{k}, {sc['prefix_rate']} req/s": v for k, v in p["rate"].items()}
        runs.update({f"{k}, all at t=0": v for k, v in p["burst"].items()})
        out += _serve_table(runs, ("prefix_hit_rate",))
        out += ["", "![CDFs](prefix_caching_cdf.png)"]
    c = s["chunked_prefill"]["runs"]
    if c:
        out += ["", "## Chunked prefill", "",
                f"{sc['chunk_decodes']} chat requests decoding {sc['chunk_decode_output']} tokens "
                f"from t=0; {sc['chunk_long_prompts']} prompts of {sc['chunk_long_len']} tokens "
                f"(one output token each) arrive at {sc['chunk_first_arrival_s']} s and every "
                f"{sc['chunk_gap_s']} s after. On: chunks of at most 64 tokens per step "
                "(max_num_batched_tokens 64). Off: a prompt is prefilled whole in one step, so "
                "the step budget must hold the longest prompt (512 = max_model_len, as vLLM "
                "requires without chunked prefill). The mechanism is what makes the small "
                "budget possible; its price is more steps, so TTFT of the prompts themselves "
                "rises.", ""]
        out += _serve_table(c, ("steps",))
        out += ["", "![CDFs](chunked_prefill_cdf.png)"]
    pr = s["preemption"]["runs"]
    if pr:
        out += ["", "## Preemption: swap vs recompute", "",
                f"{sc['preempt_requests']} requests at t=0, {sc['preempt_input_len']}-token "
                f"prompts, {sc['preempt_output_len']} output tokens: they need more KV pages "
                f"than the pool's {results['engine_settings']['num_pages'] - 1}.", ""]
        out += _serve_table(pr, ("preemptions", "swaps"))
        out += ["", "![CDFs](preemption_cdf.png)"]
    sp = s.get("speculative", {})
    out += ["", "## Speculative decoding", ""]
    if sp.get("available") and len(sp.get("runs", {})) == 2:
        out.append(f"Settings {sp['settings']}, the `repeat` prompts, EOS respected, "
                   f"{sp['max_concurrency']} requests in flight.")
        out += [""] + _serve_table(sp["runs"], ("acceptance_rate",))
    else:
        out.append(f"not available: {sp.get('reason')}")
    peer = results.get("peer", {})
    out += ["", "## Peer: Hugging Face transformers", ""]
    if "hf_continuous" in peer:
        out += [f"Same machine and run; {peer['num_requests']} bundled chat prompts through the "
                f"chat template (mean {peer['mean_prompt_tokens']:.0f} tokens), "
                f"{peer['output_len']} output tokens each, greedy, EOS ignored, float32, all at "
                f"t=0; transformers {peer['versions']['transformers']}, torch "
                f"{peer['versions']['torch']} ({peer['versions']['torch_threads']} threads, "
                f"OMP_WAIT_POLICY={peer['versions'].get('OMP_WAIT_POLICY') or 'unset'}); "
                "generate_batch with jaxserve's page size (16), step token budget (256) and "
                "batch size (16), its KV cache sized to the requests.", "",
                "| system | duration (s) | output tokens | out tok/s |", "|---|---|---|---|"]
        for key, label in (("jaxserve", "jaxserve (Engine, continuous)"),
                           ("hf_continuous", "transformers generate_batch"),
                           ("hf_static", "transformers generate, one static batch")):
            r = peer[key]
            out.append(f"| {label} | {r['duration_s']:.1f} | {r['total_output_tokens']} | "
                       f"{r['output_throughput']:.1f} |")
    else:
        out.append(f"skipped: {peer.get('skipped')}")
    out += ["", "## Scale", "", "```", *(f"{k} = {v}" for k, v in sc.items()), "```"]
    return out


def write_report(results: dict, path: Path) -> None:
    Path(path).write_text("\n".join(report_lines(results)) + "\n")
