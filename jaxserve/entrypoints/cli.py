"""The `jaxserve` command: serve | generate | chat | convert | bench.

Every engine setting is a flag with the same name (`max_num_seqs` -> `--max-num-seqs`),
declared once with its help in its group (config/groups.py) and turned into flags by
cli_flags.py; vLLM's names are accepted too (`--block-size`, `--swap-space 4` in GiB,
`--gpu-memory-utilization`, ...).
`--log-level` and `--log-format` go before or after the subcommand. This module only parses
arguments and dispatches; the work lives in the modules it calls.
"""

from __future__ import annotations

import argparse
import os
import sys

from jaxserve.config import ENV_API_KEY, compatibility
from jaxserve.entrypoints import distributed, logging_setup
from jaxserve.entrypoints.cli_flags import (BoolFlag, add_engine_flags, add_reasoning_flags,
                                            add_sampling_flags, add_security_flags,
                                            add_tool_call_flags, engine_config_from_args,
                                            reasoning_settings_from_args, sampling_overrides,
                                            security_config_from_args, size_type,
                                            tool_call_settings_from_args)

__all__ = ["build_parser", "main", "engine_config_from_args"]


def _global_flags(parser: argparse.ArgumentParser, top: bool) -> None:
    """On the top parser with defaults; on each subcommand with none, so `jaxserve serve
    --log-level DEBUG` sets it and leaving it out keeps what was given before `serve`."""
    hide = {} if top else {"default": argparse.SUPPRESS}
    group = parser.add_argument_group("logging (before or after the subcommand)")
    group.add_argument("--log-level", type=str.upper, choices=logging_setup.LEVELS,
                       **({"default": "INFO"} if top else hide),
                       help="log threshold; other libraries' records below WARNING are hidden "
                            "unless DEBUG; default: INFO")
    group.add_argument("--log-format", choices=logging_setup.FORMATS,
                       **({"default": "text"} if top else hide),
                       help="text (timestamped lines) or json (one object per line); "
                            "default: text")


def _resolve_model(args) -> None:
    """`jaxserve serve MODEL` (vLLM's positional) or --model; both must agree."""
    tag = getattr(args, "model_tag", None)
    if tag is not None and args.model is not None and tag != args.model:
        raise ValueError(f"two models given: {tag!r} (positional) and --model {args.model!r}")
    args.model = tag or args.model


def _claim_device_memory(args) -> None:
    """A command that builds an engine: XLA's GPU allocator gets the engine's
    gpu_memory_utilization of the card (given, or the GPU default; none when num_pages or
    kv_cache_memory sizes the pool) before the JAX backend starts (engine/device_memory.py)."""
    if not hasattr(args, "gpu_memory_utilization"):
        return
    from jaxserve.engine.device_memory import claim_device_memory
    from jaxserve.model.device.defaults import GPU

    cache = engine_config_from_args(args).cache
    fraction = cache.gpu_memory_utilization
    if fraction is None and cache.num_pages is None and cache.kv_cache_memory is None:
        fraction = GPU.gpu_memory_utilization
    claim_device_memory(fraction)


def _connect(args) -> dict:
    """JaxServeClient's key and TLS keywords from the client flags."""
    return dict(api_key=args.api_key, tls=args.tls, ssl_ca_certs=args.ssl_ca_certs,
                ssl_certfile=args.ssl_certfile, ssl_keyfile=args.ssl_keyfile)


def _wait_ready(args) -> None:
    from jaxserve.bench.targets import wait_until_serving
    from jaxserve.entrypoints.grpc.client import JaxServeClient
    if args.wait_ready > 0:
        with JaxServeClient(args.address, **_connect(args)) as client:
            wait_until_serving(client, args.wait_ready)


def _offline_engine(args):
    from jaxserve.engine.engine import Engine
    # One prompt or one conversation: small buckets compile fastest, unless the user asked.
    if args.max_num_seqs is None and args.max_num_batched_tokens is None:
        args.max_num_seqs, args.max_num_batched_tokens = 1, 16
    return Engine(engine_config_from_args(args), progress=not args.quiet)


