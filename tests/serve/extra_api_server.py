"""TESTING ONLY: `python -m tests.serve.extra_api_server` is `python -m k3jax.serve` with the Messages
and Responses routes (serve/api_anthropic.py, serve/api_responses.py) added to its app, for their
tests, until serve/api_server.py's `build_app` adds them itself; `start` runs it for a test module."""

import os
import subprocess
import sys

import k3jax.serve
from serve import api_server
from serve.api_anthropic import add_messages_routes
from serve.api_responses import add_responses_routes
from tests.serve.test_server import API_KEY, Server, _wait_for_url


def build_app(engine, config):
    app = api_server.build_app(engine, config)
    add_messages_routes(app, engine, config)
    add_responses_routes(app, engine, config)
    return app


def start(tmp_path_factory):
    """A module fixture's server (yields it): k3-tiny in float32 with the test hooks, 2 running
    sequences and 16-token steps, as tests/serve/test_server.py's."""
    log = tmp_path_factory.mktemp("server") / "server.log"
    env = {**os.environ, "K3JAX_CACHE": str(tmp_path_factory.mktemp("cache"))}
    command = [sys.executable, "-m", "tests.serve.extra_api_server", "--port", "0", "--dtype", "float32",
               "--api-key", API_KEY, "--max-model-len", "1024", "--max-num-seqs", "2", "--max-num-batched-tokens",
               "16", "--max-num-partial-prefills", "1", "--enable-test-hooks", "--log-level", "warning"]
    with open(log, "w") as stderr:
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=stderr, text=True, env=env,
                                   cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    try:
        yield Server(_wait_for_url(process, log))
    finally:
        process.terminate()
        process.wait(timeout=60)


if __name__ == "__main__":
    k3jax.serve.build_app = build_app
    sys.exit(k3jax.serve.main())
