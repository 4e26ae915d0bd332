"""`python -m k3jax.serve`: the OpenAI-compatible server (flags named as vLLM's where the concept is
the same). Without `--model` it serves the embedded k3-tiny, written on first use, so a new
machine needs nothing but this command. It loads the model, compiles the step shapes a first request
needs, binds the port and prints the URL; from then on requests are answered, while the other step
shapes compile in the background (compiled programs persist in the compilation cache, so a restart
loads them instead).

Prefill/decode disaggregation (serve/disagg): `--role prefill` also answers decode servers on
`--transfer-port` (printed before the URL); `--role decode --prefill-url HOST:PORT` has every prompt
prefilled there and generates from the handed-off cache.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import os
import socket
import sys

import jax
import uvicorn

from k3jax.loading import from_pretrained
from serve.api_server import ServerConfig, build_app
from serve.async_engine import AsyncEngine
from serve.disagg.decode import DecodeEngine, PrefillClient, PrefillError, parse_address
from serve.disagg.prefill_server import PrefillServer
from serve.disagg.transport import TransportError
from serve.dspark import speculation
from serve.engine import KV_CACHE_DTYPES, Engine, EngineOptions
from serve import multihost
from serve.multimodal import DEFAULT_IMAGE_LIMIT
from serve.llm import DEFAULT_MODEL, cache_root, default_model_dir, load_tokenizer
from sharding import distributed

LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    defaults = EngineOptions()
    parser = argparse.ArgumentParser(prog="python -m k3jax.serve", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="checkpoint directory (Hugging Face or converted); default: the "
                                        "embedded k3-tiny")
    parser.add_argument("--served-model-name", help="the name clients use in `model` (default: --model, "
                                                    "or k3-tiny)")
    parser.add_argument("--mesh", default="1x1", help="device mesh, e.g. 8x2 (see sharding/mesh.py)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000, help="0 picks a free port (the printed URL says which)")
    parser.add_argument("--api-key", help="require `Authorization: Bearer <key>` on /v1 routes")
    parser.add_argument("--dtype", default="auto", choices=("auto", "bfloat16", "float32"),
                        help="weights and activations (auto: bfloat16)")
    parser.add_argument("--max-model-len", type=int, default=defaults.max_model_len)
    parser.add_argument("--max-num-seqs", type=int, default=defaults.max_num_seqs)
    parser.add_argument("--max-num-batched-tokens", type=int, default=defaults.max_num_batched_tokens)
    parser.add_argument("--max-num-partial-prefills", type=int, default=defaults.max_prefill_rows,
                        help="prompts prefilled in one step")
    parser.add_argument("--block-size", type=int, default=defaults.block_size, help="tokens per MLA page")
    parser.add_argument("--kv-cache-memory-bytes", type=int, help="one budget for MLA pages and KDA slots (per data group on a mesh)")
    parser.add_argument("--num-gpu-blocks-override", type=int, help="exactly this many MLA pages (per data group on a mesh)")
    parser.add_argument("--kv-cache-dtype", default=defaults.kv_cache_dtype, choices=sorted(KV_CACHE_DTYPES))
    parser.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                        default=defaults.enable_prefix_caching)
    parser.add_argument("--session-cache-bytes", type=int, help="cache bytes the pins of agent sessions "
                        "(prompt_cache_key) may hold; default a quarter of the cache, 0 turns sessions off")
    parser.add_argument("--session-ttl", type=float, default=defaults.session_ttl,
                        help="seconds a session's prefix stays pinned after its last request")
    parser.add_argument("--kv-offload-bytes", type=int, default=defaults.kv_offload_bytes,
                        help="host memory that keeps the prefix cache's evicted pages and KDA snapshots, restored "
                             "instead of recomputed (needs --enable-prefix-caching; 0: off)")
    parser.add_argument("--sequence-parallel-prefill-tokens", type=int,
                        help="on a mesh with data > 1, prefill a fresh prompt of at least this many tokens on every "
                             "device, its tokens split over data (default: never)")
    parser.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=defaults.async_scheduling,
                        help="dispatch a steady decode batch's next step before this one's tokens reach the host")
    parser.add_argument("--batch-invariant", action="store_true",
                        help="each request's tokens and logprobs independent of the batch it runs in "
                             "(every step at the largest bucket; no prefix caching or speculation)")
    parser.add_argument("--seed", type=int, default=defaults.seed, help="sampling seed of requests without one")
    parser.add_argument("--speculative-config", type=_speculative_config,
                        help='JSON, e.g. \'{"method": "dspark", "model": DRAFT_DIR, "num_speculative_tokens": 7}\'')
    parser.add_argument("--max-queued-requests", type=int, default=256,
                        help="requests that may wait beyond the running batch; more get 503")
    parser.add_argument("--max-request-body-bytes", type=int, default=16 << 20, help="larger bodies get 413")
    parser.add_argument("--max-n", type=_positive, default=128, help="most choices (n, best_of) one request may "
                                                                     "ask for; more get 400")
    parser.add_argument("--allowed-local-media-path", help="a directory under which file:// image URLs may be read "
                                                          "(a security risk: for trusted clients only)")
    parser.add_argument("--limit-mm-per-prompt", type=_mm_limits, default={"image": DEFAULT_IMAGE_LIMIT},
                        help='JSON, most items per prompt by modality, e.g. \'{"image": 4}\' (default '
                             f'{DEFAULT_IMAGE_LIMIT}, as vLLM V1); more get 400. An image limit of 0 serves text '
                             'only: the vision tower is not loaded and no image step compiles')
    parser.add_argument("--shutdown-timeout", type=float, default=30.0,
                        help="seconds SIGTERM waits for open requests before cancelling them")
    parser.add_argument("--slow-reader-timeout", type=float, default=30.0,
                        help="seconds a stream may leave its output unread (beyond a buffer) before it is aborted")
    parser.add_argument("--role", choices=("prefill", "decode"),
                        help="prefill/decode disaggregation (default: neither, one engine does both)")
    parser.add_argument("--transfer-port", type=int, default=8998,
                        help="--role prefill: the port decode servers ask for prefills on (0 picks one); reachable "
                             "by decode servers only")
    parser.add_argument("--prefill-url", help="--role decode: the prefill server's HOST:PORT (its --transfer-port)")
    parser.add_argument("--transfer-backend", choices=("socket", "jax"), default="socket",
                        help="--role decode: how the cache arrays come over (socket: in the frames; jax: "
                             "jax.experimental.transfer, device to device)")
    parser.add_argument("--log-level", default="info", choices=LOG_LEVELS)
    parser.add_argument("--disable-uvicorn-access-log", action="store_true",
                        help="no log line per HTTP request (vLLM's flag): under load, each costs the server's CPU")
    # TESTING ONLY: lets chat requests force the model's output, to test the parsers end to end.
    parser.add_argument("--enable-test-hooks", action="store_true", help=argparse.SUPPRESS)
    distributed.add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        engine_options(args)  # a bad combination is a usage error, before anything loads
        _check_role(args)
    except ValueError as error:
        parser.error(str(error))
    return args


def _check_role(args: argparse.Namespace) -> None:
    if (args.role == "decode") != (args.prefill_url is not None):
        raise ValueError("--prefill-url: needed by --role decode, and only there")
    if args.prefill_url is not None:
        parse_address(args.prefill_url)
    if args.role == "decode" and (args.enable_prefix_caching or args.speculative_config is not None):
        # the prefill server caches prefixes; a draft would lack its pages of the prompt
        raise ValueError("--role decode: not with --enable-prefix-caching or --speculative-config")


def engine_options(args: argparse.Namespace) -> EngineOptions:
    return EngineOptions(max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                         max_num_batched_tokens=args.max_num_batched_tokens,
                         max_prefill_rows=args.max_num_partial_prefills, block_size=args.block_size,
                         kv_cache_memory_bytes=args.kv_cache_memory_bytes,
                         num_gpu_blocks=args.num_gpu_blocks_override, kv_cache_dtype=args.kv_cache_dtype,
                         enable_prefix_caching=args.enable_prefix_caching, seed=args.seed,
                         speculative_config=args.speculative_config, batch_invariant=args.batch_invariant,
                         async_scheduling=args.async_scheduling, session_cache_bytes=args.session_cache_bytes,
                         session_ttl=args.session_ttl, kv_offload_bytes=args.kv_offload_bytes,
                         sequence_parallel_prefill_tokens=args.sequence_parallel_prefill_tokens)


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _mm_limits(text: str) -> dict:
    """vLLM's --limit-mm-per-prompt; K3 takes images only, so another modality may only be limited to 0."""
    try:
        limits = json.loads(text)
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(f"not JSON: {error}") from None
    if not isinstance(limits, dict) or not all(isinstance(v, int) and v >= 0 for v in limits.values()):
        raise argparse.ArgumentTypeError('expected a JSON object of counts, e.g. {"image": 4}')
    if any(v for k, v in limits.items() if k != "image"):
        raise argparse.ArgumentTypeError(f"this model takes images only, not {sorted(set(limits) - {'image'})}")
    return {"image": limits.get("image", DEFAULT_IMAGE_LIMIT)}


