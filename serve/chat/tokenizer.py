"""The K3 tokenizer: tiktoken byte-level BPE read from a checkpoint directory.

A Kimi checkpoint ships `tiktoken.model` (one `base64(token bytes) rank` pair per line) and
`tokenizer_config.json`, whose `added_tokens_decoder` names the special tokens by id (`[BOS]`,
`<|open|>`, `<|end_of_msg|>`, ... and the reserved fillers). The synthetic checkpoints of
`convert.synth` use the same two files over a 256-byte vocabulary, so one loader serves both.
"""

from __future__ import annotations

import base64
import codecs
import json
import os
from collections.abc import Iterable

import tiktoken

# The pre-tokenizer split of every Kimi tokenizer (K2 and K3 share it). It is not in a data file:
# the checkpoint defines it in `tokenization_kimi.py` (`TikTokenTokenizer.pat_str`), which we do not
# execute. Han runs form their own pieces (`&&[^\p{Han}]` takes Han out of the letter classes).
KIMI_PATTERN = "|".join([  # noqa: FLY002 -- one alternative a line, as the checkpoint writes it
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])

# K3 closes its turn with `<|close|>message<|sep|><|end_of_msg|>`: the last token always ends
# generation, besides the checkpoint's own EOS ids (ARCHITECTURE.md, "Tokens").
END_OF_MESSAGE = "<|end_of_msg|>"


class TokenizerNotFound(FileNotFoundError):
    """The checkpoint has no tokenizer files; such a model serves token-id prompts only."""


class Tokenizer:
    """Text <-> token ids for K3. Special tokens are addressed by their text (`token_id("<|open|>")`)."""

    def __init__(self, mergeable_ranks: dict[bytes, int], special_tokens: dict[str, int], *,
                 bos_token: str | None = None, eos_token: str | None = None, pad_token: str | None = None,
                 extra_eos_token_ids: Iterable[int] = ()):
        self._encoding = tiktoken.Encoding("k3", pat_str=KIMI_PATTERN, mergeable_ranks=mergeable_ranks,
                                           special_tokens=special_tokens)
        self.special_tokens = dict(special_tokens)
        self.special_ids = frozenset(special_tokens.values())
        self.vocab_size = len(mergeable_ranks) + len(special_tokens)
        # The longest text a token covers: n bytes (or characters) of text are at least n / this tokens.
        self.max_token_bytes = max(map(len, mergeable_ranks), default=1)
        # the configured special tokens' texts (None when the vocabulary lacks them)
        self.bos_token, self.eos_token, self.pad_token = (t if t in special_tokens else None
                                                          for t in (bos_token, eos_token, pad_token))
        self.bos_token_id = special_tokens.get(bos_token) if bos_token else None
        ends = {special_tokens.get(END_OF_MESSAGE), special_tokens.get(eos_token) if eos_token else None}
        self.eos_token_ids = frozenset({i for i in ends if i is not None} | set(extra_eos_token_ids))

    @classmethod
    def from_dir(cls, path: str | os.PathLike) -> Tokenizer:
        """Loads `tiktoken.model` and `tokenizer_config.json` (and the EOS ids of
        `generation_config.json` when present) from a checkpoint directory."""
        files = {name: os.path.join(path, name) for name in ("tiktoken.model", "tokenizer_config.json")}
        for file in files.values():
            if not os.path.isfile(file):
                raise TokenizerNotFound(f"no tokenizer in {os.fspath(path)}: {file} does not exist "
                                        "(such a model takes token-id prompts only)")
        ranks = {}
        with open(files["tiktoken.model"]) as f:
            for line in f:
                if line.strip():
                    token, rank = line.split()
                    ranks[base64.b64decode(token)] = int(rank)
        with open(files["tokenizer_config.json"]) as f:
            config = json.load(f)
        specials = {entry["content"]: int(i) for i, entry in config.get("added_tokens_decoder", {}).items()}
        extra_eos = []
        generation_config = os.path.join(path, "generation_config.json")
        if os.path.isfile(generation_config):
            with open(generation_config) as f:
                eos = json.load(f).get("eos_token_id")
            extra_eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
        return cls(ranks, specials, bos_token=_token_text(config.get("bos_token")),
                   eos_token=_token_text(config.get("eos_token")), pad_token=_token_text(config.get("pad_token")),
                   extra_eos_token_ids=extra_eos)

    def encode(self, text: str, *, allow_special: bool = False) -> list[int]:
        """Token ids of `text`. Without `allow_special`, marker strings such as `<|open|>` in the text
        are ordinary text (so user content cannot forge chat structure)."""
        if allow_special:
            return self._encoding.encode(text, allowed_special="all")
        return self._encoding.encode_ordinary(text)

    def encode_prompt(self, text: str) -> list[int]:
        """A raw prompt's ids (`/v1/completions`, `LLM.generate`, `/tokenize`): special-token text is the
        special token, as Hugging Face tokenizers read a prompt (so `[EOS]` or an image placeholder in
        it works); chat content is never read this way (serve/chat/encoding.py)."""
        return self.encode(text, allow_special=True)

    def decode(self, ids: Iterable[int], *, skip_special_tokens: bool = False) -> str:
        """Text of `ids`; bytes that are not valid UTF-8 become U+FFFD. Special tokens are kept as
        their text unless `skip_special_tokens` (the output parsers need them kept)."""
        if skip_special_tokens:
            ids = [i for i in ids if i not in self.special_ids]
        return self._encoding.decode_bytes(list(ids)).decode("utf-8", errors="replace")

    def token_id(self, special_token: str) -> int:
        """Id of a special token by its text; KeyError naming it when the tokenizer lacks it."""
        try:
            return self.special_tokens[special_token]
        except KeyError:
            raise KeyError(f"the tokenizer has no special token {special_token!r}") from None

    def token_bytes(self, token_id: int) -> bytes:
        return self._encoding.decode_single_token_bytes(token_id)

    def incremental_decoder(self, *, skip_special_tokens: bool = False, spaces_between_special_tokens: bool = False,
                            keep_special_tokens: Iterable[str] = ()) -> IncrementalDecoder:
        return IncrementalDecoder(self, skip_special_tokens=skip_special_tokens,
                                  spaces_between_special_tokens=spaces_between_special_tokens,
                                  keep=frozenset(self.special_tokens[t] for t in keep_special_tokens
                                                 if t in self.special_tokens))


