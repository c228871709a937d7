"""Multi-LoRA over HTTP: one `run_server` process (tests/http_server_main.py) serving a tiny
random Llama checkpoint with three PEFT adapters (tests/lora_oracle.py) in two device slots and
three host slots, runtime updating allowed. `model` = an adapter's name selects it (greedy
tokens equal transformers + peft with that adapter), /v1/models lists the adapters with their
parent, adapters load and unload at run time while requests stream under them, bad adapters
are 400s naming the problem while the server keeps serving, and /metrics shows vLLM's
lora_requests_info gauge and the load and eviction counters.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

pytest.importorskip("transformers")
pytest.importorskip("peft")

import arch_oracle  # noqa: E402
import lora_oracle  # noqa: E402

N = arch_oracle.NUM_GREEDY


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    return lora_oracle.make_lora_case(tmp_path_factory.mktemp("lora_http"), "llama")


@pytest.fixture(scope="module")
def server(case, tmp_path_factory):
    from http_server_main import drained_server

    template = tmp_path_factory.mktemp("template") / "plain.jinja"  # no special tokens: the
    template.write_text("{% for m in messages %}{{ m.content }}{% endfor %}")  # vocab is 256
    modules = [f"{name}={path}" for name, path in case.adapter_dirs.items()]
    old = os.environ.get("JAXSERVE_ALLOW_RUNTIME_LORA_UPDATING")
    os.environ["JAXSERVE_ALLOW_RUNTIME_LORA_UPDATING"] = "1"
    try:
        gen = drained_server("--model-dir", str(case.base_dir), "--chat-template", str(template),
                             "--lora-modules", *modules,
                             "--max-loras", "2", "--max-cpu-loras", "3",
                             "--step-delay-ms", "40")  # keeps streams in flight
        process = next(gen)
    finally:
        if old is None:
            del os.environ["JAXSERVE_ALLOW_RUNTIME_LORA_UPDATING"]
        else:
            os.environ["JAXSERVE_ALLOW_RUNTIME_LORA_UPDATING"] = old
    yield process
    next(gen, None)


@pytest.fixture(scope="module")
def base_name(server):
    return httpx.get(server.url + "/v1/models").json()["data"][0]["id"]


def complete(server, model, prompt, **extra):
    body = dict(model=model, prompt=prompt, max_tokens=N, temperature=0.0, ignore_eos=True,
                return_token_ids=True, **extra)
    return httpx.post(server.url + "/v1/completions", json=body, timeout=120)


def metric(server, name: str) -> float:
    text = httpx.get(server.url + "/metrics").text
    return float(re.search(rf"^{name} (\S+)$", text, re.M).group(1))


def test_models_lists_each_adapter_with_its_parent_and_path(server, case, base_name):
    cards = httpx.get(server.url + "/v1/models").json()["data"]
    assert cards[0]["parent"] is None
    adapters = {c["id"]: c for c in cards[1:]}
    assert set(adapters) == {"a1", "a2", "a3"}
    for name, card in adapters.items():
        assert card["parent"] == base_name and card["root"] == str(case.adapter_dirs[name])


def test_model_name_selects_the_adapter_in_rotation_over_two_slots(server, case, base_name):
    """Prompts under three adapters and the base model, twice over, concurrently: each gets
    transformers + peft's greedy tokens under its adapter; two slots for three adapters load
    and evict."""
    jobs = [(name or base_name, prompt, want) for _ in range(2)
            for name, prompt, want in zip(lora_oracle.ASSIGN, case.batch, case.want_greedy)]
    with ThreadPoolExecutor(len(jobs)) as pool:
        answers = list(pool.map(lambda job: complete(server, job[0], job[1]), jobs))
    for (model, _, want), r in zip(jobs, answers):
        assert r.status_code == 200, r.text
        assert r.json()["model"] == model
        assert r.json()["choices"][0]["token_ids"] == want, model
    assert metric(server, "jaxserve_lora_slot_loads_total") >= 3
    assert metric(server, "jaxserve_lora_slot_evictions_total") >= 1


def test_chat_and_responses_select_the_adapter_and_an_unknown_model_is_404(server, base_name):
    msg = [{"role": "user", "content": "hi"}]
    r = httpx.post(server.url + "/v1/chat/completions", timeout=120,
                   json=dict(model="a2", messages=msg, max_tokens=4))
    assert r.status_code == 200 and r.json()["model"] == "a2", r.text
    r = httpx.post(server.url + "/v1/responses", timeout=120,
                   json=dict(model="a3", input="hi", max_output_tokens=4))
    assert r.status_code == 200 and r.json()["model"] == "a3", r.text
    r = complete(server, "a9", [5, 6, 7])
    assert r.status_code == 404 and "model 'a9' does not exist" in r.text
    assert r.json()["error"]["param"] == "model"


def _bad_adapters(case, tmp):
    """name -> (adapter directory, words the 400 must hold)."""
    a1 = case.adapter_dirs["a1"]
    rank = lora_oracle.make_adapter(case.base_dir, tmp / "rank32", 9, r=32,
                                    target_modules=["q_proj"])
    unknown = shutil.copytree(a1, tmp / "unknown")
    config = json.loads((unknown / "adapter_config.json").read_text())
    config["target_modules"] = ["q_proj", "v_proj", "embed_tokens"]
    (unknown / "adapter_config.json").write_text(json.dumps(config))
    missing = shutil.copytree(a1, tmp / "missing")
    (missing / "adapter_model.safetensors").unlink()
    shapes = shutil.copytree(a1, tmp / "shapes")
    from safetensors.numpy import load_file, save_file
    tensors = load_file(shapes / "adapter_model.safetensors")
    key = next(k for k in tensors if "lora_B" in k)
    tensors[key] = tensors[key][:-1]
    save_file(tensors, shapes / "adapter_model.safetensors")
    return {"rank": (rank, "rank r=32 exceeds max_lora_rank=16"),
            "unknown": (unknown, "unknown target module 'embed_tokens'"),
            "missing": (missing, "missing file adapter_model.safetensors"),
            "shapes": (shapes, "has shape")}


def test_bad_adapters_are_400s_naming_the_problem_and_the_server_keeps_serving(
        server, case, tmp_path):
    for name, (path, words) in _bad_adapters(case, tmp_path).items():
        r = httpx.post(server.url + "/v1/load_lora_adapter", timeout=60,
                       json={"lora_name": name, "lora_path": str(path)})
        assert r.status_code == 400 and words in r.json()["error"]["message"], (name, r.text)
        assert complete(server, name, [5, 6, 7]).status_code == 404
    r = httpx.post(server.url + "/v1/load_lora_adapter", timeout=60,
                   json={"lora_name": "a1", "lora_path": str(case.adapter_dirs["a2"])})
    assert r.status_code == 400 and "already loaded" in r.text
    r = httpx.post(server.url + "/v1/unload_lora_adapter", json={"lora_name": "nope"})
    assert r.status_code == 404 and "'nope' is not loaded" in r.text
    r = complete(server, "a1", case.batch[0])
    assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == case.want_greedy[0]


def test_load_and_unload_while_requests_stream(server, case):
    """a4 (a3's weights, a fresh id) loads past max_cpu_loras (a host eviction), streams under
    it survive its unload with a3's tokens, the gauge shows it running, then a4 is a 404."""
    a3 = lora_oracle.ASSIGN.index("a3")
    prompt, want = case.batch[a3], case.want_greedy[a3]
    evictions = metric(server, "jaxserve_lora_host_evictions_total")
    r = httpx.post(server.url + "/v1/load_lora_adapter", timeout=60,
                   json={"lora_name": "a4", "lora_path": str(case.adapter_dirs["a3"])})
    assert r.status_code == 200, r.text
    assert metric(server, "jaxserve_lora_host_evictions_total") == evictions + 1
    assert "a4" in [c["id"] for c in httpx.get(server.url + "/v1/models").json()["data"]]
    first_token, results = threading.Barrier(5), []

    def stream():
        ids = []
        body = dict(model="a4", prompt=prompt, max_tokens=N, temperature=0.0, ignore_eos=True,
                    return_token_ids=True, stream=True)
        with httpx.stream("POST", server.url + "/v1/completions", json=body,
                          timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    ids += json.loads(line[6:])["choices"][0].get("token_ids") or []
                    if len(ids) == 1:
                        first_token.wait(timeout=60)
        results.append((r.status_code, ids))

    threads = [threading.Thread(target=stream) for _ in range(4)]
    for t in threads:
        t.start()
    first_token.wait(timeout=60)
    text = httpx.get(server.url + "/metrics").text
    gauge = re.search(r'^vllm:lora_requests_info\{(.*)\} \S+$', text, re.M).group(1)
    assert 'running_lora_adapters="a4"' in gauge and 'max_lora="2"' in gauge, gauge
    r = httpx.post(server.url + "/v1/unload_lora_adapter", json={"lora_name": "a4"})
    assert r.status_code == 200, r.text
    assert complete(server, "a4", prompt).status_code == 404
    for t in threads:
        t.join(timeout=120)
    assert results == [(200, want)] * 4
    assert "a4" not in [c["id"] for c in httpx.get(server.url + "/v1/models").json()["data"]]
    # the adapter host memory let go of is read again from its path when next named
    for name, prompt, want in zip(lora_oracle.ASSIGN, case.batch, case.want_greedy):
        if name is not None:
            assert complete(server, name, prompt).json()["choices"][0]["token_ids"] == want


def test_runtime_updating_needs_an_explicit_flag():
    from jaxserve.entrypoints.openai.lora_routes import runtime_updating_allowed

    assert not runtime_updating_allowed({})
    assert not runtime_updating_allowed({"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "0"})
    assert runtime_updating_allowed({"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"})
    assert runtime_updating_allowed({"JAXSERVE_ALLOW_RUNTIME_LORA_UPDATING": "1"})


def test_grpc_lora_name_selects_the_adapter_and_an_unknown_one_is_invalid_argument(
        server, case):
    import grpc

    from jaxserve.entrypoints.grpc.pb import jaxserve_pb2 as pb
    from jaxserve.entrypoints.grpc.pb import jaxserve_pb2_grpc as pb_grpc

    def generate(name, prompt):
        request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), lora_name=name,
                                     sampling=pb.SamplingParams(max_tokens=N, temperature=0.0,
                                                                ignore_eos=True))
        return [t for r in stub.Generate(request, timeout=120) for t in r.token_ids]

    with grpc.insecure_channel(server.grpc_address) as channel:
        stub = pb_grpc.JaxServeStub(channel)
        for name, prompt, want in zip(lora_oracle.ASSIGN, case.batch, case.want_greedy):
            assert generate(name or "", prompt) == want, name
        with pytest.raises(grpc.RpcError) as err:
            generate("a9", case.batch[0])
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "lora_name='a9' names no LoRA adapter" in err.value.details()