def _speculative_config(text: str) -> dict:
    try:
        return speculation.parse_config(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _prefill_client(engine: Engine, args, log) -> PrefillClient | None:
    """--role decode: the client of the prefill server, checked against it (None: it cannot serve)."""
    try:
        prefill = PrefillClient(args.prefill_url, engine, args.transfer_backend, args.host)
        asyncio.run(prefill.hello())
    except TransportError as error:
        log.error("%s", error)
        return None
    except PrefillError as error:
        if error.status != 503:  # the engines differ
            log.error("%s", error)
            return None
        log.warning("%s: requests fail until the prefill server at %s answers", error, args.prefill_url)
    return prefill


def enable_compilation_cache() -> None:
    """Keeps compiled steps on disk (beside the embedded model, unless JAX_COMPILATION_CACHE_DIR
    says where): a restart skips most of the warm-up, which on CPU is minutes."""
    if not os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        jax.config.update("jax_compilation_cache_dir", os.path.join(cache_root(), "xla"))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        force=True)  # jax may have configured the root logger already
    distributed.initialize(args.coordinator, args.num_processes, args.process_id)

    enable_compilation_cache()
    path = args.model or default_model_dir()
    options = engine_options(args)
    log = logging.getLogger("k3jax.serve")
    log.info("loading %s", path)
    model = from_pretrained(path, dtype="bfloat16" if args.dtype == "auto" else args.dtype,
                            mesh=None if args.mesh == "1x1" else args.mesh,
                            vision=args.limit_mm_per_prompt["image"] > 0)  # 0: text only, as vLLM
    engine = Engine(model, options, tokenizer=load_tokenizer(path))
    if args.role is not None and engine.runner.spans_processes:  # the handoff's reads and writes are one process's
        log.error("--role: not on a mesh that spans several processes")
        return 1
    if engine.runner.spans_processes and not multihost.is_leader():  # process 0 serves; this one runs its steps
        log.info("process %d follows the steps of process 0", jax.process_index())
        engine.runner.follow(engine.speculator)
        return 0
    try:
        return _serve(engine, args, path, options, log)
    finally:
        engine.runner.stop_followers()