def cmd_generate(args) -> int:
    from jaxserve.engine.generation_defaults import read_generation_defaults, sampling_params
    if not args.offline:
        from jaxserve.entrypoints.grpc.client import JaxServeError, stream_generate
        try:
            _wait_ready(args)
            params = sampling_params(sampling_overrides(args))
            for delta in stream_generate(args.address, args.prompt, params, chat=args.chat,
                                         **_connect(args)):
                sys.stdout.write(delta)
                sys.stdout.flush()
        except JaxServeError as exc:
            print(f"\njaxserve: error: {exc}", file=sys.stderr)
            return 1
        sys.stdout.write("\n")
        return 0
    params = sampling_params(sampling_overrides(args), read_generation_defaults(args.model))
    with _offline_engine(args) as engine:
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


def cmd_chat(args) -> int:
    from jaxserve.entrypoints import chat_cli
    from jaxserve.engine.generation_defaults import read_generation_defaults
    overrides = sampling_overrides(args)
    if not args.offline:
        from jaxserve.entrypoints.grpc.client import JaxServeError
        try:
            _wait_ready(args)
            return chat_cli.run_chat(
                chat_cli.remote_backend(args.address, overrides, **_connect(args)),
                system=args.system)
        except JaxServeError as exc:
            print(f"\njaxserve: error: {exc}", file=sys.stderr)
            return 1
    with _offline_engine(args) as engine:
        backend = chat_cli.offline_backend(engine, overrides, read_generation_defaults(args.model))
        return chat_cli.run_chat(backend, system=args.system)


def http_settings_from_args(args):
    """The OpenAI HTTP front end's settings, or None when --http-port is 0."""
    from jaxserve.entrypoints.openai.http_server import HttpSettings
    if args.http_port == 0:
        return None
    template = None
    if args.chat_template is not None:
        with open(args.chat_template, encoding="utf-8") as f:
            template = f.read()
    return HttpSettings(port=args.http_port, served_model_name=args.served_model_name,
                        chat_template=template, max_body_bytes=args.http_max_body_bytes,
                        enable_rollout_endpoints=args.enable_rollout_endpoints)


def cmd_serve(args) -> int:
    from jaxserve.entrypoints.serve import run_server
    # read by model/loaders/hub_cache.py when the model loads (and by huggingface_hub)
    if args.offline:
        os.environ["HF_HUB_OFFLINE"] = "1"
    security = security_config_from_args(args)  # refused here, before the model loads
    reasoning = reasoning_settings_from_args(args)  # (an unknown parser too)
    return run_server(engine_config_from_args(args), host=args.host, port=args.port,
                      shutdown_timeout=args.shutdown_timeout, metrics_port=args.metrics_port,
                      http=http_settings_from_args(args), security=security,
                      reasoning=reasoning, tool_calls=tool_call_settings_from_args(args),
                      data_parallel_size=args.data_parallel_size)


def cmd_convert(args) -> int:
    from jaxserve.model.loaders.loader import convert
    convert(args.src, args.dst, quantization=args.quantization)
    print(f"wrote {args.dst}")
    return 0


def cmd_bench(args) -> int:
    if args.bench_command == "offline":
        from jaxserve.bench.offline import run_offline_bench
        return run_offline_bench(args, engine_config_from_args(args))
    if args.bench_command == "overhead":
        try:
            from jaxserve.bench.overhead import main as overhead_main
        except ImportError as exc:
            print(f"jaxserve: error: bench overhead is unavailable: {exc}", file=sys.stderr)
            return 2
        return overhead_main(args)
    if args.bench_command == "prefix-tier":
        from jaxserve.bench.prefix_tier import main as prefix_tier_main
        return prefix_tier_main(args, engine_config_from_args(args))
    from jaxserve.bench.serve import run_serve_bench
    return run_serve_bench(args)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return value


