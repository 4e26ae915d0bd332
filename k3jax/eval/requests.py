"""Input lines -> requests: each process parses only its slice of the JSONL file, and a line that
cannot be used becomes an error record carrying its line number instead of stopping the job.

Line numbers are 1-based positions in the input file (blank lines count but are skipped). A line
without an `id` takes its line number as id.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator

import numpy as np


class BadLine(ValueError):
    """A line the task cannot use; the message goes into the error record."""


@dataclasses.dataclass
class Row:
    """One token row to score: positions [start, len(tokens)) are scored, each from its left context."""

    tokens: np.ndarray  # int32 [n]
    start: int  # >= 1
    owner: int  # index of the request in the process's list


@dataclasses.dataclass
class Request:
    line: int
    id: str | int
    rows: list[Row] = dataclasses.field(default_factory=list)
    prompt: str | list[int] | None = None  # generate only
    messages: list | None = None  # generate only, instead of prompt: a chat, rendered by the generate task
    thinking: bool = True  # generate with messages: K3's thinking mode
    params: dict | None = None  # generate only: SamplingParams keywords


def read_slice(path: str, process_index: int = 0, process_count: int = 1) -> Iterator[tuple[int, str]]:
    """(line number, text) of the lines this process owns: line i (0-based) goes to process i % count.
    Every process scans the file, but parses only its own lines."""
    with open(path, encoding="utf-8") as f:
        for i, text in enumerate(f):
            if i % process_count == process_index and text.strip():
                yield i + 1, text


def load_object(line: int, text: str) -> dict:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise BadLine(f"invalid JSON: {e.msg} at column {e.colno}") from None
    if not isinstance(obj, dict):
        raise BadLine(f"expected a JSON object, got {type(obj).__name__}")
    return obj


def request_id(obj: dict, line: int) -> str | int:
    rid = obj.get("id", line)
    if isinstance(rid, bool) or not isinstance(rid, (str, int)):
        raise BadLine(f"`id` must be a string or an integer, got {json.dumps(rid)}")
    return rid


def _ids(obj: dict, key: str, vocab_size: int) -> list[int]:
    ids = obj[key]
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise BadLine(f"`{key}` must be a list of token ids")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise BadLine(f"`{key}` holds ids outside [0, {vocab_size}): {bad[:3]}")
    return ids


def _text(obj: dict, key: str) -> str:
    if not isinstance(obj[key], str):
        raise BadLine(f"`{key}` must be a string")
    return obj[key]


def encode_pair(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-evaluation-harness's split: trailing spaces of the context move to the continuation, and the
    continuation is what encoding the whole adds after the context's own tokens."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = tokenizer.encode(context + continuation)
    context_ids = tokenizer.encode(context)
    return context_ids, whole[len(context_ids):]


class Parser:
    """Turns one task's lines into requests with rows (loglikelihood, perplexity) or prompts (generate)."""

    def __init__(self, task: str, tokenizer, config, max_length: int, stride: int | None = None):
        self.task, self.tokenizer, self.max_length, self.stride = task, tokenizer, max_length, stride
        self.vocab_size, self.bos = config.vocab_size, config.bos_token_id

    def parse(self, line: int, text: str, owner: int) -> Request:
        obj = load_object(line, text)
        request = Request(line, request_id(obj, line))
        try:
            getattr(self, f"_{self.task}")(obj, request, owner)
        except BadLine as e:
            e.request_id = request.id  # the error record names the request when it can
            raise
        return request

    def _need_tokenizer(self, what: str):
        if self.tokenizer is None:
            raise BadLine(f"{what} given as text, but the checkpoint has no tokenizer: send token ids")

    def _loglikelihood(self, obj: dict, request: Request, owner: int):
        if "context_ids" in obj and "continuation_ids" in obj:
            context, continuation = _ids(obj, "context_ids", self.vocab_size), _ids(obj, "continuation_ids",
                                                                                    self.vocab_size)
        elif "context" in obj and "continuation" in obj:
            self._need_tokenizer("`context` and `continuation`")
            context, continuation = encode_pair(self.tokenizer, _text(obj, "context"), _text(obj, "continuation"))
        else:
            raise BadLine("needs `context` and `continuation` (text) or `context_ids` and `continuation_ids`")
        if not continuation:
            raise BadLine("empty continuation")
        if not context:  # the first continuation token needs something to be predicted from
            if self.bos is None:
                raise BadLine("empty context and the model has no BOS token to stand for it")
            context = [self.bos]
        n = len(context) + len(continuation)
        if n > self.max_length:
            raise BadLine(f"{n} tokens (context + continuation) is over the maximum length {self.max_length}")
        request.rows.append(Row(np.asarray(context + continuation, np.int32), len(context), owner))

    def _perplexity(self, obj: dict, request: Request, owner: int):
        if "ids" in obj:
            tokens = _ids(obj, "ids", self.vocab_size)
        elif "text" in obj:
            self._need_tokenizer("`text`")
            tokens = ([] if self.bos is None else [self.bos]) + self.tokenizer.encode(_text(obj, "text"))
        else:
            raise BadLine("needs `text` or `ids`")
        if len(tokens) < 2:
            raise BadLine("fewer than 2 tokens: nothing to score")
        tokens = np.asarray(tokens, np.int32)
        for begin, end, start in windows(len(tokens), self.max_length, self.stride):
            request.rows.append(Row(tokens[begin:end], start, owner))

    def _generate(self, obj: dict, request: Request, owner: int):
        given = [key for key in ("prompt", "prompt_ids", "messages") if key in obj]
        if len(given) != 1:
            raise BadLine("needs one of `prompt` (text), `prompt_ids` or `messages` (a chat)"
                          + (f", not {' and '.join(given)}" if given else ""))
        if "thinking" in obj and given != ["messages"]:
            raise BadLine("`thinking` applies to `messages` only")
        if "prompt_ids" in obj:
            request.prompt = _ids(obj, "prompt_ids", self.vocab_size)
        elif "prompt" in obj:
            self._need_tokenizer("`prompt`")
            request.prompt = _text(obj, "prompt")
        else:
            self._need_tokenizer("`messages`")
            if not isinstance(obj["messages"], list) or not obj["messages"] or \
                    not all(isinstance(m, dict) for m in obj["messages"]):
                raise BadLine("`messages` must be a non-empty list of chat messages (objects)")
            if not isinstance(obj.get("thinking", True), bool):
                raise BadLine("`thinking` must be true or false")
            request.messages, request.thinking = obj["messages"], obj.get("thinking", True)
        if request.messages is None and not request.prompt:
            raise BadLine("empty prompt")
        request.params = self._sampling_params(obj)

    @staticmethod
    def _sampling_params(obj: dict) -> dict:
        params = obj.get("sampling_params", {})
        if not isinstance(params, dict):
            raise BadLine("`sampling_params` must be a JSON object")
        return params


def windows(n: int, window: int, stride: int) -> list[tuple[int, int, int]]:
    """Strided windows over n tokens: (begin, end, first scored position relative to begin).

    The first window is tokens [0, window) and scores 1..window-1; each next one ends `stride` tokens
    later and scores only its new tokens, which therefore keep at least window - stride tokens of
    left context. Every token after the first is scored exactly once (Hugging Face's recipe)."""
    if not 1 <= stride < window:
        raise ValueError(f"the stride ({stride}) must be at least 1 and below the window ({window})")
    out, end = [(0, min(window, n), 1)], min(window, n)
    while end < n:
        new_end = min(end + stride, n)
        begin = new_end - window
        out.append((begin, new_end, end - begin))
        end = new_end
    return out
