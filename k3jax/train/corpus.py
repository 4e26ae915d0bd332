"""The training corpus: K3 chat conversations about Python, from text every Python install ships.

The source is `pydoc_data.topics` (the language reference's sections that `help("if")` prints, about
490 KB of English). Each topic is cut into passages of at most PASSAGE_CHARS, and each passage
becomes one conversation of one of four kinds, in K3's chat format (`serve.chat.encoding`, the
serving prompt's own renderer, so training and serving frame a turn identically):

- instant: the user asks about the topic, the assistant answers in the response channel;
- thinking: the same with a short reasoning in the think channel first;
- tool: thinking mode with a `python_help` tool declared; the assistant calls it (XTML `tools`
  channel), the tool returns the passage, the assistant answers with its first sentences;
- greeting (a few per epoch): "Hello" and friends get a greeting back, so the embedded model's
  first answer in `make serve` is a greeting that closes its markers.

Every conversation ends with the assistant's `<|close|>message<|sep|><|end_of_msg|>`: the model
learns to close its channels and its turn. Every answer opens with ANSWER_LEAD: a reply's content
would otherwise start with any of dozens of characters, so under greedy decoding the one marker
that closes the response at once (right in the tool kind's first turn, 1 reply start in 4) outranks
each of them even where writing content is far likelier in total. The reasoning and the lead
name no topic: a small model copies a name from the question poorly, and a half-copied name is where
its greedy replies fell into loops that never closed. Topics are split into training
and held-out sets by name (every HELD_OUT_EVERY-th topic), so held-out perplexity is measured on
unseen sections.

Training rows (`Batches`) pack whole conversations, so every reply a row holds ends with its closing
markers; a conversation longer than a row keeps its assistant turns that fit (a tool conversation,
whose thinking-mode prompt with the tool declaration is ~720 tokens, keeps its tool call). Reply
tokens that are markers or follow one (where a reply opens, switches channel or closes) weigh
MARKER_WEIGHT: they decide a turn's shape and are a few in a hundred reply tokens.
"""

from __future__ import annotations

import dataclasses
import json
import re
import tempfile

import numpy as np
import pydoc_data.topics

from convert.synth import write_tokenizer
from k3jax.config import K3Config
from serve.chat.encoding import tokenize_messages
from serve.chat.tokenizer import Tokenizer

PASSAGE_CHARS = 160  # a reply of ~220 tokens at most: its close comes well inside the evaluation's 600
HELD_OUT_EVERY = 10
ANSWER_SENTENCES = 1  # what the tool kind's final answer keeps of the passage
ANSWER_LEAD = "From the reference: "
TOOLS = [{"type": "function", "function": {
    "name": "python_help", "description": "The Python language reference's section on a topic.",
    "parameters": {"type": "object", "properties": {"topic": {"type": "string"}}, "required": ["topic"]}}}]
GREETINGS = [("Hello", "Hello! Ask me about Python: statements, expressions, types and more."),
             ("Hi", "Hi! What would you like to know about Python?"),
             ("Hello!", "Hello! I can explain Python's statements and data model."),
             ("hey", "Hey! Ask me a Python question.")]
QUESTIONS = ["Tell me about {}.", "What is {}?", "Explain {}.", "How does {} work in Python?"]
KINDS = ("instant", "thinking", "tool")
CONTEXT_WEIGHT = 0.1  # the loss weight of tokens outside the assistant's replies
MARKER_WEIGHT = 4.0  # the loss weight of reply tokens that are markers or follow one
LOOKAHEAD = 32  # conversations a row's packing looks ahead for one that fills its rest


