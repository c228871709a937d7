"""The feature compatibility matrix's one source of truth: the features, the verdict on every
pair of them, the covering set of engine configurations that tests the working pairs, and the
rendering of docs/compatibility.md (which tests/test_compatibility_matrix.py parses back and
compares with VERDICTS).

A verdict is one of
* works: some engine of COVERING (or a request of every engine) turns both features on and its
  greedy tokens equal the oracle's (tests/compat_engines.py);
* elsewhere: works, shown by the named existing test (process-level features that the
  covering engines cannot hold in one process);
* refused: the pair is refused at start-up (or at the request) with an error naming both
  settings, the error's text given here;
* n/a: the pair makes no sense (two values of one setting), the reason given here;
* untested: no test here or elsewhere runs the pair, and nothing refuses it.
Plain data and pure functions: no jax, no engine.
"""

from __future__ import annotations

import itertools

import numpy as np

# feature id -> (title in the doc, the setting or request field that turns it on)
FEATURES = {
    "prefix_cache": ("Prefix cache", "enable_prefix_caching=True"),
    "host_tier": ("Host prefix tier", "host_prefix_cache_size>0"),
    "swap": ("Swap preemption", "preemption_mode=swap"),
    "recompute": ("Recompute preemption", "preemption_mode=recompute"),
    "chunked": ("Chunked prefill", "enable_chunked_prefill=True"),
    "async": ("Async scheduling", "async_scheduling=True"),
    "ngram": ("N-gram speculation", "speculative_method=ngram"),
    "draft": ("Draft speculation", "speculative_method=draft"),
    "structured": ("Structured output", "SamplingParams.structured_outputs"),
    "tools": ("Tool calling", "tool_choice (named or required)"),
    "reasoning": ("Reasoning parser", "SamplingParams.structured_outputs_after"),
    "n": ("n > 1", "SamplingParams.n=2"),
    "logprobs": ("Logprobs", "SamplingParams.logprobs=2"),
    "int8": ("int8 weights", "quantization=int8"),
    "int4": ("int4 weights", "quantization=int4"),
    "fp8_kv": ("fp8 KV", "kv_cache_dtype=fp8"),
    "lora": ("LoRA", "enable_lora=True"),
    "moe": ("MoE", "a mixture-of-experts model"),
    "tp": ("TP", "tensor_parallel_size=2"),
    "ep": ("EP", "enable_expert_parallel=True"),
    "dp": ("DP", "serve --data-parallel-size 2"),
    "multi_host": ("Multi-host", "serve --distributed --num-processes 2"),
    "lifecycle": ("Sleep / wake / update_weights / pause",
                  "LLM.sleep, ...; serve --enable-rollout-endpoints"),
    "kv_events": ("KV events", "kv_events_config"),
    "tls_keys": ("TLS + API keys", "serve --ssl-certfile, --api-key"),
}
IDS = list(FEATURES)
# feature id -> how a refusal's error names it (any one of these)
NAMED_AS = {
    "lora": ("enable_lora",), "draft": ("speculative_method='draft'", "speculative decoding"),
    "ngram": ("speculative decoding",), "tools": ("tool_choice",),
    "structured": ("structured_outputs",), "dp": ("data_parallel_size", "data-parallel-size"),
    "multi_host": ("several JAX processes", "--distributed"),
    "host_tier": ("host_prefix_cache_size",),
    "lifecycle": ("sleep and wake_up", "enable_rollout_endpoints"),
}
# Request-level features and engine operations: every covering engine runs them (its requests
# combine them), so each pairs with every feature of every engine.
PER_ENGINE = ("structured", "tools", "reasoning", "n", "logprobs")
# The request-level features each engine's requests hold together (tests/compat_engines.py):
# two request-level features run together only within one of these.
REQUEST_COMBOS = (("structured", "n", "logprobs"), ("structured", "reasoning", "n", "logprobs"),
                  ("tools", "reasoning", "n", "logprobs"))