def _serve(engine: Engine, args, path: str, options: EngineOptions, log) -> int:
    limits = dict(max_queued_requests=args.max_queued_requests, stall_timeout_s=args.slow_reader_timeout)
    if args.role == "decode":  # before compiling: engines that differ serve nothing
        prefill = _prefill_client(engine, args, log)
        if prefill is None:
            return 1
        async_engine = DecodeEngine(engine, prefill, **limits)
    else:
        async_engine = AsyncEngine(engine, **limits)
    log.info("compiling the engine's step shapes (%s)", dataclasses.asdict(options))
    # What a first request needs compiles now; the other shapes compile behind the open port.
    engine.warmup(background=True, transfers=args.role is not None,
                  log=lambda done, total: log.info("compiled %d of %d step shapes", done, total))

    config = ServerConfig(model_name=args.served_model_name or args.model or DEFAULT_MODEL, model_path=path,
                          api_key=args.api_key, max_body_bytes=args.max_request_body_bytes, max_n=args.max_n,
                          allowed_local_media_path=args.allowed_local_media_path,
                          limit_mm_per_prompt=args.limit_mm_per_prompt["image"],
                          enable_test_hooks=args.enable_test_hooks)
    app = build_app(async_engine, config)
    if args.role == "prefill":
        prefill_server = PrefillServer(async_engine, args.host, args.transfer_port)
        prefill_server.start()
        print(f"k3jax.serve: prefill handoffs at {prefill_server.address}", flush=True)
    # Bound before the URL is printed: a client that reads it can connect at once (it waits in the
    # listen backlog until uvicorn accepts), and --port 0 has its real port to print.
    sock = socket.create_server((args.host, args.port))
    host, port = sock.getsockname()[:2]
    print(f"k3jax.serve: {config.model_name} at http://{host}:{port}/v1", flush=True)
    # On SIGTERM uvicorn stops accepting, waits up to --shutdown-timeout for open requests (a stalled
    # reader would hold it forever), then cancels them, which aborts their engine requests.
    uvicorn.Server(uvicorn.Config(app, log_level=args.log_level, access_log=not args.disable_uvicorn_access_log,
                                  timeout_graceful_shutdown=args.shutdown_timeout)).run(sockets=[sock])
    return 0


if __name__ == "__main__":
    sys.exit(main())
