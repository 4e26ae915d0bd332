"""Engine outputs in OpenAI's response shapes: one object per choice, whole or as stream deltas.

The engine hands out deltas (`Engine.step(deltas=True)`): each output holds the tokens, logprobs
and text a step added, the text already held back while a stop string could still cut it. A
stream sends each delta on; a whole response joins them (`Totals`). Chat text goes through the K3
output parsers: reasoning, content and tool calls.
"""

from __future__ import annotations

from serve.chat import Delta, OutputParser, Tokenizer, make_tool_call_id, parse_output
from serve.engine import RequestOutput

# JSON has no -Infinity: a token the model rules out entirely gets this logprob, as in vLLM.
MIN_LOGPROB = -9999.0


class Totals:
    """A request's output deltas joined per choice: token counts for `usage`, and (with
    `keep_outputs`) each choice's whole output for a non-streaming response."""

    def __init__(self, num_choices: int, keep_outputs: bool = True):
        self.prompt_tokens = [0] * num_choices
        self.cached_tokens = [0] * num_choices  # of the prompt, found in the prefix cache
        self.completion_tokens = [0] * num_choices
        self.keep_outputs = keep_outputs
        self.outputs: dict[int, RequestOutput] = {}

    def add(self, index: int, delta: RequestOutput) -> None:
        self.prompt_tokens[index] = len(delta.prompt_token_ids)
        self.cached_tokens[index] = delta.num_cached_tokens
        self.completion_tokens[index] += len(delta.token_ids)
        if not self.keep_outputs:
            return
        whole = self.outputs.get(index)
        if whole is None:
            self.outputs[index] = RequestOutput(delta.request_id, delta.prompt_token_ids, list(delta.token_ids),
                                                delta.finish_reason, list(delta.logprobs or []), delta.text,
                                                delta.num_cached_tokens)
            return
        whole.token_ids += delta.token_ids
        whole.logprobs += delta.logprobs or []
        whole.text = None if delta.text is None else (whole.text or "") + delta.text
        whole.finish_reason = delta.finish_reason

    def usage(self, n: int) -> dict:
        """Token counts, OpenAI's cached prompt tokens included; each prompt counts once, not once per choice."""
        prompt = sum(self.prompt_tokens[::n])
        completion = sum(self.completion_tokens)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": sum(self.cached_tokens[::n])}}


class ChatChoice:
    """One choice of a chat completion."""

    def __init__(self, index: int, tokenizer: Tokenizer, *, thinking: bool, tools: list | None,
                 top_logprobs: int | None):
        self.index = index
        self.tokenizer = tokenizer
        self.thinking = thinking
        self.tools = tools  # None when calls are not parsed (no tools, or tool_choice "none")
        self.top_logprobs = top_logprobs  # None: no logprobs
        self._parser = OutputParser(thinking=thinking, tools=tools, stream_reasoning=True)
        self._called_tools = False

    def whole(self, output: RequestOutput) -> dict:
        parsed = parse_output(output.text or "", thinking=self.thinking, tools=self.tools)
        message = {"role": "assistant", "content": parsed.content, "reasoning_content": parsed.reasoning_content}
        if parsed.tool_calls:
            message["tool_calls"] = [{"id": make_tool_call_id(), "type": "function", "function": call}
                                     for call in parsed.tool_calls]
        logprobs = self._logprobs(output.token_ids, output.logprobs) if self.top_logprobs is not None else None
        return {"index": self.index, "message": message, "logprobs": logprobs,
                "finish_reason": self._finish_reason(output, bool(parsed.tool_calls))}

    def first_delta(self) -> dict:
        return {"index": self.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                "finish_reason": None}

    def delta(self, output: RequestOutput) -> dict | None:
        """The stream chunk's choice for what the delta `output` adds, or None when nothing is new yet."""
        deltas = [self._parser.feed(output.text or "")]
        if output.finished:
            deltas.append(self._parser.finish())
        delta = _joined(deltas)
        self._called_tools |= "tool_calls" in delta
        tokens = output.token_ids
        logprobs = self._logprobs(tokens, output.logprobs or []) if self.top_logprobs is not None and tokens else None
        if not delta and logprobs is None and not output.finished:
            return None
        finish_reason = self._finish_reason(output, self._called_tools) if output.finished else None
        return {"index": self.index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}

    @staticmethod
    def _finish_reason(output: RequestOutput, called_tools: bool) -> str:
        return "tool_calls" if called_tools else output.finish_reason

    def _logprobs(self, token_ids: list[int], entries: list[dict]) -> dict:
        return {"content": token_logprobs(self.tokenizer, token_ids, entries, self.top_logprobs)}