# The engine factors the covering array ranges over: factor -> its levels.
FACTORS = {
    "prefix": ("off", "device", "host"),
    "preemption": ("recompute", "swap"),
    "chunked": ("on", "off"),
    "async": ("on", "off"),
    "spec": ("none", "ngram", "draft"),
    "weights": ("float", "int8", "int4"),
    "kv": ("auto", "fp8"),
    "lora": ("off", "on"),
    "model": ("dense", "moe"),
    "parallel": ("1", "tp", "ep"),
    "kv_events": ("off", "on"),
    "lifecycle": ("off", "on"),
}
# (factor, level) -> the features that level turns on
LEVEL_FEATURES = {
    ("prefix", "device"): ("prefix_cache",), ("prefix", "host"): ("prefix_cache", "host_tier"),
    ("preemption", "recompute"): ("recompute",), ("preemption", "swap"): ("swap",),
    ("chunked", "on"): ("chunked",), ("async", "on"): ("async",),
    ("spec", "ngram"): ("ngram",), ("spec", "draft"): ("draft",),
    ("weights", "int8"): ("int8",), ("weights", "int4"): ("int4",),
    ("kv", "fp8"): ("fp8_kv",), ("lora", "on"): ("lora",), ("model", "moe"): ("moe",),
    ("parallel", "tp"): ("tp",), ("parallel", "ep"): ("tp", "ep"),
    ("kv_events", "on"): ("kv_events",), ("lifecycle", "on"): ("lifecycle",),
}
# Level pairs no engine may hold: a dependency (EP splits experts, so it needs a MoE model) or
# a refused pair (tested as a refusal instead).
EXCLUDED = {
    frozenset({("parallel", "ep"), ("model", "dense")}),
    frozenset({("lora", "on"), ("spec", "draft")}),
    frozenset({("lifecycle", "on"), ("spec", "ngram")}),
    frozenset({("lifecycle", "on"), ("spec", "draft")}),
}


def _pair(a: str, b: str) -> frozenset:
    return frozenset({a, b})


_SAME_SETTING = "two values of one setting: an engine runs one"
_TLS = ("transport security wraps the HTTP and gRPC servers only: it sees requests and "
        "replies, not how the engine makes them")
# Pairs whose verdict is not `works`, with its detail: refused -> the error text (a part of
# it that names both settings); n/a -> why; elsewhere -> "tests/file.py::test_name".
SPECIAL = {
    _pair("swap", "recompute"): ("n/a", _SAME_SETTING),
    _pair("ngram", "draft"): ("n/a", _SAME_SETTING),
    _pair("int8", "int4"): ("n/a", _SAME_SETTING),
    _pair("lora", "draft"): ("refused", "enable_lora=True is invalid with "
                                        "speculative_method='draft'"),
    _pair("lifecycle", "ngram"): ("refused", "weight updates, sleep and wake_up are not "
                                             "supported with speculative decoding"),
    _pair("lifecycle", "draft"): ("refused", "weight updates, sleep and wake_up are not "
                                             "supported with speculative decoding"),
    _pair("tools", "structured"): ("refused", "constrains the output to tool calls, so it "
                                              "cannot be combined with structured_outputs"),
    _pair("dp", "lora"): ("refused", "data_parallel_size > 1 is not supported with "
                                     "enable_lora"),
    _pair("multi_host", "lora"): ("refused", "enable_lora is not supported with several JAX "
                                             "processes"),
    _pair("multi_host", "host_tier"): ("refused", "is not supported with several JAX "
                                                  "processes"),
    _pair("dp", "multi_host"): ("refused", "--data-parallel-size > 1 runs on one host: it "
                                           "cannot be combined with the multi-host "
                                           "--distributed flags"),
    _pair("dp", "lifecycle"): ("refused", "enable_rollout_endpoints is not supported with "
                                          "data_parallel_size"),
    _pair("multi_host", "lifecycle"): ("refused", "weight updates, sleep and wake_up are not "
                                                  "supported with several JAX processes"),
    _pair("dp", "kv_events"): ("elsewhere", "tests/test_data_parallel.py::"
                               "test_each_rank_publishes_kv_events_on_its_own_port_with_its_"
                               "rank"),
    _pair("dp", "tls_keys"): ("n/a", _TLS),
    _pair("multi_host", "tls_keys"): ("n/a", _TLS),
}
for _f in IDS:
    if _f not in ("dp", "multi_host", "tls_keys"):
        SPECIAL.setdefault(_pair(_f, "tls_keys"), ("n/a", _TLS))


def verdict(a: str, b: str) -> tuple[str, str]:
    """(status, detail) of the pair: SPECIAL's entry; a pair with DP or multi-host that a
    DP_COVERING / MH_COVERING configuration runs works, another is untested; every other pair
    works."""
    special = SPECIAL.get(_pair(a, b))
    if special is not None:
        return special
    if _pair(a, b) in _SPANNING_RUN:
        return ("works", "")
    if {a, b} & {"dp", "multi_host"}:
        return ("untested", "no test runs it: the covering engines run in one process")
    return ("works", "")