@dataclasses.dataclass(frozen=True)
class Conversation:
    messages: list[dict]
    thinking: bool
    tools: list[dict] | None

    def render(self, tokenizer: Tokenizer) -> list[int]:
        return tokenize_messages(tokenizer, self.messages, tools=self.tools, thinking=self.thinking,
                                 add_generation_prompt=False)

    def reply_spans(self, tokenizer: Tokenizer) -> list[tuple[int, int]]:
        """(start, end) in `render` of each assistant turn a model generates in serving: after the
        prompt's channel opener, through `<|end_of_msg|>`."""
        spans = []
        for j, message in enumerate(self.messages):
            if message["role"] == "assistant":
                start = len(tokenize_messages(tokenizer, self.messages[:j], tools=self.tools, thinking=self.thinking))
                end = len(tokenize_messages(tokenizer, self.messages[:j + 1], tools=self.tools,
                                            thinking=self.thinking, add_generation_prompt=False))
                spans.append((start, end))
        return spans

    def reply_mask(self, tokenizer: Tokenizer) -> np.ndarray:
        """bool [len(render)]: the tokens a model generates in serving (`reply_spans`)."""
        mask = np.zeros(len(self.render(tokenizer)), bool)
        for start, end in self.reply_spans(tokenizer):
            mask[start:end] = True
        return mask

    def weights(self, tokenizer: Tokenizer) -> np.ndarray:
        """float32 [len(render)]: each token's loss weight as a target. Reply tokens weigh 1, those
        that are markers or follow one MARKER_WEIGHT, the rest CONTEXT_WEIGHT."""
        tokens = np.asarray(self.render(tokenizer))
        special = np.isin(tokens, list(tokenizer.special_ids))
        decides = special | np.concatenate([[False], special[:-1]])
        mask = self.reply_mask(tokenizer)
        return np.where(mask, np.where(decides, MARKER_WEIGHT, 1.0), CONTEXT_WEIGHT).astype(np.float32)

    def prompt(self, tokenizer: Tokenizer) -> list[int]:
        """The first user turn as a serving prompt (what a model continues in `closing_share`)."""
        first = self.messages[:1]
        return tokenize_messages(tokenizer, first, tools=self.tools, thinking=self.thinking)


def byte_tokenizer(cfg: K3Config) -> Tokenizer:
    """The embedded byte-level tokenizer (`convert.synth.write_tokenizer`'s files, read back)."""
    with tempfile.TemporaryDirectory() as tmp:
        write_tokenizer(tmp, cfg)
        return Tokenizer.from_dir(tmp)


def topics() -> dict[str, tuple[str, str]]:
    """name -> (title, body) of every pydoc topic, ASCII only (a byte vocabulary learns UTF-8 runs
    of the odd typographic character poorly; they are a handful)."""
    out = {}
    for name, text in sorted(pydoc_data.topics.topics.items()):
        text = text.encode("ascii", "ignore").decode()
        title, _, body = text.strip().partition("\n")
        body = re.sub(r"^\*+\n", "", body.lstrip("\n"))  # the title's underline
        out[name] = (title.strip(), body)
    return out


