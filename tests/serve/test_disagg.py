"""Prefill/decode disaggregation (serve/disagg) on one machine as two processes.

The prefill side is `python -m k3jax.serve --role prefill` in a subprocess (one for the module); the
decode side is an engine in this process with the same options, beside a combined engine, the
reference: the prompt computed and decoded by one engine, as without disaggregation. Both serve the
embedded k3-tiny in fp32. The decode engine computes only the last prompt token (the prefill server
hands over the rest) and must give the combined engine's greedy tokens, and its logprobs to fp32's
tolerance: its last prompt token is a chunk of its own, as after a prefix-cache hit, where the
combined engine computed it inside the prompt's last chunk. A handoff whose KDA state or conv
window is zeroed must give other numbers: a transport that dropped them would otherwise pass.
The same through `jax.experimental.transfer` between the two processes, and through the decode
server's HTTP app. Bad input (another engine's fingerprint, a malformed frame, a handoff that does
not fit, an answer for another request, bad role flags) is a clear error and the prefill server goes
on answering. In-process only: a handoff committed to one device written into a mesh's pools.
"""

import asyncio
import dataclasses
import json
import os
import select
import socket
import struct
import subprocess
import sys
import time

import numpy as np
import pytest

from k3jax.loading import from_pretrained
from serve.disagg import frames
from serve.disagg.decode import DecodeEngine, PrefillClient, PrefillError
from serve.disagg.handoff import Handoff, Prefilled, fingerprint, pool_specs
from serve.engine import Engine, EngineOptions
from serve import runner
from serve.llm import default_model_dir, load_tokenizer
from serve.sampling import SamplingParams
from tests.serve.test_server import TEXT_ONLY

OPTIONS = dict(max_model_len=64, max_num_seqs=1, max_num_batched_tokens=16, max_prefill_chunk=16, max_prefill_rows=1,
               block_size=4)
FLAGS = ["--max-model-len", "64", "--max-num-seqs", "1", "--max-num-batched-tokens", "16",
         "--max-num-partial-prefills", "1", "--block-size", "4", "--dtype", "float32", *TEXT_ONLY]
# k3-tiny's tokens 0..255 are bytes. 2 tokens: one handed over; 9: two full pages handed over; 40: a
# prefill of three chunks, 39 tokens on 10 pages
TEXT = b"def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n"
PROMPTS = [list(TEXT[:n]) for n in (2, 9, 40)]
MAX_TOKENS = 8
# logprobs; measured at most 5e-6 (tests/agreement.py lets fp32 paths move logits by 2^-11 of the largest)
TOLERANCE = 1e-3
STARTUP_TIMEOUT_S = 300


def greedy():
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2)


def generate(engine, prompt):
    return engine.generate([prompt], [greedy()])[0]


def logprob_gap(a, b) -> float:
    """Largest difference between two outputs' logprobs of the tokens both list (inf if the tokens differ)."""
    if a.token_ids != b.token_ids:
        return float("inf")
    return max(abs(x[t] - y[t]) for x, y in zip(a.logprobs, b.logprobs) for t in x.keys() & y.keys())


@pytest.fixture(scope="module")
def prefill_address(tmp_path_factory):
    """`python -m k3jax.serve --role prefill` on k3-tiny fp32; its --transfer-port's HOST:PORT."""
    log = tmp_path_factory.mktemp("prefill") / "server.log"
    env = {**os.environ, "K3JAX_CACHE": str(tmp_path_factory.mktemp("cache"))}
    command = [sys.executable, "-m", "k3jax.serve", "--role", "prefill", "--port", "0", "--transfer-port", "0",
               "--log-level", "warning", *FLAGS]
    with open(log, "w") as stderr:
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=stderr, text=True, env=env,
                                   cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    try:
        address, deadline = None, time.monotonic() + STARTUP_TIMEOUT_S
        while address is None and select.select([process.stdout], [], [], max(deadline - time.monotonic(), 0))[0]:
            line = process.stdout.readline()
            if "prefill handoffs at" in line:
                address = line.split()[-1]
            elif not line:
                break
        if address is None:
            pytest.fail(f"the prefill server did not start:\n{log.read_text()[-5000:]}")
        yield address
    finally:
        process.terminate()
        process.wait(timeout=60)


