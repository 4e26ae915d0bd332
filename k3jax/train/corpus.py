"""The training corpus: K3 chat conversations about Python, from text every Python install ships.

The source is `pydoc_data.topics` (the language reference's sections that `help("if")` prints, about
490 KB of English). Each topic gives conversations of four kinds, in K3's chat format
(`serve.chat.encoding`, the serving prompt's own renderer, so training and serving frame a turn
identically):

- instant: the user asks about the topic, the assistant answers in the response channel;
- thinking: the same with a short reasoning in the think channel first;
- tool: thinking mode with a `python_help` tool declared; the assistant calls it with the topic's
  title (XTML `tools` channel), the tool returns one of the topic's passages (cut at PASSAGE_CHARS),
  the assistant answers with the passage's first sentence;
- greeting (one conversation in GREETING_EVERY): "Hello" and friends get a greeting back.

Every question about a topic, in each of the four wordings and both modes, gets the same answer: the
topic's `summary`, one plain sentence of its text. Every conversation ends with the assistant's
`<|close|>message<|sep|><|end_of_msg|>`, and a greedy reply closes only where closing is the
likeliest next token: with one sentence per topic every held-out reply closes (training.json's
`closing_share` 1.0, 78 conversations). The previous corpus answered each question with a random
passage's first sentence (a different answer every time a topic was asked), and every thinking
answer and every thinking greeting looped inside a sentence until the token limit (0.60).

The model still does not read the question: a trained question gets another topic's summary
(`recall_share` 0), a greeting gets an answer about Python (`greeting_share` 0), and teacher-forced,
the loss of an answer's first tokens is the same under the right question and another topic's
(2.02 against 2.03 nats). The wrong question moves the logits at the reply's start by at most 0.1
(instant) and 0.01 (thinking): the information reaches the position, the model has not learned to
use it in 400 steps. Neither a larger share of questions (one tool passage per topic: 5 passes over
the questions instead of 3) nor greetings at one in ten changed that (recall 2 of 144, greetings 0,
closing 0.90). No tool call names the title the user wrote (`topic_share`) and no answer to a tool's
result quotes it (`quoting_share`): the model copies nothing from its context. Topics are split into
training and held-out sets by name (every HELD_OUT_EVERY-th topic), so held-out perplexity is
measured on unseen sections.
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

PASSAGE_CHARS = 360
HELD_OUT_EVERY = 10
TOOL_PASSAGES = 3  # per topic: its first ones, each a tool conversation
GREETING_EVERY = 20  # one conversation in GREETING_EVERY is a greeting
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


@dataclasses.dataclass(frozen=True)
class Conversation:
    messages: list[dict]
    thinking: bool
    tools: list[dict] | None
    topic: str | None = None  # the title the user asked about (None: a greeting)

    def render(self, tokenizer: Tokenizer) -> list[int]:
        return tokenize_messages(tokenizer, self.messages, tools=self.tools, thinking=self.thinking,
                                 add_generation_prompt=False)

    def reply_mask(self, tokenizer: Tokenizer) -> np.ndarray:
        """bool [len(render)]: the tokens a model generates in serving (each assistant turn after
        the prompt's channel opener, through `<|end_of_msg|>`)."""
        mask = np.zeros(len(self.render(tokenizer)), bool)
        for j, message in enumerate(self.messages):
            if message["role"] == "assistant":
                start = len(tokenize_messages(tokenizer, self.messages[:j], tools=self.tools, thinking=self.thinking))
                end = len(tokenize_messages(tokenizer, self.messages[:j + 1], tools=self.tools,
                                            thinking=self.thinking, add_generation_prompt=False))
                mask[start:end] = True
        return mask

    def prompt(self, tokenizer: Tokenizer) -> list[int]:
        """The first user turn as a serving prompt (what a model continues in `metrics.reply_figures`)."""
        first = self.messages[:1]
        return tokenize_messages(tokenizer, first, tools=self.tools, thinking=self.thinking)

    def result_prompt(self, tokenizer: Tokenizer) -> list[int]:
        """A tool conversation through the tool's result, as a serving prompt (the reply answers from it)."""
        return tokenize_messages(tokenizer, self.messages[:3], tools=self.tools, thinking=self.thinking)


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


def first_sentence(passage: str) -> str:
    """The passage up to its first sentence end (a full stop before whitespace), ending in a full stop."""
    sentence = re.split(r"(?<=\.)\s", passage, maxsplit=1)[0].rstrip(":;, ")
    return sentence if sentence.endswith(".") else f"{sentence}."


def summary(title: str, body: str) -> str:
    """The topic's one answer to every question about it: its first plain sentence of 30 to 140
    characters (no grammar rules, bullets or headings), else one naming the title."""
    for passage in passages(body):
        for sentence in re.split(r"(?<=\.)\s", passage):
            if 30 <= len(sentence) <= 140 and re.fullmatch(r"[A-Z][A-Za-z0-9 ,;()\"'*._-]*\.", sentence):
                return sentence
    return f"{title} is a section of the Python language reference."


def conversation(kind: str, title: str, text: str, question: str) -> Conversation:
    """One conversation of `kind` about `title`: an instant or thinking one answers `text` (the
    topic's `summary`); in a tool one `text` is the tool's result (a passage) and the answer its
    first sentence."""
    user = {"role": "user", "content": question.format(title)}
    answer = text if kind != "tool" else first_sentence(text)
    if kind == "instant":
        return Conversation([user, {"role": "assistant", "content": answer}], False, None, title)
    if kind == "thinking":
        return Conversation([user, {"role": "assistant", "reasoning_content": "I know this one.", "content": answer}],
                            True, None, title)
    call = {"id": "call_0", "type": "function",
            "function": {"name": "python_help", "arguments": json.dumps({"topic": title})}}
    return Conversation([user,
                         {"role": "assistant", "reasoning_content": "I should look it up.", "content": "",
                          "tool_calls": [call]},
                         {"role": "tool", "tool_call_id": "call_0", "content": text},
                         {"role": "assistant", "reasoning_content": "I have the section now.", "content": answer}],
                        True, TOOLS, title)


def greeting(index: int, thinking: bool) -> Conversation:
    said, reply = GREETINGS[index % len(GREETINGS)]
    assistant = {"role": "assistant", "content": reply}
    if thinking:
        assistant["reasoning_content"] = "A greeting. I greet back."
    return Conversation([{"role": "user", "content": said}, assistant], thinking, None)


def conversations(held_out: bool, seed: int = 0) -> list[Conversation]:
    """The training (or held-out) topics' conversations: every question in both modes answered with
    the topic's `summary`, and a tool conversation for each of its first TOOL_PASSAGES passages (the
    question drawn with `seed`); greetings (both modes) make up one conversation in GREETING_EVERY."""
    rng = np.random.default_rng(seed)
    out = []
    for i, (title, body) in enumerate(topics().values()):
        if (i % HELD_OUT_EVERY == HELD_OUT_EVERY - 1) != held_out:
            continue
        answer = summary(title, body)
        out += [conversation(kind, title, answer, question)
                for question in QUESTIONS for kind in ("instant", "thinking")]
        out += [conversation("tool", title, passage, QUESTIONS[rng.integers(len(QUESTIONS))])
                for passage in passages(body)[:TOOL_PASSAGES]]
    out += [greeting(i, thinking=bool(i % 2)) for i in range(max(2, len(out) // (GREETING_EVERY - 1)))]
    return out


class Batches:
    """Rows of `length + 1` tokens (inputs and next-token targets) and `length` loss weights, each
    the concatenation of conversations drawn in a seeded order from a conversation start (a row
    begins as a served prompt does). A conversation longer than a row also gets a row that ends where
    it ends: tool conversations run 1128-1769 tokens, and rows of 1024 from their start never held the
    reply to the tool's result (so no model trained on them answered from a result: it called the tool
    again). Reply tokens weigh 1 and the rest CONTEXT_WEIGHT: most tokens
    are fixed system text and quoted passages, and at full weight they crowd out the few that close a
    turn. (At 0, the prompt side untrained, held-out replies looped instead: perplexity 8.6 against
    2.0, and no more of them closed.)"""

    def __init__(self, conversations: list[Conversation], tokenizer: Tokenizer, length: int, seed: int):
        rendered = [c.render(tokenizer) for c in conversations]
        stream = np.concatenate(rendered).astype(np.int32)
        weights = np.concatenate([np.where(c.reply_mask(tokenizer), 1.0, CONTEXT_WEIGHT) for c in conversations])
        self.tokens = np.concatenate([stream, stream[:length + 1]])  # rows near the end wrap around
        self.weights = np.concatenate([weights, weights[:length + 1]]).astype(np.float32)
        sizes = np.array([len(r) for r in rendered])
        ends = np.cumsum(sizes)
        long = sizes > length + 1
        self.starts = np.concatenate([ends - sizes, ends[long] - length - 1])
        self.length = length
        self.rng = np.random.default_rng(seed)

    def __call__(self, batch: int) -> tuple[np.ndarray, np.ndarray]:
        starts = self.rng.choice(self.starts, batch)
        return (np.stack([self.tokens[s:s + self.length + 1] for s in starts]),
                np.stack([self.weights[s + 1:s + self.length + 1] for s in starts]))


def unigram_perplexity(train: np.ndarray, held_out: np.ndarray, vocab: int) -> float:
    """Perplexity of held-out tokens under the training tokens' add-one unigram distribution."""
    counts = np.bincount(train, minlength=vocab) + 1.0
    logp = np.log(counts / counts.sum())
    return float(np.exp(-logp[held_out].mean()))