def token_logprobs(tokenizer: Tokenizer, token_ids: list[int], entries: list[dict], top_logprobs: int) -> list[dict]:
    """OpenAI's logprobs of tokens (chat's `logprobs.content`, the Responses API's output_text
    `logprobs`): token, logprob, bytes and the top_logprobs best alternatives, best first."""
    def token(token_id: int, logprob: float) -> dict:
        raw = tokenizer.token_bytes(token_id)
        return {"token": raw.decode("utf-8", errors="replace"), "logprob": max(logprob, MIN_LOGPROB),
                "bytes": list(raw)}

    out = []
    for token_id, entry in zip(token_ids, entries):
        top = sorted(entry.items(), key=lambda item: -item[1])[:top_logprobs]
        out.append({**token(token_id, entry[token_id]), "top_logprobs": [token(i, logprob) for i, logprob in top]})
    return out


def _joined(deltas: list[Delta]) -> dict:
    """Parser deltas as one OpenAI `delta` object, with only the fields that have something."""
    joined = {}
    reasoning = "".join(d.reasoning_content or "" for d in deltas)
    content = "".join(d.content or "" for d in deltas)
    calls = [call for d in deltas for call in d.tool_calls]
    if reasoning:
        joined["reasoning_content"] = reasoning
    if content:
        joined["content"] = content
    if calls:
        joined["tool_calls"] = calls
    return joined


class CompletionChoice:
    """One choice of a (legacy) text completion; with `echo` (prompt text, prompt ids, their logprobs
    entries or None) the prompt comes first, as OpenAI's legacy API and vLLM return it. A whole
    response's choice carries vLLM's `prompt_logprobs` when they were computed."""

    def __init__(self, index: int, tokenizer: Tokenizer | None, *, logprobs: int | None,
                 echo: tuple[str, list[int], list | None] | None = None, prompt_logprobs: list | None = None):
        self.index = index
        self.tokenizer = tokenizer
        self.num_logprobs = logprobs  # None: no logprobs
        self._text_offset = 0
        self._echo = echo  # handed out with the first output
        self._prompt_logprobs = prompt_logprobs

    def whole(self, output: RequestOutput) -> dict:
        choice = self._choice(output)
        if choice["logprobs"] is None and self.num_logprobs is not None:
            choice["logprobs"] = self._logprobs([], [])
        if self._prompt_logprobs is not None:
            choice["prompt_logprobs"] = self._prompt_logprobs
        return choice

    def delta(self, output: RequestOutput) -> dict | None:
        """The stream chunk's choice for the delta `output`, or None when nothing is new yet."""
        choice = self._choice(output)
        return None if not choice["text"] and choice["logprobs"] is None and not output.finished else choice

    def _choice(self, output: RequestOutput) -> dict:
        text, tokens, entries = output.text or "", list(output.token_ids), list(output.logprobs or [])
        if self._echo is not None:
            prompt_text, prompt_ids, prompt_entries = self._echo
            text, tokens, entries = prompt_text + text, prompt_ids + tokens, (prompt_entries or []) + entries
            self._echo = None
        logprobs = self._logprobs(tokens, entries) if self.num_logprobs is not None and tokens else None
        return {"index": self.index, "text": text, "logprobs": logprobs, "finish_reason": output.finish_reason}

    def _logprobs(self, token_ids: list[int], entries: list[dict]) -> dict:
        """OpenAI's legacy shape: parallel lists, top alternatives as {token text: logprob}."""
        tokens, chosen, top, offsets = [], [], [], []
        for token_id, entry in zip(token_ids, entries):
            text = self._text(token_id)
            tokens.append(text)
            if entry is None:  # the prompt's first token: nothing predicts it
                chosen.append(None)
                top.append(None)
            else:
                chosen.append(max(entry[token_id], MIN_LOGPROB))
                best = sorted(entry.items(), key=lambda item: -item[1])[:self.num_logprobs]
                top.append({self._text(i): max(logprob, MIN_LOGPROB) for i, logprob in best})
            offsets.append(self._text_offset)
            self._text_offset += len(text)
        return {"tokens": tokens, "token_logprobs": chosen, "top_logprobs": top, "text_offset": offsets}

    def _text(self, token_id: int) -> str:
        if self.tokenizer is None:  # a token-ids-only model
            return f"token_id:{token_id}"
        return self.tokenizer.token_bytes(token_id).decode("utf-8", errors="replace")
