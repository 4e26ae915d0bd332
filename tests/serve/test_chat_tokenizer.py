"""The K3 tokenizer on the synthetic checkpoint's files (convert.synth) and on a hand-made BPE file."""

import base64
import json
import random

import pytest

from convert import synth
from k3jax.config import K3Config
from k3jax.presets import PRESETS
from serve.chat import Tokenizer, TokenizerNotFound


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("k3-tiny")
    synth.write_tokenizer(out, K3Config.from_hf_dict(PRESETS["k3-tiny"]))
    return out


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir):
    return Tokenizer.from_dir(tokenizer_dir)


def test_special_tokens_come_from_tokenizer_config(tokenizer):
    # convert.synth puts K3's specials above the 256 bytes: [BOS] 256, [EOS] 258, <|end_of_msg|> 259,
    # <|open|> 260, <|close|> 261, <|sep|> 262, <|media_pad|> 277; the vocabulary is k3-tiny's 512.
    assert tokenizer.bos_token_id == 256
    assert [tokenizer.token_id(t) for t in ("<|end_of_msg|>", "<|open|>", "<|close|>", "<|sep|>", "<|media_pad|>")] \
        == [259, 260, 261, 262, 277]
    assert tokenizer.eos_token_ids == {258, 259}
    assert tokenizer.vocab_size == 512
    with pytest.raises(KeyError, match="<|im_end|>"):
        tokenizer.token_id("<|im_end|>")


@pytest.mark.parametrize("text", ["", "hello world", "héllo wörld", "中文English混合", "emoji 🌍 and\ttabs\r\n",
                                  "\x00 control \x7f"])
def test_round_trip(tokenizer, text):
    ids = tokenizer.encode(text)
    assert ids == list(text.encode())  # the synthetic vocabulary is one token per byte
    assert tokenizer.decode(ids) == text


def test_markers_are_special_only_when_allowed(tokenizer):
    text = "<|open|>think<|sep|>"
    assert tokenizer.encode(text, allow_special=True) == [260, *b"think", 262]
    assert tokenizer.encode(text) == list(text.encode())
    ids = tokenizer.encode("a<|close|>b", allow_special=True)
    assert tokenizer.decode(ids) == "a<|close|>b"
    assert tokenizer.decode(ids, skip_special_tokens=True) == "ab"


def test_missing_tokenizer_files_are_named(tmp_path, tokenizer_dir):
    with pytest.raises(TokenizerNotFound, match="tiktoken.model"):
        Tokenizer.from_dir(tmp_path)
    (tmp_path / "tiktoken.model").write_bytes((tokenizer_dir / "tiktoken.model").read_bytes())
    with pytest.raises(FileNotFoundError, match="tokenizer_config.json"):
        Tokenizer.from_dir(tmp_path)


def test_bpe_merges_and_checkpoint_conventions(tmp_path):
    """The published layout: merged tokens in `tiktoken.model`, AddedToken dicts for bos/eos,
    extra EOS ids in `generation_config.json`."""
    ranks = [bytes([b]) for b in range(256)] + [b"ab", b"abc"]
    (tmp_path / "tiktoken.model").write_text(
        "".join(f"{base64.b64encode(token).decode()} {rank}\n" for rank, token in enumerate(ranks)))
    specials = {258: "[BOS]", 259: "[EOS]", 260: "<|end_of_msg|>", 261: "[EOT]"}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "added_tokens_decoder": {str(i): {"content": t, "special": True} for i, t in specials.items()},
        "bos_token": {"content": "[BOS]"}, "eos_token": "[EOS]"}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [259, 261]}))
    tokenizer = Tokenizer.from_dir(tmp_path)
    assert tokenizer.encode("abc ab") == [257, ord(" "), 256]
    assert tokenizer.bos_token_id == 258
    assert tokenizer.eos_token_ids == {259, 260, 261}


def test_incremental_decoder_holds_partial_characters(tokenizer):
    text = "a🌍é"
    ids = tokenizer.encode(text)
    decoder = tokenizer.incremental_decoder()
    deltas = [decoder.feed(i) for i in ids]
    assert deltas == ["a", "", "", "", "🌍", "", "é"]
    assert decoder.finish() == ""


def test_incremental_decoder_matches_decode_on_any_bytes(tokenizer):
    """Invalid and truncated UTF-8 included: joined deltas equal the one-shot decode."""
    rng = random.Random(0)
    alphabet = list(range(256)) * 4 + [256, 259, 260, 262]  # bytes and a few specials
    for _ in range(200):
        ids = [rng.choice(alphabet) for _ in range(rng.randrange(12))]
        for skip in (False, True):
            decoder = tokenizer.incremental_decoder(skip_special_tokens=skip)
            streamed = "".join(decoder.feed(i) for i in ids) + decoder.finish()
            assert streamed == tokenizer.decode(ids, skip_special_tokens=skip)


def reference_text(tokenizer, ids, *, skip, spaces, keep=()):
    """vLLM's joining, written plainly: maximal runs of text (kept specials count as text) and each
    other special token are the pieces; dropped when skipping, else joined by a space when asked."""
    keep_ids = {tokenizer.token_id(t) for t in keep}
    pieces = []  # [is_special, bytes]
    for t in ids:
        special = t in tokenizer.special_ids and t not in keep_ids
        if special and skip:
            continue
        if not special and pieces and not pieces[-1][0]:
            pieces[-1][1] += tokenizer.token_bytes(t)
        else:
            pieces.append([special, tokenizer.token_bytes(t)])
    return (" " if spaces else "").join(b.decode("utf-8", errors="replace") for _, b in pieces)


def test_incremental_decoder_options_match_the_reference(tokenizer):
    """skip_special_tokens, spaces_between_special_tokens and the kept markers, on random streams of
    bytes and specials (invalid UTF-8 included)."""
    rng = random.Random(1)
    keep = ("<|open|>", "<|sep|>")
    alphabet = list(range(256)) * 3 + [tokenizer.token_id(t) for t in keep] + [256, 259, 262, 300]
    for _ in range(300):
        ids = [rng.choice(alphabet) for _ in range(rng.randrange(14))]
        for skip in (False, True):
            for spaces in (False, True):
                for kept in ((), keep):
                    decoder = tokenizer.incremental_decoder(skip_special_tokens=skip, spaces_between_special_tokens=spaces,
                                                            keep_special_tokens=kept)
                    streamed = "".join(decoder.feed(i) for i in ids) + decoder.finish()
                    assert streamed == reference_text(tokenizer, ids, skip=skip, spaces=spaces, keep=kept), \
                        (ids, skip, spaces, kept)
