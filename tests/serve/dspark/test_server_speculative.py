"""`python -m k3jax.serve --speculative-config ...` with the synthetic k3-tiny DSpark draft drafting
probabilistically: greedy and sampled requests complete (sampled ones reproducibly under a seed),
streamed and whole outputs agree, /metrics carries the acceptance counters, and a bad config is
refused at the command line naming the key."""

import json
import os
import subprocess
import sys

import pytest

from convert import synth
from k3jax.serve import parse_args
from tests.serve.test_server import API_KEY, LONG, MODEL, TEXT_ONLY, Server, _wait_for_url, wait_idle

K = 3


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    draft = tmp_path_factory.mktemp("draft")
    synth.main(["--preset", "k3-tiny-dspark", "--out", str(draft)])
    log = tmp_path_factory.mktemp("server") / "server.log"
    env = {**os.environ, "K3JAX_CACHE": str(tmp_path_factory.mktemp("cache"))}
    spec = {"method": "dspark", "model": str(draft), "num_speculative_tokens": K,
            "draft_sample_method": "probabilistic"}
    command = [sys.executable, "-m", "k3jax.serve", "--port", "0", "--dtype", "float32", "--api-key", API_KEY,
               "--max-model-len", "256", "--max-num-seqs", "2", "--max-num-batched-tokens", "16",
               "--max-num-partial-prefills", "1", "--speculative-config", json.dumps(spec), "--log-level", "warning",
               *TEXT_ONLY]
    with open(log, "w") as stderr:
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=stderr, text=True, env=env,
                                   cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__)))))
    try:
        yield Server(_wait_for_url(process, log))
    finally:
        process.terminate()
        process.wait(timeout=60)


def test_speculative_server_streams_what_it_returns_and_counts_drafts(server):
    client = server.client()
    args = {"model": MODEL, "prompt": "speculate", "max_tokens": 12, "temperature": 0.0, "extra_body": LONG}

    def alone(**kwargs):  # each compared request alone: the same programs on the same inputs, bit-identical
        wait_idle(server)
        return client.completions.create(**{**args, **kwargs})

    whole = alone()
    streamed = "".join(chunk.choices[0].text for chunk in alone(stream=True))
    assert whole.usage.completion_tokens == 12 and streamed == whole.choices[0].text
    sampled = [alone(temperature=1.0, seed=3) for _ in range(2)]
    assert sampled[0].usage.completion_tokens == 12 and sampled[0].choices[0].text == sampled[1].choices[0].text

    metrics = server.metrics()
    drafted = metrics["k3jax:spec_decode_num_draft_tokens_total"]
    assert drafted > 0 and metrics["k3jax:spec_decode_num_drafts_total"] * K >= drafted
    assert metrics["k3jax:spec_decode_num_accepted_tokens_total"] <= drafted
    per_position = [metrics.get(f'k3jax:spec_decode_num_accepted_tokens_per_pos_total{{position="{j}"}}', 0)
                    for j in range(K)]
    assert sum(per_position) == metrics["k3jax:spec_decode_num_accepted_tokens_total"]
    assert 1 <= metrics["k3jax:spec_decode_mean_accepted_length"] <= K + 1


@pytest.mark.parametrize("config, names", [
    ('{"method": "eagle", "model": "d"}', "method"),
    ('{"model": "d", "num_speculative_tokens": 0}', "num_speculative_tokens"),
    ('{"method": "dspark"}', "model"),
    ('{"model": "d", "draft_tokens": 3}', "draft_tokens"),
    ("{not json", "JSON"),
])
def test_a_bad_speculative_config_is_refused_naming_the_key(config, names, capsys):
    with pytest.raises(SystemExit):
        parse_args(["--speculative-config", config])
    assert names in capsys.readouterr().err


def test_the_shipped_draft_is_found_by_name(tmp_path, monkeypatch):
    """"k3-tiny-dspark" names the draft shipped in k3jax/weights (a DSpark checkpoint that loads next
    to the embedded k3-tiny); an existing directory of that name, or any other path, is taken as given."""
    import json
    import os

    from k3jax.dspark.config import DSparkConfig
    from serve.dspark.speculation import parse_config

    found = parse_config({"model": "k3-tiny-dspark"})["model"]
    assert os.path.isabs(found) and found.endswith(os.path.join("k3jax", "weights", "k3-tiny-dspark"))
    with open(os.path.join(found, "config.json")) as f:
        assert DSparkConfig.from_dict(json.load(f)).block_size >= 1
    local = tmp_path / "k3-tiny-dspark"
    local.mkdir()
    monkeypatch.chdir(tmp_path)
    assert parse_config({"model": "k3-tiny-dspark"})["model"] == "k3-tiny-dspark"
    assert parse_config({"model": "/no/such/draft"})["model"] == "/no/such/draft"
