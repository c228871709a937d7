"""Tool calling's cost: 16 concurrent chat requests with a named tool_choice vs the same requests
without tools, over the OpenAI HTTP API, side by side in one run (rounds alternate which goes
first).

  python scripts/bench_tools.py [--num-requests 16] [--max-tokens 128] [--rounds=2] [--json F]

One in-process server (the default model, max_num_seqs 16) serves both sides. The tools are the
JSON schemas of jaxserve/bench/structured_schemas.py as function parameters, each request asks
for one of them with its prompt and names it in tool_choice (so the structured-output engine
enforces the arguments); greedy. Each request without tools asks the same messages, ignores EOS
and runs exactly as many tokens as the same request's tool call took (read from a first tool
run), so both sides prefill and decode the same amounts. Reports each side's output tokens/s
(completion tokens over the wall time of the whole concurrent batch) and their ratio; checks
that every call's arguments parse as JSON. Prints JSON; --json writes it too. It measures and
never asserts a speed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import httpx

from jaxserve.bench.structured_schemas import JSON_SCHEMAS, PROMPTS
from jaxserve.config import EngineConfig
from jaxserve.engine.async_engine import AsyncEngine
from jaxserve.engine.engine import Engine
from jaxserve.entrypoints.grpc.background import ServerThread
from jaxserve.entrypoints.openai.http_server import HttpServer, HttpSettings

TOOLS = [{"type": "function", "function": {"name": name, "parameters": schema}}
         for name, schema in JSON_SCHEMAS.items()]


def bodies(n: int, max_tokens: int) -> list[dict]:
    names = list(JSON_SCHEMAS)
    out = []
    for i in range(n):
        name = names[i % len(names)]
        out.append({"model": "default", "temperature": 0.0, "max_tokens": max_tokens,
                    "messages": [{"role": "user", "content": PROMPTS[name]}],
                    "tools": TOOLS, "tool_choice": {"type": "function",
                                                    "function": {"name": name}}})
    return out


async def side(url: str, requests: list[dict]) -> tuple[float, list[dict]]:
    """(wall seconds, responses) of the requests sent at once."""
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        start = time.perf_counter()
        answers = await asyncio.gather(*(client.post("/v1/chat/completions", json=body)
                                         for body in requests))
        wall = time.perf_counter() - start
    for answer in answers:
        answer.raise_for_status()
    return wall, [a.json() for a in answers]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-requests", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    engine = Engine(EngineConfig.from_kwargs(model="default", max_num_seqs=16), progress=False)
    async_engine = AsyncEngine(engine)
    async_engine.start()
    server = ServerThread(async_engine)
    http = server.call(HttpServer.start("127.0.0.1", HttpSettings(port=0,
                                                                 served_model_name="default")),
                       60)
    http.attach(async_engine)
    try:
        tool_bodies = bodies(args.num_requests, args.max_tokens)
        _, first = asyncio.run(side(http.url, tool_bodies))  # (also warms the grammar cache)
        lengths = [r["usage"]["completion_tokens"] for r in first]
        plain_bodies = [{k: v for k, v in body.items() if k not in ("tools", "tool_choice")}
                        | {"max_tokens": n, "ignore_eos": True}
                        for body, n in zip(tool_bodies, lengths)]
        walls = {"tools": [], "plain": []}
        for r in range(args.rounds):
            order = ("tools", "plain") if r % 2 == 0 else ("plain", "tools")
            for name in order:
                wall, answers = asyncio.run(side(http.url, tool_bodies if name == "tools"
                                                 else plain_bodies))
                walls[name].append(wall)
                if name == "tools":
                    for answer in answers:
                        call = answer["choices"][0]["message"]["tool_calls"][0]
                        json.loads(call["function"]["arguments"])  # always valid JSON
        tokens = sum(lengths)
        rate = {name: tokens / min(w) for name, w in walls.items()}
        result = {"num_requests": args.num_requests, "max_tokens": args.max_tokens,
                  "rounds": args.rounds, "output_tokens_per_side": tokens,
                  "walls_s": walls, "output_tok_s": rate,
                  "tools_over_plain": rate["tools"] / rate["plain"]}
    finally:
        server.call(http.shutdown(timeout=1), 60)
        server.stop(timeout=1.0)
        async_engine.stop(timeout=10.0)
    print(json.dumps(result, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
