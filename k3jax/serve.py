"""`python -m k3jax.serve`: the OpenAI-compatible server entry point.

The engine and HTTP server are the [engine] and [server] issues; until they land this command says
so and exits with an error instead of pretending to serve.
"""

import sys


def main() -> int:
    print("k3jax.serve: the serving engine and the OpenAI-compatible server are not implemented yet "
          "(issues [engine] and [server]); the model itself is usable through k3jax.from_pretrained.",
          file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
