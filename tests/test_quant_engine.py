"""The engine's guarantees hold for quantized weights (tiny random Llama, int8 and int4): greedy
tokens of a busy batch, chunked and preempted (recompute and swap), equal each request run
alone; nothing compiles after warm-up; EngineInfo reports the bytes and formats; tensor
parallelism on fake CPU devices gives one device's tokens (tests/tp_quant_check.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import make_llm
from jaxserve import SamplingParams
from jaxserve.runner.compile_count import CompileCounter
from test_engine import assert_idle_and_no_leak, mixed_requests

MODES = ("int8", "int4")


def requests():
    return mixed_requests(n=24, seed=3, max_prompt=120, max_out=60)


@pytest.fixture(scope="module", params=MODES)
def quantized(request):
    """(mode, the engine with its preemption mode swap, each request's tokens run alone)."""
    llm = make_llm(quantization=request.param, preemption_mode="swap")
    prompts, params = requests()
    alone = [llm.generate([p], sp, use_tqdm=False)[0].token_ids for p, sp in zip(prompts, params)]
    return request.param, llm, alone


def test_busy_chunked_preempted_batch_matches_requests_run_alone(quantized):
    mode, llm, alone = quantized
    prompts, params = requests()
    with CompileCounter() as compiles:
        outs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0, "the page pool was meant to force preemption"
    assert llm.engine.scheduler.num_swaps > 0, "swap mode never swapped"
    differ = [i for i, (o, ref) in enumerate(zip(outs, alone)) if o.token_ids != ref]
    assert not differ, f"{mode}: {len(differ)} requests differ from their solo run: {differ}"
    assert compiles.count == 0, f"{mode}: serving compiled something after warm-up"
    assert_idle_and_no_leak(llm)


def test_recompute_preemption_gives_the_same_tokens(quantized):
    mode, _, alone = quantized
    llm = make_llm(quantization=mode, preemption_mode="recompute")
    prompts, params = requests()
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0
    assert [o.token_ids for o in outs] == alone, f"{mode}: recompute changed tokens"


def test_engine_info_reports_weight_bytes_and_each_groups_format(quantized):
    mode, llm, _ = quantized
    info = llm.engine.info
    assert info.quantization == mode
    formats = {group: fmt for group, fmt, _ in info.weight_formats}
    assert set(formats) == {"embed", "lm_head", "attention", "mlp", "other"}, formats
    assert all(formats[g].startswith(mode) for g in ("embed", "lm_head", "attention", "mlp"))
    assert formats["other"] == "float32"
    assert info.weight_bytes == sum(size for _, _, size in info.weight_formats)
    assert llm.engine.metrics.registry.get_sample_value("jaxserve_model_weight_bytes") == \
        info.weight_bytes


def test_tensor_parallel_quantized_tokens_equal_one_device(tmp_path):
    out = tmp_path / "tp.json"
    # small chunks: the sharded matrices and head are dequantized a few rows at a time too
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent),
           "JAXSERVE_DEQUANT_CHUNK_BYTES": "4096"}
    script = Path(__file__).resolve().parent / "tp_quant_check.py"
    run = subprocess.run([sys.executable, str(script), str(out)], env=env, capture_output=True,
                         text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(out.read_text())
    for mode, runs in report["tokens"].items():
        for tp, tokens in runs.items():
            assert tokens == runs["1"], f"{mode}: tensor_parallel_size={tp} changed the tokens"
    for mode, specs in report["shardings"].items():
        assert "tp" in specs["layers.wq.q"] and "tp" in specs["layers.w_down.q"], specs
        assert "tp" in specs["layers.w_down.scale"] or mode == "int8", specs


def test_a_layers_draft_of_a_quantized_target_speculates_the_same_greedy_tokens(quantized):
    mode, _, alone = quantized  # alone: the same quantized model without speculation
    # (speculating at every batch size: the check is of the tokens, not of the cost policy,
    # whose warm-up timings may find speculation too dear for a tiny model on a CPU)
    llm = make_llm(quantization=mode, speculative_method="draft", speculative_draft="layers:1",
                   num_speculative_tokens=2, speculative_disable_by_batch_size=16)
    prompts, params = requests()
    spec = [o.token_ids for o in llm.generate(prompts[:8], params[:8], use_tqdm=False)]
    assert llm.engine.speculation.policy.stats.num_draft_tokens > 0, "nothing was drafted"
    assert spec == alone[:8], f"{mode}: speculation with a layers:1 draft changed greedy tokens"
