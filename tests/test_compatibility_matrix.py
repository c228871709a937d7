"""The feature compatibility matrix: every pair of features works together (greedy tokens equal
the oracle's), is refused with an error naming both settings, or is marked not applicable;
docs/compatibility.md says which, and must agree with tests/compat_table.py.

The working pairs run on compat_table.COVERING's engines (a pairwise covering set, run once in
a fresh interpreter with two virtual CPU devices by tests/compat_engines.py), the pairs with DP
on DP_COVERING's configurations behind two data-parallel ranks (compat_data_parallel.py) and
those with multi-host on MH_COVERING's two-process clusters (compat_multihost.py); each
refused pair is triggered here on the path that refuses it.
"""

from __future__ import annotations

import ast
import asyncio
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import compat_table as table

pytest.importorskip("transformers")
pytest.importorskip("peft")

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "compatibility.md"


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    """compat_engines.py's results: {"engines": one per COVERING configuration,
    "data_parallel": one per DP_COVERING configuration}."""
    out = tmp_path_factory.mktemp("matrix") / "results.json"
    env = dict(os.environ, JAX_PLATFORMS="cpu",  # (the checkout's jaxserve, installed or not)
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
               XLA_FLAGS=os.environ.get("XLA_FLAGS", "")
               + " --xla_force_host_platform_device_count=2")
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "compat_engines.py"), str(out)],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=3000)
    assert proc.returncode == 0, f"the matrix's engines did not run:\n{proc.stderr[-4000:]}"
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def engines(results) -> list[dict]:
    return results["engines"]


def _label(config: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in config.items())


@pytest.mark.parametrize("index", range(len(table.COVERING)),
                         ids=[f"engine{i}" for i in range(len(table.COVERING))])
def test_each_covering_engine_gives_the_oracles_greedy_tokens(engines, index):
    result = engines[index]
    assert result["config"] == table.COVERING[index], "results are out of order"
    assert not result["failures"], (f"engine {_label(result['config'])} differs from the "
                                    "oracle:\n" + "\n".join(result["failures"]))


def test_every_covering_engine_preempts_requests(engines):
    idle = [_label(r["config"]) for r in engines if r["preemptions"] == 0]
    assert not idle, f"no request was preempted in {idle}: the preemption pairs went untested"


def test_prefix_caching_engines_read_shared_prefixes_from_the_cache(engines):
    missed = [_label(r["config"]) for r in engines
              if r["config"]["prefix"] != "off" and r["cached_tokens"] == 0]
    assert not missed, f"prompts sharing a prefix read no cached token in {missed}"


def test_host_tier_engines_keep_evicted_pages_in_host_memory(engines):
    unused = [_label(r["config"]) for r in engines
              if r["config"]["prefix"] == "host" and r["host_tier_pages"][0] == 0]
    assert not unused, f"the host prefix tier stored no page in {unused}"


def test_kv_event_engines_publish_events(engines):
    silent = [_label(r["config"]) for r in engines
              if r["config"]["kv_events"] == "on" and r["kv_events"] == 0]
    assert not silent, f"no KV event was published by {silent}"


def test_speculative_engines_refuse_sleep_naming_speculative_decoding(engines):
    spec = [r for r in engines if r["config"]["spec"] != "none"]
    assert spec, "no covering engine speculates"
    for r in spec:
        message = r["lifecycle_refusal"] or ""
        assert "sleep" in message and "speculative decoding" in message, (
            f"{_label(r['config'])}: sleep gave {message!r}")


def test_the_covering_engines_run_every_working_pair():
    run = set().union(*(table.pairs_run(c) for c in table.COVERING))
    missing = [(a, b) for a, b in table.all_pairs() if table.verdict(a, b)[0] == "works"
               and not {a, b} & {"dp", "multi_host"}  # the spanning runs' pairs (below)
               and frozenset({a, b}) not in run]
    assert not missing, f"pairs marked works that no covering engine runs: {missing}"


def test_no_covering_engine_runs_a_pair_not_marked_works():
    for config in table.COVERING:
        bad = [sorted(p) for p in table.pairs_run(config) if table.verdict(*p)[0] != "works"]
        assert not bad, f"engine {_label(config)} runs pairs not marked works: {bad}"