def _add_serve(sub) -> None:
    serve = sub.add_parser("serve", help="serve the gRPC Generate API and the OpenAI HTTP API",
                           description="Serve MODEL over gRPC and the OpenAI HTTP API.")
    serve.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                       help="the model, as --model (vLLM's `vllm serve MODEL`); default: the "
                            "embedded SmolLM2-135M-Instruct")
    _global_flags(serve, top=False)
    add_engine_flags(serve)
    front = serve.add_argument_group("front ends")
    front.add_argument("--host", default="127.0.0.1",
                       help="address both front ends listen on; default: 127.0.0.1")
    front.add_argument("--port", type=int, default=50051,
                       help="gRPC port (0: a free one; vLLM's --port is its HTTP port, here "
                            "--http-port); default: 50051")
    front.add_argument("--http-port", type=int, default=8000,
                       help="OpenAI-compatible HTTP API port (0 turns it off); default: 8000")
    front.add_argument("--served-model-name", default=None,
                       help="HTTP: the model name clients send; default: the model's own "
                            "(vLLM: same name)")
    front.add_argument("--chat-template", default=None, metavar="FILE",
                       help="HTTP: a Jinja chat template overriding the model's (vLLM: same "
                            "name); default: the model's")
    front.add_argument("--http-max-body-bytes", type=size_type("B"), default=16 << 20,
                       metavar="SIZE", help="HTTP: larger request bodies get 413; size: 16MiB, "
                                            "a plain number is in bytes; default: 16MiB")
    front.add_argument("--enable-rollout-endpoints", action="store_true",
                       help="HTTP: serve /sleep, /wake_up, /is_sleeping, /pause, /resume, "
                            "/is_paused and /update_weights_from_disk (docs/rollouts.md); off: "
                            "404 (vLLM: VLLM_SERVER_DEV_MODE=1, also read)")
    front.add_argument("--metrics-port", type=int, default=None,
                       help="also serve Prometheus metrics at http://HOST:PORT/metrics (plain "
                            "HTTP, no key: docs/security.md); default: off")
    front.add_argument("--data-parallel-size", "-dp", type=_positive_int, default=1,
                       metavar="N", help="engine processes behind these front ends, each on "
                       "its own devices (CPU: its share of the cores); requests go to the one "
                       "with the most prefix-cache overlap, then the least queued work "
                       "(docs/scale_out.md) (vLLM: same name); default: 1")
    front.add_argument("--shutdown-timeout", type=float, default=30.0,
                       help="seconds to drain in-flight requests after SIGTERM; default: 30")
    serve.add_argument("--offline", action="store_true",
                       help="never contact the Hugging Face hub: a hub id must already be in "
                            "the local cache (sets HF_HUB_OFFLINE=1); default: a hub id not in "
                            "the cache is downloaded")
    add_reasoning_flags(serve)
    add_security_flags(serve)
    add_tool_call_flags(serve)
    serve.set_defaults(func=cmd_serve)


def _add_client_flags(parser, what: str) -> None:
    group = parser.add_argument_group("where to run")
    group.add_argument("--address", default="127.0.0.1:50051",
                       help="the gRPC server (jaxserve serve); default: 127.0.0.1:50051")
    group.add_argument("--offline", action="store_true",
                       help=f"{what} in-process (engine flags apply) instead of on a server")
    group.add_argument("--wait-ready", type=float, default=0.0, metavar="SECONDS",
                       help="wait up to SECONDS for the server's health to be SERVING (start "
                            "it and this at once); default: 0, no wait")
    group.add_argument("--quiet", action="store_true", help="--offline: no progress bars")
    env_key = os.environ.get(ENV_API_KEY, "").split(",")[0].strip() or None
    group.add_argument("--api-key", default=env_key,
                       help="the server's API key, sent as 'authorization: Bearer KEY'; "
                            "default: $JAXSERVE_API_KEY (its first key), else none")
    group.add_argument("--tls", action=BoolFlag, default=False,
                       help="connect over TLS, trusting the system's CAs (on when any --ssl-* "
                            "flag is given); default: off")
    group.add_argument("--ssl-ca-certs", default=None, metavar="FILE",
                       help="TLS: PEM CA certificates to trust; default: the system's")
    group.add_argument("--ssl-certfile", default=None, metavar="FILE",
                       help="TLS: this client's PEM certificate, for a server started with "
                            "--ssl-ca-certs (with --ssl-keyfile); default: none")
    group.add_argument("--ssl-keyfile", default=None, metavar="FILE",
                       help="TLS: the private key of --ssl-certfile; default: none")