def all_pairs() -> list[tuple[str, str]]:
    return list(itertools.combinations(IDS, 2))


def features_of(config: dict) -> set[str]:
    """The features one covering configuration (factor -> level) turns on, request-level ones
    included."""
    on = set(PER_ENGINE)
    for item in config.items():
        on.update(LEVEL_FEATURES.get(item, ()))
    return on


def pairs_run(config: dict) -> set[frozenset]:
    """The feature pairs one covering configuration runs together: those of its engine-level
    features with each other and with every request-level feature, and the request-level pairs
    one request holds."""
    on = features_of(config)
    pairs = {frozenset(p) for p in itertools.combinations(sorted(on), 2)
             if not set(p) <= set(PER_ENGINE)}
    for combo in REQUEST_COMBOS:
        pairs.update(frozenset(p) for p in itertools.combinations(combo, 2))
    return pairs


def _allowed(levels: tuple) -> bool:
    items = set(zip(FACTORS, levels))
    return not any(pair <= items for pair in EXCLUDED)


def covering_array() -> list[dict]:
    """A pairwise covering set of engine configurations, built greedily and deterministically:
    each next configuration is the allowed one (in itertools.product order on ties) covering
    the most pairs of feature-bearing levels no earlier one covers, until every allowed such
    pair is covered. (A level that turns no feature on, e.g. weights=float, need not pair.)"""
    names = list(FACTORS)
    candidates = [c for c in itertools.product(*FACTORS.values()) if _allowed(c)]
    index = {key: i for i, key in enumerate((f, level) for f, levels in FACTORS.items()
                                            for level in levels)}
    codes = np.array([[index[(f, level)] for f, level in zip(names, c)] for c in candidates])
    n = len(index)
    cols = list(itertools.combinations(range(len(names)), 2))
    pair_ids = np.stack([codes[:, i] * n + codes[:, j] for i, j in cols], axis=1)  # [C, P]
    featured = np.array([key in LEVEL_FEATURES for key in index])
    wanted = featured[codes[:, [i for i, _ in cols]]] & featured[codes[:, [j for _, j in cols]]]
    uncovered = np.zeros(n * n, bool)
    uncovered[np.unique(pair_ids[wanted])] = True
    chosen = []
    while uncovered.any():
        best = int(np.argmax(uncovered[pair_ids].sum(axis=1)))
        chosen.append(dict(zip(names, candidates[best])))
        uncovered[pair_ids[best]] = False
    return chosen


COVERING = covering_array()

# Configurations served by two data-parallel ranks, each rank a process holding the whole
# configuration (tests/compat_data_parallel.py): between them, every engine feature DP is not
# refused with and every request-level feature runs behind DP.
_DP_OFF = {"lora": "off", "kv_events": "off", "lifecycle": "off"}
DP_COVERING = [
    {"prefix": "host", "preemption": "swap", "chunked": "on", "async": "on", "spec": "ngram",
     "weights": "int8", "kv": "fp8", "model": "moe", "parallel": "ep", **_DP_OFF},
    {"prefix": "device", "preemption": "recompute", "chunked": "on", "async": "off",
     "spec": "draft", "weights": "int4", "kv": "auto", "model": "dense", "parallel": "tp",
     **_DP_OFF},
]
DP_COVERING = [{f: c[f] for f in FACTORS} for c in DP_COVERING]  # FACTORS' order


# Configurations served by a two-process JAX cluster (tests/compat_multihost.py: one CPU device
# per process, tensor parallelism across them): between them, every engine feature multi-host
# is not refused with and every request-level feature runs on several JAX processes.
_MH_OFF = {"lora": "off", "lifecycle": "off"}
MH_COVERING = [
    {"prefix": "device", "preemption": "swap", "chunked": "on", "async": "on", "spec": "ngram",
     "weights": "int8", "kv": "fp8", "model": "moe", "parallel": "ep", "kv_events": "on",
     **_MH_OFF},
    {"prefix": "off", "preemption": "recompute", "chunked": "on", "async": "off",
     "spec": "draft", "weights": "int4", "kv": "auto", "model": "dense", "parallel": "tp",
     "kv_events": "off", **_MH_OFF},
]
MH_COVERING = [{f: c[f] for f in FACTORS} for c in MH_COVERING]