SPANNING = [("data_parallel", f"dp{i}", c, "behind two data-parallel ranks")
            for i, c in enumerate(table.DP_COVERING)]
SPANNING += [("multi_host", f"mh{i}", c, "on a two-process JAX cluster")
             for i, c in enumerate(table.MH_COVERING)]


@pytest.mark.parametrize("kind,name,config,where", SPANNING, ids=[s[1] for s in SPANNING])
def test_each_configuration_spanning_processes_gives_the_oracles_greedy_tokens(
        results, kind, name, config, where):
    result = next(r for r in results[kind] if r["config"] == config)
    assert not result["failures"], (f"{_label(config)} {where} differs from the oracle:\n"
                                    + "\n".join(result["failures"]))
    assert result["preemptions"] > 0, f"no request was preempted {where}"
    if kind == "data_parallel":
        assert all(n > 0 for n in result["requests_per_rank"]), (
            f"a rank served none of the requests: {result['requests_per_rank']}")
    if config["kv_events"] == "on":
        assert result["kv_events"] > 0, f"no KV event was published {where}"


@pytest.mark.parametrize("feature,configs", [("dp", table.DP_COVERING),
                                             ("multi_host", table.MH_COVERING)])
def test_the_spanning_runs_cover_every_pair_of_their_feature_marked_works(feature, configs):
    run = set().union(*(table.spanning_pairs_run(feature, c) for c in configs))
    want = {frozenset(p) for p in table.all_pairs()
            if feature in p and table.verdict(*p)[0] == "works"}
    assert run == want, (f"marked works but not run with {feature}: "
                         f"{sorted(map(sorted, want - run))}; run with {feature} but not "
                         f"marked works: {sorted(map(sorted, run - want))}")


def _refusal(pair: frozenset) -> str:
    """The error the path that refuses `pair` raises (its text)."""
    from jaxserve.config import CacheConfig, EngineConfig
    from jaxserve.core.errors import RequestError
    from jaxserve.engine import builder

    def message(fn) -> str:
        with pytest.raises((ValueError, RequestError, NotImplementedError)) as err:
            fn()
        return str(err.value)

    lora = EngineConfig.from_kwargs(enable_lora=True)
    if pair == {"lora", "draft"}:
        return message(lambda: EngineConfig.from_kwargs(
            enable_lora=True, speculative_method="draft", num_speculative_tokens=2,
            speculative_draft="layers:1"))
    if pair == {"tools", "structured"}:
        from compat_engines import TOOL
        from jaxserve.entrypoints.openai.tools import plan_tools
        return message(lambda: plan_tools([TOOL], "required",
                                          other_constraint="structured_outputs"))
    if pair == {"dp", "lora"}:
        from jaxserve.entrypoints.data_parallel.client import DataParallelClient
        return message(lambda: asyncio.run(DataParallelClient.launch(lora, 2)))
    if pair == {"multi_host", "lora"}:
        return message(lambda: builder.lora_adapters(lora, None, num_processes=2))
    if pair == {"multi_host", "host_tier"}:
        return message(lambda: builder.host_prefix_tier(
            CacheConfig(host_prefix_cache_size=1 << 20), 4096, 2))
    if pair == {"dp", "multi_host"}:  # cli.main's check, before any backend starts
        from jaxserve.config import compatibility
        return message(lambda: compatibility.check_data_parallel(2, multi_host=True))
    if pair == {"dp", "lifecycle"}:
        from jaxserve.entrypoints.openai.http_server import HttpSettings
        from jaxserve.entrypoints.serve import serve
        return message(lambda: asyncio.run(serve(
            lora, "127.0.0.1", 0, 1.0, http=HttpSettings(enable_rollout_endpoints=True),
            data_parallel_size=2)))
    if pair == {"multi_host", "lifecycle"}:
        from jaxserve.runner.multihost import LeaderRunner
        return LeaderRunner.rollout_refusal
    raise AssertionError(f"no refusal path is known for {sorted(pair)}")


ENGINE_REFUSED = ({"lifecycle", "ngram"}, {"lifecycle", "draft"})  # the engines' results
REFUSED = [p for p, (status, _) in table.SPECIAL.items()
           if status == "refused" and p not in ENGINE_REFUSED]


