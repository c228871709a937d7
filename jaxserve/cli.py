"""The `jaxserve` command: serve | generate | bench | convert.

Every EngineConfig field is a flag with the same name (`max_num_seqs` -> `--max-num-seqs`).
This module only parses arguments and dispatches; the work lives in the modules it calls.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
import typing

from jaxserve import distributed
from jaxserve.config import EngineConfig

_SKIP = {"model"}


def _parse_bool(text: str) -> bool:
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true/false, got {text!r}")


def _parse_size(text: str) -> int:
    """Bytes, with an optional K/M/G/T suffix (binary)."""
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
    t = text.strip().lower().removesuffix("ib").removesuffix("b")
    if t and t[-1] in units:
        return int(float(t[:-1]) * units[t[-1]])
    return int(t)


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="default",
                        help="'default' (SmolLM2-135M-Instruct), a .gguf file, a Hugging Face "
                             "directory, a jaxserve (Orbax) checkpoint directory, or a Hugging "
                             "Face hub id org/name[@revision] already in the local hub cache "
                             "(HF_HOME; never downloaded)")
    distributed.add_distributed_flags(parser)
    hints = typing.get_type_hints(EngineConfig)
    for f in dataclasses.fields(EngineConfig):
        if f.name in _SKIP:
            continue
        flag = "--" + f.name.replace("_", "-")
        hint = str(hints[f.name])
        kwargs: dict = {"default": None, "dest": f.name, "help": f"default: {f.default}"}
        if f.name in ("swap_space", "kv_cache_memory"):
            kwargs["type"] = _parse_size
        elif "bool" in hint:
            kwargs.update(type=_parse_bool, nargs="?", const=True)
        elif "tuple" in hint:
            kwargs.update(type=int, nargs="+")
        elif "int" in hint:
            kwargs["type"] = int
        parser.add_argument(flag, **kwargs)


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    settings = {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig)
                if getattr(args, f.name, None) is not None}
    return EngineConfig.from_kwargs(**settings)


def add_sampling_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--min-p", type=float, default=0.0)
    parser.add_argument("--sampling-seed", type=int, default=None,
                        help="per-request sampling seed (--seed is the engine's)")
    parser.add_argument("--stop", action="append", default=[])
    parser.add_argument("--ignore-eos", action="store_true")
    parser.add_argument("--chat", action="store_true",
                        help="wrap the prompt as a user message through the chat template")


def sampling_from_args(args):
    from jaxserve.request import SamplingParams
    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                          top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                          seed=args.sampling_seed,
                          stop=tuple(args.stop), ignore_eos=args.ignore_eos)


def cmd_generate(args) -> int:
    params = sampling_from_args(args)
    if not args.offline:
        from jaxserve.server.client import JaxServeError, stream_generate
        try:
            for delta in stream_generate(args.address, args.prompt, params, chat=args.chat):
                sys.stdout.write(delta)
                sys.stdout.flush()
        except JaxServeError as exc:
            print(f"\njaxserve: error: {exc}", file=sys.stderr)
            return 1
        sys.stdout.write("\n")
        return 0
    from jaxserve.engine import Engine
    # One prompt: one small bucket compiles fastest, unless the user asked for more.
    if args.max_num_seqs is None and args.max_num_batched_tokens is None:
        args.max_num_seqs, args.max_num_batched_tokens = 1, 16
    with Engine(engine_config_from_args(args), progress=not args.quiet) as engine:
        prompt = args.prompt
        if args.chat:
            text = engine.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
            prompt = engine.tokenizer.encode(text, add_special_tokens=False)
        engine.add_request(prompt, params)
        while engine.has_unfinished():
            for out in engine.step():
                sys.stdout.write(out.new_text)
                sys.stdout.flush()
                if out.error:
                    print(f"\nerror: {out.error}", file=sys.stderr)
                    return 1
    sys.stdout.write("\n")
    return 0


def http_settings_from_args(args):
    """The OpenAI HTTP front end's settings, or None when --http-port is 0."""
    from jaxserve.server.http_server import HttpSettings
    if args.http_port == 0:
        return None
    template = None
    if args.chat_template is not None:
        with open(args.chat_template, encoding="utf-8") as f:
            template = f.read()
    return HttpSettings(port=args.http_port, served_model_name=args.served_model_name,
                        api_key=args.api_key or os.environ.get("JAXSERVE_API_KEY") or None,
                        chat_template=template, max_body_bytes=args.http_max_body_bytes)


