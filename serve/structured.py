"""Structured outputs: a request's grammar, enforced while decoding as a mask of allowed tokens.

What a request may ask for (`StructuredOutputsParams`, vLLM's names): a JSON schema (`json`), any
JSON object (`json_object`), a regular expression, a choice among strings, a Lark or GBNF grammar,
or a forced call of one of K3's tools. The grammar covers the whole generated text: for a chat
request it also spells K3's channel markers (serve/chat/parsing.py), so the constraint applies to
the content after the thinking ends, as SGLang and vLLM do with a reasoning parser: in thinking
mode (`channel="think"`) the reasoning is free text up to `<|close|>think<|sep|>`, then the response
channel holds the constrained content; in instant mode (`channel="response"`) the content starts at
once. A forced tool call leaves the response empty and writes the tools channel, each call in K3's
XTML format with one `argument` element per parameter (a string raw, any other value as JSON of the
parameter's schema).

JSON allows no free whitespace unless asked (`whitespace=True`; vLLM's `disable_any_whitespace`
inverted): a small or random model would otherwise loop on spaces until max_tokens.

The library is llguidance, not xgrammar, by measurement (this machine's CPU, one JSON schema of
nested objects, an enum, an array and a pattern, written token by token, compact separators):

| vocabulary | llguidance 1.9.1 per token, median (p90) | xgrammar 0.2.9 median (p90) |
|---|---|---|
| the embedded k3-tiny's, 512 tokens | 3.1 us (10 us) | 3.1 us (3.9 us) |
| K3-sized stand-in, 163840 tokens | 28.5 us (217 us) | 3.7 ms (5.0 ms) |

(no 164K BPE file is reachable here, so the large vocabulary is a synthetic one of words, numbers,
punctuation and whitespace runs; grammar compile was 1 ms for llguidance, 30 ms for xgrammar.)
At K3's vocabulary xgrammar's mask cost as much as a whole decode step; and its wheel requires
torch, transformers and triton, which the serve install must not pull in; llguidance needs none.

Masks are computed on the host for the rows that sample, after the step's model call is dispatched
(serve/engine.py `_launch`), so they overlap the device's forward; they are folded into the
sampler's banned-token bitmask (serve/sampling.py `restrict`), so no new jitted input exists.

Grammars compile before their request reaches the engine: a large JSON schema takes from tens of
milliseconds to seconds (a 400-property schema 63 ms, 1500 properties 420 ms at the 512-token
vocabulary), which on the engine's thread would stall every running request's next step. The HTTP
server calls `Grammars.compile` in a worker thread (llguidance releases the GIL while it compiles);
compiled grammars are kept by their text (the last MAX_COMPILED), so `add` on the engine thread only
copies one (a fraction of a millisecond), and a schema sent again is not compiled again. A request
added without that (the offline LLM, or one whose grammar left the cache meanwhile) compiles in `add`.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import json
import threading
from collections.abc import Iterable, Sequence

import numpy as np

from serve.chat.encoding import _attribute  # the encoder's attribute escaping: the grammar writes what it writes

# How a tool's string argument is written when its schema sets no maxLength: a bound keeps a model that
# never closes the value from running to max_tokens inside a call that then fails to parse.
MAX_STRING_ARGUMENT = 4096
MAX_COMPILED = 64  # compiled grammars kept for reuse, the least recently used dropped first
_KINDS = ("json", "json_object", "regex", "choice", "grammar", "tools")


@dataclasses.dataclass(frozen=True)
class StructuredOutputsParams:
    """One constraint (exactly one of the kinds set) and where the constrained text sits.

    json: a JSON schema (dict or JSON text; kept as compact text); json_object: any JSON object;
    regex; choice: the allowed strings; grammar: Lark or GBNF text; tools: function definitions
    ({"name", "parameters"}, JSON text or a list) of which a call is forced, at most one when not
    `parallel_tool_calls` (with `tool_call_required` false, free content and at most one call, or
    none). strict: a JSON schema's unknown keywords are an error (else ignored).
    channel: None (the whole output is the constrained text), "think" or "response" (the chat
    prompt's open channel). field: the request field named in errors.
    """

    json: str | dict | None = None
    json_object: bool = False
    regex: str | None = None
    choice: Sequence[str] | None = None
    grammar: str | None = None
    tools: str | Sequence[dict] | None = None
    parallel_tool_calls: bool = True
    tool_call_required: bool = True
    strict: bool = False
    whitespace: bool = False
    channel: str | None = None
    field: str = "structured_outputs"

    def __post_init__(self):
        for name in ("json", "tools"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                object.__setattr__(self, name, json.dumps(value, ensure_ascii=False, separators=(",", ":")))
        if self.choice is not None:
            object.__setattr__(self, "choice", tuple(self.choice))
        kinds = [k for k in _KINDS if getattr(self, k) not in (None, False)]
        if len(kinds) != 1:
            raise ValueError(f"{self.field}: must set exactly one of {', '.join(_KINDS)}, got {kinds or 'none'}")
        if self.choice is not None and (not self.choice or not all(isinstance(c, str) for c in self.choice)):
            raise ValueError(f"{self.field}.choice: must be a non-empty list of strings")
        if self.channel not in (None, "think", "response") or self.tools is not None and self.channel is None:
            raise ValueError(f"{self.field}: channel must be 'think' or 'response' (or None, except for a tool "
                             f"call), got {self.channel!r}")

    @functools.cached_property  # built once per request, in the worker thread that compiles it
    def grammar_text(self) -> str:
        """The llguidance grammar (its JSON form) of the whole generated text."""
        subgrammars = []
        if self.tools is not None:
            rules = _tools_rules(json.loads(self.tools), self.parallel_tool_calls, self._json_options())
            content = ('<|close|> "response" <|sep|> tools <|close|> "message" <|sep|>' if self.tool_call_required
                       else 'FREE? <|close|> "response" <|sep|> tools? <|close|> "message" <|sep|>')
        else:
            rules = f"body: {self._body(subgrammars)}\n"
            content = "body" if self.channel is None else \
                'body <|close|> "response" <|sep|> <|close|> "message" <|sep|>'
        if self.channel == "think":  # instant mode's prompt opened the response channel already
            content = f'FREE? <|close|> "think" <|sep|> <|open|> "response" <|sep|> {content}'
        if "FREE" in content:  # text of ordinary tokens (the reasoning, free content): no special token
            rules += "FREE: /(?s:.+)/\n"
        return json.dumps({"grammars": [{"lark_grammar": f"start: {content}\n{rules}"}, *subgrammars]})

    def _json_options(self) -> dict:
        return {"whitespace_flexible": self.whitespace, "lenient": not self.strict}

    def _body(self, subgrammars: list) -> str:
        if self.json is not None or self.json_object:
            schema = json.loads(self.json) if self.json is not None else {"type": "object"}
            return _json_rule(schema, self._json_options(), self.field)
        if self.regex is not None:
            import llguidance
            return f"/{llguidance.regex_to_lark(self.regex)}/"
        if self.choice is not None:
            return " | ".join(json.dumps(c, ensure_ascii=False) for c in self.choice)
        from llguidance.gbnf_to_lark import any_to_lark
        try:
            subgrammars.append({"name": "user", "lark_grammar": any_to_lark(self.grammar)})
        except Exception as error:  # the converter raises bare Exceptions on malformed GBNF
            raise ValueError(f"{self.field}.grammar: {error}") from error
        return "@user"


def _json_rule(schema, options: dict, field: str) -> str:
    if not isinstance(schema, dict):
        raise ValueError(f"{field}: a JSON schema must be an object")
    return "%json " + json.dumps({**schema, "x-guidance": {**options, **schema.get("x-guidance", {})}})


def _tools_rules(tools: list, parallel: bool, options: dict) -> str:
    """Lark rules, `tools` the tools channel, of a forced call of one of `tools` (K3's XTML, as
    serve/chat/encoding.py renders calls: `<|open|>call tool="NAME" index="N"<|sep|>` arguments
    `<|close|>call<|sep|>`)."""
    rules, calls = [], []
    for t, tool in enumerate(tools):
        name, schema = tool["name"], tool.get("parameters") or {}
        required = set(schema.get("required", ()))
        arguments = []
        for a, (key, prop) in enumerate((schema.get("properties") or {}).items()):
            rules.append(f"arg_{t}_{a}: {_argument(key, prop, options)}")
            arguments.append(f"arg_{t}_{a}" + ("" if key in required else "?"))
        opener = "".join(p.text for p in _attribute("tool", name)) + ' index="'
        rules.append(f'call_{t}: <|open|> {json.dumps("call" + opener)} INDEX "\\"" <|sep|> '
                     f'{" ".join(arguments)} <|close|> "call" <|sep|>')
        calls.append(f"call_{t}")
    rules.append(f"call: {' | '.join(calls)}")
    rules.append("INDEX: /[1-9][0-9]{0,2}/")
    return (f'tools: <|open|> "tools" <|sep|> call{"+" if parallel else ""} <|close|> "tools" <|sep|>\n'
            + "\n".join(rules) + "\n")


def _argument(key: str, prop, options: dict) -> str:
    """One `argument` element: a string raw (its enum as alternatives), any other type as JSON."""
    prop = prop if isinstance(prop, dict) else {}
    kind = prop.get("type")
    head = "<|open|> " + json.dumps("argument" + "".join(p.text for p in _attribute("key", key)) + ' type="')
    if kind == "string":
        if "enum" in prop or "const" in prop:
            value = " | ".join(json.dumps(v, ensure_ascii=False) for v in prop.get("enum", [prop.get("const")]))
            value = f"({value})"
        else:
            value = f"/(?s:.{{{prop.get('minLength', 0)},{prop.get('maxLength', MAX_STRING_ARGUMENT)}}})/"
        type_text = '"string"'
    else:
        # the parser decodes any non-string type's value as JSON; an untyped or multi-typed property
        # may take any such type's name
        names = {"integer": "number"}.get(kind, kind) if isinstance(kind, str) else None
        type_text = json.dumps(names) if names else '("number" | "boolean" | "null" | "object" | "array")'
        value = _json_rule(prop, options, "tools")
    return f'{head} {type_text} "\\"" <|sep|> {value} <|close|> "argument" <|sep|>'


class Grammars:
    """The grammar state of each constrained request of an engine, by request id: created when the
    request is added, advanced with every token it emits, dropped when it finishes. The state is a
    function of the output tokens alone, so preemption (recompute) and prefix-cache hits need
    nothing: the recomputed request samples its next token from the same state."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids: Iterable[int]):
        self._tokenizer, self._vocab_size, self._eos_ids = tokenizer, vocab_size, sorted(eos_ids)
        self._lltokenizer = None  # built on first use: ~1 s at K3's vocabulary
        self._executor = None
        self._matchers: dict[str, object] = {}
        # grammar text -> its compiled matcher, never advanced itself: requests get copies
        self._compiled: collections.OrderedDict[str, object] = collections.OrderedDict()
        self._lock = threading.Lock()  # `compile` runs in the server's worker threads, `add` on the engine's

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._matchers

    def compile(self, spec: StructuredOutputsParams) -> None:
        """Compiles the grammar of `spec` into the cache, for a request about to be added (blocking: run
        it off the engine thread); ValueError naming the field when it cannot be honoured."""
        self._compiled_matcher(spec)

    def add(self, request_id: str, spec: StructuredOutputsParams) -> None:
        """The request's grammar state, a copy of the compiled grammar (compiled now unless `compile`
        did it); ValueError naming the field when it cannot be honoured."""
        self._matchers[request_id] = self._compiled_matcher(spec).deep_copy()

    def _compiled_matcher(self, spec: StructuredOutputsParams):
        import llguidance
        if self._tokenizer is None:
            raise ValueError(f"{spec.field}: needs the model's tokenizer files, which this model lacks")
        text = spec.grammar_text
        with self._lock:
            if (matcher := self._compiled.get(text)) is not None:
                self._compiled.move_to_end(text)
                return matcher
            if self._lltokenizer is None:
                from llguidance.tiktoken import lltokenizer_from_encoding
                # the tiktoken encoding itself: llguidance reads its ranks, special tokens and split pattern
                self._lltokenizer = lltokenizer_from_encoding(self._tokenizer._encoding, n_vocab=self._vocab_size,
                                                              eos_token=self._eos_ids)
                self._executor = llguidance.LLExecutor()
        matcher = llguidance.LLMatcher(self._lltokenizer, text, log_level=0)  # unlocked: compiles run in parallel
        if matcher.is_error():
            raise ValueError(f"{spec.field}: {matcher.get_error()}")
        with self._lock:
            self._compiled[text] = matcher
            while len(self._compiled) > MAX_COMPILED:
                self._compiled.popitem(last=False)
        return matcher

    def drop(self, request_id: str) -> None:
        self._matchers.pop(request_id, None)

    def advance(self, request_id: str, token: int) -> bool:
        """Feeds an emitted token; False when the grammar rejects it (a request without one accepts all)."""
        matcher = self._matchers.get(request_id)
        return matcher is None or matcher.consume_token(token)

    def valid_drafts(self, request_id: str, drafts: list[int]) -> int:
        """How many of `drafts` the grammar takes from its state (all for a free request): a speculative
        window is cut at the first draft the grammar rejects. The state does not move."""
        matcher = self._matchers.get(request_id)
        return len(drafts) if matcher is None else matcher.validate_tokens(drafts)

    def window_allowed(self, requests, num_rows: int, window: int) -> np.ndarray | None:
        """uint32 [num_rows * window, ceil(V / 32)]: row i * window + j is request i's mask after its first
        j drafts (all bits set for free rows and past a row's drafts), or None when none is constrained.
        The drafts must be valid (`valid_drafts`); the states do not move."""
        import llguidance.numpy as llnp
        work = [(self._matchers[r.id], i * window, list(r.drafts)) for i, r in enumerate(requests)
                if r.id in self._matchers]
        if not work:
            return None
        mask = np.full((num_rows * window, -(-self._vocab_size // 32)), -1, np.int32)
        drafted = [w for w in work if w[2]]  # llguidance takes no empty draft: those rows get the plain mask
        if drafted:
            llnp.fill_next_token_bitmask_par_with_draft_tokens(self._executor, drafted, mask)
        if len(drafted) < len(work):
            llnp.fill_next_token_bitmask_par(self._executor, [(m, row) for m, row, d in work if not d], mask)
        return mask.view(np.uint32)

    def allowed(self, ready, num_rows: int) -> np.ndarray | None:
        """uint32 [num_rows, ceil(V / 32)] allowed-token bits of the ready rows ((row, request) pairs; all
        bits set for free rows), or None when no row is constrained."""
        import llguidance.numpy as llnp
        work = [(self._matchers[r.id], row) for row, r in ready if r.id in self._matchers]
        if not work:
            return None
        mask = np.full((num_rows, -(-self._vocab_size // 32)), -1, np.int32)
        # in parallel over rows, on llguidance's own threads (the GIL released)
        llnp.fill_next_token_bitmask_par(self._executor, work, mask)
        return mask.view(np.uint32)