def passages(body: str) -> list[str]:
    """Paragraphs (blank-line separated, whitespace runs collapsed) merged up to PASSAGE_CHARS;
    a longer paragraph is cut at its last sentence end (or space) before the limit."""
    out, current = [], ""
    for paragraph in re.split(r"\n\s*\n", body):
        paragraph = " ".join(paragraph.split())
        while paragraph:
            if len(paragraph) > PASSAGE_CHARS:
                cut = max(paragraph.rfind(". ", 0, PASSAGE_CHARS) + 1, paragraph.rfind(" ", 0, PASSAGE_CHARS // 2))
                head, paragraph = paragraph[:cut or PASSAGE_CHARS].strip(), paragraph[cut or PASSAGE_CHARS:].strip()
            else:
                head, paragraph = paragraph, ""
            if current and len(current) + 1 + len(head) > PASSAGE_CHARS:
                out.append(current)
                current = ""
            current = f"{current} {head}".strip()
    return out + ([current] if current else [])


def conversation(kind: str, name: str, title: str, passage: str, question: str) -> Conversation:
    user = {"role": "user", "content": question.format(title)}
    lead = ANSWER_LEAD
    if kind == "instant":
        return Conversation([user, {"role": "assistant", "content": lead + passage}], False, None)
    if kind == "thinking":
        reasoning = "A question about Python. I know the reference section on it."
        return Conversation([user, {"role": "assistant", "reasoning_content": reasoning, "content": lead + passage}],
                            True, None)
    call = {"id": "call_0", "type": "function",
            "function": {"name": "python_help", "arguments": json.dumps({"topic": name})}}
    answer = lead + " ".join(re.split(r"(?<=[.:])\s+", passage)[:ANSWER_SENTENCES])
    return Conversation([user,
                         {"role": "assistant", "reasoning_content": "I should look it up.", "content": "",
                          "tool_calls": [call]},
                         {"role": "tool", "tool_call_id": "call_0", "content": passage},
                         {"role": "assistant", "reasoning_content": "The section answers it.", "content": answer}],
                        True, TOOLS)


def greeting(index: int, thinking: bool) -> Conversation:
    said, reply = GREETINGS[index % len(GREETINGS)]
    assistant = {"role": "assistant", "content": reply}
    if thinking:
        assistant["reasoning_content"] = "A greeting. I greet back."
    return Conversation([{"role": "user", "content": said}, assistant], thinking, None)


def conversations(held_out: bool, seed: int = 0) -> list[Conversation]:
    """Every passage of the training (or held-out) topics as one conversation, kinds and questions
    drawn with `seed`; greetings (both modes) make up about one conversation in 40."""
    rng = np.random.default_rng(seed)
    out = []
    for i, (name, (title, body)) in enumerate(topics().items()):
        if (i % HELD_OUT_EVERY == HELD_OUT_EVERY - 1) != held_out:
            continue
        for passage in passages(body):
            out.append(conversation(KINDS[rng.integers(len(KINDS))], name, title, passage,
                                    QUESTIONS[rng.integers(len(QUESTIONS))]))
    out += [greeting(i, thinking=bool(i % 2)) for i in range(max(2, len(out) // 40))]
    return out


class Batches:
    """Rows of `length + 1` tokens (inputs and next-token targets) and `length` loss weights, packed
    with whole conversations drawn in a seeded order (each pass over them a new permutation): a row
    begins as a served prompt does, its later conversations teach the model what follows
    `<|end_of_msg|>`, and the rest is padding of weight 0. A conversation longer than a row keeps its
    assistant turns that fit (`fitted`), so no reply is cut before its closing markers. Weights are
    `Conversation.weights`: most tokens are fixed system text and quoted passages, and at full weight
    they crowd out the few that shape and close a turn."""

    def __init__(self, conversations: list[Conversation], tokenizer: Tokenizer, length: int, seed: int):
        self.pieces = [fitted(c, tokenizer, length + 1) for c in conversations]
        self.length = length
        self.pad = tokenizer.special_tokens.get(tokenizer.pad_token, 0)  # weight 0: never a target, after the rest
        self.rng = np.random.default_rng(seed)
        self.order: list[int] = []

    def _take(self, room: int) -> int | None:
        """The next conversation in the order (of the next LOOKAHEAD) that fits in `room` tokens,
        taken out of it; None when none does."""
        if not self.order:
            self.order = self.rng.permutation(len(self.pieces)).tolist()
        for i in range(len(self.order) - 1, max(-1, len(self.order) - 1 - LOOKAHEAD), -1):
            if len(self.pieces[self.order[i]][0]) <= room:
                return self.order.pop(i)
        return None

    def row(self) -> tuple[np.ndarray, np.ndarray]:
        tokens, weights = np.full(self.length + 1, self.pad, np.int32), np.zeros(self.length + 1, np.float32)
        used = 0
        while (taken := self._take(self.length + 1 - used)) is not None:
            piece_tokens, piece_weights = self.pieces[taken]
            tokens[used:used + len(piece_tokens)], weights[used:used + len(piece_tokens)] = piece_tokens, piece_weights
            used += len(piece_tokens)
        return tokens, weights[1:]  # a token's weight is its weight as a target

    def __call__(self, batch: int) -> tuple[np.ndarray, np.ndarray]:
        rows = [self.row() for _ in range(batch)]
        return np.stack([r[0] for r in rows]), np.stack([r[1] for r in rows])


def fitted(conversation: Conversation, tokenizer: Tokenizer, size: int) -> tuple[np.ndarray, np.ndarray]:
    """(tokens int32, weights float32) of `conversation` cut to at most `size` tokens: whole, or
    through the end of its last assistant turn that fits; a conversation none of whose turns fit
    (short rows) is cut at `size`."""
    tokens = np.asarray(conversation.render(tokenizer), np.int32)
    weights = conversation.weights(tokenizer)
    if len(tokens) > size:
        ends = [end for _, end in conversation.reply_spans(tokenizer) if end <= size]
        cut = ends[-1] if ends else size
        tokens, weights = tokens[:cut], weights[:cut]
    return tokens, weights


def unigram_perplexity(train: np.ndarray, held_out: np.ndarray, vocab: int) -> float:
    """Perplexity of held-out tokens under the training tokens' add-one unigram distribution."""
    counts = np.bincount(train, minlength=vocab) + 1.0
    logp = np.log(counts / counts.sum())
    return float(np.exp(-logp[held_out].mean()))