@pytest.fixture(scope="module")
def model():
    return from_pretrained(default_model_dir(), dtype="float32")


@pytest.fixture(scope="module")
def engines(model):
    """(combined, decode): the same options, so the decode engine runs the combined one's compiled steps."""
    tokenizer = load_tokenizer(default_model_dir())
    return tuple(Engine(model, EngineOptions(**OPTIONS), tokenizer=tokenizer) for _ in range(2))


@pytest.fixture(scope="module")
def expected(engines):
    return [generate(engines[0], prompt) for prompt in PROMPTS]


def test_the_decode_engine_continues_as_the_combined_engine(prefill_address, engines, expected):
    decode = engines[1]
    client = PrefillClient(prefill_address, decode)
    for prompt, reference in zip(PROMPTS, expected):
        prefilled = asyncio.run(client.prefill(prompt))
        assert prefilled.handoff.num_tokens == len(prompt) - 1
        before = decode.stats()["num_computed_prompt_tokens"]
        out = generate(decode, prefilled)
        assert decode.stats()["num_computed_prompt_tokens"] - before == 1  # the last prompt token only
        assert out.token_ids == reference.token_ids
        assert logprob_gap(out, reference) < TOLERANCE


@pytest.mark.parametrize("part", ["state", "conv"])
def test_a_handoff_without_its_kda_part_gives_other_output(prefill_address, engines, expected, part):
    """The control of the test above: zero the KDA layers' recurrent state or conv window in transit
    (MLA pages intact) and the output moves far beyond the tolerance."""
    decode = engines[1]
    prefilled = asyncio.run(PrefillClient(prefill_address, decode).prefill(PROMPTS[2]))
    assert np.any(np.asarray(getattr(prefilled.handoff, part)) != 0)
    dropped = dataclasses.replace(prefilled.handoff, **{part: np.zeros_like(getattr(prefilled.handoff, part))})
    out = generate(decode, Prefilled(prefilled.ids, dropped))
    assert logprob_gap(out, expected[2]) > 10 * TOLERANCE


def test_the_jax_transfer_backend_hands_over_the_same_cache(prefill_address, engines, expected):
    """jax.experimental.transfer between the two processes: the arrays the socket brings, pulled from the
    prefill process's transfer server (on this CPU build too), and the combined engine's output,
    without compiling the steps again for arrays committed to the device."""
    decode = engines[1]
    by_socket = asyncio.run(PrefillClient(prefill_address, decode).prefill(PROMPTS[2]))
    by_jax = asyncio.run(PrefillClient(prefill_address, decode, "jax").prefill(PROMPTS[2]))
    pages = by_socket.handoff.num_pages(OPTIONS["block_size"])
    np.testing.assert_array_equal(np.asarray(by_jax.handoff.pages)[:pages], by_socket.handoff.pages)
    for part in ("conv", "state"):
        np.testing.assert_array_equal(np.asarray(getattr(by_jax.handoff, part)), getattr(by_socket.handoff, part))
    steps = runner._step._cache_size()
    assert logprob_gap(generate(decode, by_jax), expected[2]) < TOLERANCE
    assert runner._step._cache_size() == steps  # the pulled arrays are committed to the device, as the pools are