def spanning_pairs_run(feature: str, config: dict) -> set[frozenset]:
    """The pairs with `feature` ("dp" or "multi_host") that one of DP_COVERING / MH_COVERING's
    configurations runs."""
    return {_pair(feature, f) for f in features_of(config)}


_SPANNING_RUN = set().union(*(spanning_pairs_run("dp", c) for c in DP_COVERING),
                            *(spanning_pairs_run("multi_host", c) for c in MH_COVERING))



SYMBOLS = {"works": "Y", "elsewhere": "E", "refused": "R", "n/a": "-", "untested": "?"}
DOC_HEAD = """# Feature compatibility

Which features work together. Every pair of features is one of:

* **Y** works: an engine of the matrix test runs both at once and its greedy tokens (and
  logprobs) equal the oracle's: transformers, with peft for LoRA, on the same tiny random
  checkpoint, with the weights dequantized as the engine stores them (int8 / int4), keys and
  values rounded to fp8 as fp8 pages store them, and, under a grammar, the argmax over the
  tokens the grammar allows;
* **E** works, shown by the existing test named below (a feature spanning processes, checked
  against a one-process engine);
* **R** refused, at start-up or at the request, with an error naming both settings (below);
* **-** not applicable (why, below);
* **?** untested: nothing runs the pair and nothing refuses it.

The matrix test is tests/test_compatibility_matrix.py; the table's source is
tests/compat_table.py, and the test fails when this page and that table disagree. The engines
form a pairwise covering set over the engine settings (built greedily, in code, from the
settings' levels), and every engine serves requests that combine the request-level features
(structured output, tool calling, the reasoning end sequence, n > 1, logprobs), so a handful
of engines runs every working pair. They run on two virtual CPU devices (TP and EP over 2),
with int8 weights multiplied in float (int8_activations=off). The pairs with DP run the same
requests, against the same oracle, on two more configurations served by two data-parallel
ranks (each rank a process with the configuration's whole engine, through the server's
data-parallel client), and the pairs with multi-host on two configurations served by a
two-process JAX cluster (one CPU device per process, tensor parallelism across them).

"""


def render_doc() -> str:
    """docs/compatibility.md: the legend, the grid, then every pair not marked Y."""
    titles = [FEATURES[f][0] for f in IDS]
    lines = [DOC_HEAD, "| Feature | Turned on by | " + " | ".join(
        str(i + 1) for i in range(len(IDS))) + " |",
        "|" + "---|" * (len(IDS) + 2)]
    for i, a in enumerate(IDS):
        cells = ["" if a == b else SYMBOLS[verdict(a, b)[0]] for b in IDS]
        lines.append(f"| {i + 1}. {titles[i]} | {FEATURES[a][1]} | " + " | ".join(cells) + " |")
    lines += ["", "## Pairs that are not plain works", "",
              "| Feature | Feature | Verdict | Error, reason or test |", "|---|---|---|---|"]
    for a, b in all_pairs():
        status, detail = verdict(a, b)
        if status != "works":
            lines.append(f"| {FEATURES[a][0]} | {FEATURES[b][0]} | {status} | {detail} |")
    lines += ["", "## The engines", "",
              "Each engine's settings (tests/compat_engines.py's engine_settings turns them into "
              "LLM(...) keywords):", "", "| Engine | " + " | ".join(FACTORS) + " |",
              "|" + "---|" * (len(FACTORS) + 1)]
    for i, config in enumerate(COVERING):
        lines.append(f"| {i} | " + " | ".join(config[f] for f in FACTORS) + " |")
    lines += ["", "Served by two data-parallel ranks:", "",
              "| Configuration | " + " | ".join(FACTORS) + " |", "|" + "---|" * (len(FACTORS) + 1)]
    for i, config in enumerate(DP_COVERING):
        lines.append(f"| dp{i} | " + " | ".join(config[f] for f in FACTORS) + " |")
    lines += ["", "Served by a two-process JAX cluster:", "",
              "| Configuration | " + " | ".join(FACTORS) + " |", "|" + "---|" * (len(FACTORS) + 1)]
    for i, config in enumerate(MH_COVERING):
        lines.append(f"| mh{i} | " + " | ".join(config[f] for f in FACTORS) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(render_doc(), end="")