def cmd_serve(args) -> int:
    from jaxserve.server.grpc_server import run_server
    return run_server(engine_config_from_args(args), host=args.host, port=args.port,
                      shutdown_timeout=args.shutdown_timeout, metrics_port=args.metrics_port,
                      http=http_settings_from_args(args))


def cmd_convert(args) -> int:
    from jaxserve.model.loader import convert
    convert(args.src, args.dst)
    print(f"wrote {args.dst}")
    return 0


def cmd_bench(args) -> int:
    if args.bench_command == "offline":
        from jaxserve.bench.offline import run_offline_bench
        return run_offline_bench(args, engine_config_from_args(args))
    from jaxserve.bench.serve import run_serve_bench
    return run_serve_bench(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jaxserve", description=__doc__.splitlines()[0])
    parser.add_argument("--log-level", default="INFO")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="serve the gRPC Generate API and the OpenAI HTTP API")
    add_engine_flags(serve)
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=50051, help="gRPC port")
    serve.add_argument("--http-port", type=int, default=8000,
                       help="OpenAI-compatible HTTP API port (0 turns it off)")
    serve.add_argument("--api-key", default=None,
                       help="HTTP: require 'Authorization: Bearer KEY' (default: "
                            "$JAXSERVE_API_KEY; unset: no key)")
    serve.add_argument("--served-model-name", default=None,
                       help="HTTP: the model name clients send (default: the model's own)")
    serve.add_argument("--chat-template", default=None, metavar="FILE",
                       help="HTTP: a Jinja chat template overriding the model's")
    serve.add_argument("--http-max-body-bytes", type=_parse_size, default=16 << 20,
                       help="HTTP: larger request bodies get 413 (default 16M)")
    serve.add_argument("--metrics-port", type=int, default=None,
                       help="also serve Prometheus metrics over HTTP at "
                            "http://HOST:PORT/metrics (off unless given)")
    serve.add_argument("--shutdown-timeout", type=float, default=30.0,
                       help="seconds to drain in-flight requests after SIGTERM")
    serve.set_defaults(func=cmd_serve)

    gen = sub.add_parser("generate", help="complete one prompt, streamed to the terminal")
    gen.add_argument("prompt")
    gen.add_argument("--address", default="127.0.0.1:50051")
    gen.add_argument("--offline", action="store_true", help="run the engine in-process")
    gen.add_argument("--quiet", action="store_true", help="no progress bars")
    add_engine_flags(gen)
    add_sampling_flags(gen)
    gen.set_defaults(func=cmd_generate)

    conv = sub.add_parser("convert", help="write an Orbax checkpoint (+ config, tokenizer)")
    conv.add_argument("src")
    conv.add_argument("dst")
    conv.set_defaults(func=cmd_convert)

    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    from jaxserve.bench.offline import add_offline_flags
    offline = bench_sub.add_parser("offline", help="throughput and latency through LLM")
    add_engine_flags(offline)
    add_offline_flags(offline)
    bench.set_defaults(func=cmd_bench)
    try:
        from jaxserve.bench.serve import add_serve_flags
    except ImportError:
        pass
    else:
        serve_bench = bench_sub.add_parser(
            "serve", help="load a running server over gRPC or the OpenAI HTTP API")
        add_serve_flags(serve_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    try:
        # Multi-host: every process joins the JAX cluster first; process 0 runs the command
        # (its engine stops the followers when it closes), the others run its plans
        # (jaxserve/distributed.py).
        joined = distributed.join_cluster(distributed.settings_from_args(args))
        if joined and not distributed.is_leader():
            return distributed.follow(engine_config_from_args(args))
        return args.func(args) or 0
    except (ValueError, OSError) as exc:
        print(f"jaxserve: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