def test_the_decode_server_answers_completions_from_handed_off_prompts(prefill_address, engines, expected):
    """The HTTP side: a --role decode app (DecodeEngine) answers /v1/completions with the combined
    engine's tokens; a decode server whose prefill server is gone answers 503, and still serves."""
    from fastapi.testclient import TestClient

    from serve.api_common import ServerConfig
    from serve.api_server import build_app

    decode = engines[1]
    body = {"model": "k3-tiny", "prompt": PROMPTS[1], "max_tokens": MAX_TOKENS, "temperature": 0.0,
            "ignore_eos": True, "logprobs": 2}  # greedy() as sent by a client
    config = ServerConfig(model_name="k3-tiny", model_path=default_model_dir())
    with TestClient(build_app(DecodeEngine(decode, PrefillClient(prefill_address, decode), max_queued_requests=4),
                              config)) as client:
        response = client.post("/v1/completions", json={**body, "n": 2})
    assert response.status_code == 200, response.text
    choices = response.json()["choices"]
    assert [c["text"] for c in choices] == [expected[1].text] * 2
    assert max(abs(got - entry[token]) for c in choices for got, entry, token
               in zip(c["logprobs"]["token_logprobs"], expected[1].logprobs, expected[1].token_ids)) < TOLERANCE
    with socket.socket() as closed:  # a port nobody listens on
        closed.bind(("127.0.0.1", 0))
        gone = "127.0.0.1:%d" % closed.getsockname()[1]
    with TestClient(build_app(DecodeEngine(decode, PrefillClient(gone, decode), max_queued_requests=4),
                              config)) as client:
        unreachable = client.post("/v1/completions", json=body)
        local = client.post("/v1/completions", json={**body, "prompt": PROMPTS[0][:1]})  # one token: computed here
    assert unreachable.status_code == 503 and "prefill server is unreachable" in unreachable.json()["error"]["message"]
    assert local.status_code == 200


def test_bad_input_is_a_clear_error_and_the_prefill_server_goes_on(prefill_address, model, engines):
    host, port = prefill_address.rsplit(":", 1)

    def raw(header: bytes, payload: bytes = b"") -> dict:
        """The error message the server answers a frame of these bytes with."""
        with socket.create_connection((host, int(port)), timeout=60) as connection:
            connection.sendall(struct.pack("!QI", len(payload), len(header)) + header + payload)
            reply = b""
            while chunk := connection.recv(1 << 16):
                reply += chunk
        answer = json.loads(reply[12:12 + struct.unpack("!QI", reply[:12])[1]])
        assert answer["type"] == "error"
        return answer["message"]

    other = Engine(model, EngineOptions(**{**OPTIONS, "kv_cache_dtype": "bfloat16"}))  # pools only: nothing compiles
    with pytest.raises(PrefillError, match=r"kv_cache_dtype: 'float32' \(prefill\), 'bfloat16' \(decode\)") as error:
        asyncio.run(PrefillClient(prefill_address, other).hello())
    assert error.value.status == 502
    assert "not JSON" in raw(b"{x]")
    assert "do not fill" in raw(b'{"arrays": []}', b"1234")
    assert "not [shape, dtype]" in raw(b'{"arrays": [[[1], "object"]]}', b"1234")
    assert "'hello' or 'prefill'" in raw(b'{"type": "push", "arrays": []}')
    decode = engines[1]
    prefill = {"type": "prefill", "id": "x", "fingerprint": fingerprint(decode), "transport": "socket", "arrays": []}
    floats = json.dumps({**prefill, "arrays": [[[3], "float32"]]}).encode()
    assert "a prefill message carries the prompt's ids" in raw(floats, np.zeros(3, np.float32).tobytes())
    assert "transport: 'pigeon' is not one of" in raw(json.dumps({**prefill, "transport": "pigeon"}).encode())
    client = PrefillClient(prefill_address, decode)
    asyncio.run(client.hello())  # still answering

    prefilled = asyncio.run(client.prefill(PROMPTS[1]))  # the decode engine refuses what does not fit its pools
    state = prefilled.handoff.state
    with pytest.raises(ValueError, match=r"prompt: the prefilled state are \(1, \d+, \d+, 8, 16\) float32"):
        decode.add_request(Prefilled(PROMPTS[1], dataclasses.replace(prefilled.handoff, state=state[..., :8, :])))
    with pytest.raises(ValueError, match="holds 8 tokens; a prompt of 10 needs 9"):
        decode.add_request(Prefilled(PROMPTS[1] + [1], prefilled.handoff))
    assert not decode.has_unfinished()