@pytest.mark.parametrize("pair", REFUSED, ids=["+".join(sorted(p)) for p in REFUSED])
def test_a_refused_pair_is_refused_with_an_error_naming_both_settings(pair):
    text = _refusal(pair)
    _, detail = table.SPECIAL[pair]
    assert detail in text, f"the refusal reads {text!r}; the table quotes {detail!r}"
    for feature in pair:
        assert any(name in text for name in table.NAMED_AS[feature]), (
            f"the refusal of {sorted(pair)} does not name {feature} "
            f"({table.NAMED_AS[feature]}): {text!r}")


ELSEWHERE = [(p, d) for p, (status, d) in table.SPECIAL.items() if status == "elsewhere"]


@pytest.mark.parametrize("pair,where", ELSEWHERE, ids=["+".join(sorted(p)) for p, _ in ELSEWHERE])
def test_a_pair_shown_elsewhere_names_a_test_that_exists(pair, where):
    path, name = where.split("::")
    tree = ast.parse((ROOT / path).read_text())
    names = {node.name for node in ast.walk(tree) if isinstance(node, ast.FunctionDef)}
    assert name in names, f"{where} (for {sorted(pair)}) is not a test in {path}"


def _doc_grid(text: str) -> dict:
    """{(row feature title, column number): symbol} from the grid's rows."""
    cells = {}
    for line in text.splitlines():
        m = re.match(r"\| (\d+)\. ([^|]+?) \| [^|]* \|(.*)\|$", line)
        if m:
            symbols = [c.strip() for c in m.group(3).split("|")]
            for j, s in enumerate(symbols):
                cells[(int(m.group(1)) - 1, j)] = s
    return cells


def _doc_details(text: str) -> dict:
    """{frozenset of titles: (status, detail)} from the list of pairs that are not plain
    works."""
    rows = {}
    for line in text.split("## Pairs that are not plain works", 1)[-1].splitlines():
        parts = [p.strip() for p in line.strip().strip("|").split("|")]
        if len(parts) == 4 and parts[2] in table.SYMBOLS:
            rows[frozenset(parts[:2])] = (parts[2], parts[3])
    return rows


def test_the_doc_grid_gives_every_pair_the_tables_verdict():
    cells = _doc_grid(DOC.read_text())
    assert len(cells) == len(table.IDS) ** 2, (
        f"docs/compatibility.md's grid has {len(cells)} cells, not {len(table.IDS)}^2: "
        "regenerate it with `python tests/compat_table.py > docs/compatibility.md`")
    wrong = [(a, b, cells[(i, j)]) for i, a in enumerate(table.IDS)
             for j, b in enumerate(table.IDS) if a != b
             and cells[(i, j)] != table.SYMBOLS[table.verdict(a, b)[0]]]
    assert not wrong, f"the doc's grid disagrees with compat_table for {wrong[:10]}"


def test_the_doc_lists_every_pair_that_is_not_plain_works_with_its_reason():
    rows = _doc_details(DOC.read_text())
    title = {f: table.FEATURES[f][0] for f in table.IDS}
    want = {frozenset({title[a], title[b]}): table.verdict(a, b)
            for a, b in table.all_pairs() if table.verdict(a, b)[0] != "works"}
    assert rows == want, (
        "docs/compatibility.md's list of pairs disagrees with compat_table: only in the doc "
        f"{sorted(map(sorted, rows.keys() - want.keys()))}, only in the table "
        f"{sorted(map(sorted, want.keys() - rows.keys()))}, differing "
        f"{[sorted(k) for k in rows.keys() & want.keys() if rows[k] != want[k]]}")


def test_the_doc_lists_the_covering_engines():
    text = DOC.read_text().split("## The engines", 1)[-1]
    rows = [[c.strip() for c in line.strip().strip("|").split("|")]
            for line in text.splitlines() if re.match(r"\| \d+ \|", line)]
    got = [dict(zip(table.FACTORS, row[1:])) for row in rows]
    assert got == table.COVERING, (
        f"docs/compatibility.md lists {len(got)} engines that differ from compat_table's "
        f"{len(table.COVERING)}: regenerate it with `python tests/compat_table.py > "
        "docs/compatibility.md`")