class IncrementalDecoder:
    """Detokenizes a stream of ids into text deltas. A character split over several tokens is held
    until its last byte arrives, so a delta never ends in half a character; the deltas, with
    `finish()`'s, join to `tokenizer.decode(all ids)` (without the options below).

    skip_special_tokens drops special tokens other than those in `keep`; spaces_between_special_tokens
    puts a space between a kept special token (other than those in `keep`) and the text or special
    token next to it, as vLLM's detokenizer joins them."""

    def __init__(self, tokenizer: Tokenizer, *, skip_special_tokens: bool = False,
                 spaces_between_special_tokens: bool = False, keep: frozenset[int] = frozenset()):
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._spaces = spaces_between_special_tokens
        self._keep = keep
        self._last = None  # what the last piece was: "text", "special" or None (nothing yet)
        # Python's incremental UTF-8 decoder holds an incomplete trailing sequence and replaces
        # invalid bytes exactly as a one-shot decode of the whole byte string does.
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, token_id: int) -> str:
        special = token_id in self._tokenizer.special_ids and token_id not in self._keep
        if special and self._skip_special_tokens:
            return ""
        kind = "special" if special else "text"
        space = " " if self._spaces and self._last is not None and "special" in (kind, self._last) else ""
        self._last = kind
        if special:  # whole text: a character left unfinished before it ends there (U+FFFD), as in decode()
            return self._utf8.decode(b"", final=True) + space + self._tokenizer.token_bytes(token_id).decode()
        return space + self._utf8.decode(self._tokenizer.token_bytes(token_id))

    def finish(self) -> str:
        """Text still held at the end of the stream (U+FFFD for a dangling partial character)."""
        return self._utf8.decode(b"", final=True)


def _token_text(token) -> str | None:
    """`tokenizer_config.json` writes a token as its text or as an AddedToken dict."""
    return token.get("content") if isinstance(token, dict) else token