def test_an_answer_for_another_request_is_refused(engines):
    """A prefill server that answers with another request's handoff (here a fake one) is the request's error."""
    decode = engines[1]

    async def answer_wrong(reader, writer):
        await frames.read(reader, 1 << 20)
        await frames.write(writer, {"type": "handoff", "id": "someone-else", "num_tokens": 1, "transport": {}})
        writer.close()

    async def ask():
        server = await asyncio.start_server(answer_wrong, "127.0.0.1", 0)
        async with server:
            address = "127.0.0.1:%d" % server.sockets[0].getsockname()[1]
            await PrefillClient(address, decode).prefill(PROMPTS[0])

    with pytest.raises(PrefillError, match="for request 'someone-else', not a handoff for"):
        asyncio.run(ask())


@pytest.mark.parametrize("argv, message", [
    (["--role", "decode"], "--prefill-url: needed by --role decode"),
    (["--prefill-url", "127.0.0.1:8998"], "--prefill-url: needed by --role decode, and only there"),
    (["--role", "decode", "--prefill-url", "nohost"], "'nohost' is not HOST:PORT"),
    (["--role", "decode", "--prefill-url", "h:1", "--enable-prefix-caching"], "not with --enable-prefix-caching"),
])
def test_role_flags_are_checked_before_anything_loads(argv, message, capsys):
    from k3jax.serve import parse_args

    with pytest.raises(SystemExit):
        parse_args(argv)
    assert message in capsys.readouterr().err


def test_a_handoff_on_one_device_is_written_into_a_meshs_pools(model):
    """A pulled handoff is committed to one device, a socket's is on the host; a decode engine on a
    mesh (1x2 here, fake CPU devices) places either on the mesh's devices, and reads back what it
    wrote. Both run the gather and scatter programs compile_transfers made (what warm-up compiles
    for a PD role): nothing compiles."""
    import jax

    from k3jax.model import K3Model
    from sharding.mesh import make_mesh
    from tests.serve.test_engine import CountCompiles

    sharded = K3Model(model.config, model.graphdef, model.params, make_mesh("1x2"))
    engine = Engine(sharded, EngineOptions(**OPTIONS))
    engine.runner.compile_transfers()
    rng = np.random.default_rng(0)
    specs = pool_specs(engine.runner.pools)
    shapes = {"pages": (4, *specs["pages"][0]), "conv": specs["conv"][0], "state": specs["state"][0]}
    for on_device in (True, False):
        arrays = {name: rng.normal(size=shape).astype(specs[name][1]) for name, shape in shapes.items()}
        written = Handoff(9, **{name: jax.device_put(a, jax.local_devices()[0]) if on_device else a
                                for name, a in arrays.items()})
        with CountCompiles() as compiles:
            engine.runner.write_state([3, 5, 7], 1, written)
            read = Handoff(9, *engine.runner.read_state([3, 5, 7], 1))
        assert compiles.count == 0, on_device
        np.testing.assert_array_equal(np.asarray(read.pages)[:3], arrays["pages"][:3])
        for part in ("conv", "state"):
            np.testing.assert_array_equal(np.asarray(getattr(read, part)), arrays[part])


def test_a_handoff_object_round_trips_the_page_padding():
    """Pages cut to what the tokens use (the socket's), padded back with zeros to the scatter's length."""
    pages = np.arange(3 * 2, dtype=np.float32).reshape(3, 1, 2, 1)
    handoff = Handoff(5, pages, np.zeros(1), np.zeros(1))
    assert handoff.num_pages(2) == 3
    np.testing.assert_array_equal(handoff.page_rows(4)[:3], pages)
    assert not handoff.page_rows(4)[3].any() and handoff.page_rows(2).shape[0] == 2