def _add_generate(sub) -> None:
    gen = sub.add_parser("generate", help="complete one prompt, streamed to the terminal")
    gen.add_argument("prompt", help="the prompt text")
    _global_flags(gen, top=False)
    _add_client_flags(gen, "run the engine")
    gen.add_argument("--chat", action=BoolFlag, default=False,
                     help="wrap the prompt as a user message through the chat template; "
                          "default: off")
    add_sampling_flags(gen)
    add_engine_flags(gen)
    gen.set_defaults(func=cmd_generate)


def _add_chat(sub) -> None:
    chat = sub.add_parser("chat", help="chat with the model in the terminal (its chat template)")
    _global_flags(chat, top=False)
    _add_client_flags(chat, "run the engine")
    chat.add_argument("--system", default=None,
                      help="a system message opening the conversation; default: none")
    add_sampling_flags(chat)
    add_engine_flags(chat)
    chat.set_defaults(func=cmd_chat)


def _add_bench(sub) -> None:
    from jaxserve.bench.offline import add_offline_flags
    bench = sub.add_parser("bench", help="benchmarks: offline, serve, overhead, prefix-tier")
    _global_flags(bench, top=False)
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    offline = bench_sub.add_parser("offline", help="throughput and latency through LLM")
    _global_flags(offline, top=False)
    add_engine_flags(offline)
    add_offline_flags(offline)
    from jaxserve.bench.serve import add_serve_flags
    serve_bench = bench_sub.add_parser(
        "serve", help="load a running server over gRPC or the OpenAI HTTP API")
    _global_flags(serve_bench, top=False)
    add_serve_flags(serve_bench)
    overhead = bench_sub.add_parser(
        "overhead", help="host overhead per engine step (jaxserve/bench/overhead.py)")
    _global_flags(overhead, top=False)
    try:
        from jaxserve.bench.overhead import add_arguments
    except ImportError:  # not written yet: the subcommand says so when run
        pass
    else:
        add_arguments(overhead)
    from jaxserve.bench import prefix_tier
    tier = bench_sub.add_parser(
        "prefix-tier", help="returning conversations with the prefix cache's host tier on and "
        "off (jaxserve/bench/prefix_tier.py)")
    _global_flags(tier, top=False)
    add_engine_flags(tier)
    prefix_tier.add_arguments(tier)
    bench.set_defaults(func=cmd_bench)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jaxserve", description=__doc__.splitlines()[0])
    _global_flags(parser, top=True)
    sub = parser.add_subparsers(dest="command", required=True)
    _add_serve(sub)
    _add_generate(sub)
    _add_chat(sub)
    conv = sub.add_parser("convert", help="write an Orbax checkpoint (+ config, tokenizer)")
    conv.add_argument("src", help="the model to convert, as --model")
    conv.add_argument("dst", help="the checkpoint directory to write")
    conv.add_argument("--quantization", default="none", choices=("none", "int8", "int4"),
                      help="store the weights quantized (restored in that form, straight into "
                           "the device and tensor-parallel layout); default: none")
    _global_flags(conv, top=False)
    conv.set_defaults(func=cmd_convert)
    _add_bench(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging_setup.configure(args.log_level, args.log_format)
    try:
        if hasattr(args, "model"):
            _resolve_model(args)
        _claim_device_memory(args)  # before anything starts a JAX backend
        # Multi-host: every process joins the JAX cluster first; process 0 runs the command
        # (its engine stops the followers when it closes), the others run its plans
        # (jaxserve/entrypoints/distributed.py).
        cluster = distributed.settings_from_args(args)
        compatibility.check_data_parallel(getattr(args, "data_parallel_size", 1),
                                          multi_host=cluster.enabled)
        joined = distributed.join_cluster(cluster)
        if joined and not distributed.is_leader():
            return distributed.follow(engine_config_from_args(args))
        return args.func(args) or 0
    except (ValueError, OSError) as exc:
        print(f"jaxserve: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
