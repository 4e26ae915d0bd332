"""The training corpus: K3 chat conversations about Python, from text every Python install ships.

The source is `pydoc_data.topics` (the language reference's sections that `help("if")` prints, about
490 KB of English). Each topic is cut into passages of at most PASSAGE_CHARS, and each passage
becomes one conversation of one of four kinds, in K3's chat format (`serve.chat.encoding`, the
serving prompt's own renderer, so training and serving frame a turn identically):

- instant: the user asks about the topic, the assistant answers in the response channel;
- thinking: the same with a short reasoning in the think channel first;
- tool: thinking mode with a `python_help` tool declared; the assistant calls it with the topic's
  title (XTML `tools` channel), the tool returns the passage, the assistant answers from it;
- greeting (a few per epoch): "Hello" and friends get a greeting back, meant to be the embedded
  model's first answer in `make serve`. The shipped model does not learn them: its replies do not
  yet depend on what the user wrote (no held-out reply names the topic asked about). With one
  greeting in ten, or the first reply token weighed 4x, more replies close, but by collapsing onto
  one greeting whatever was asked: the closing share is no measure of replies that answer.

Every answer is the passage's first sentence (`first_sentence`), and every conversation ends with
the assistant's `<|close|>message<|sep|><|end_of_msg|>`: the model learns to close its channels and
its turn. A greedy reply closes only where closing is the likeliest next token. With whole passages
as answers it never was: 0 of 43 held-out replies closed. Each reasoning is one fixed sentence that
names no topic, the tool's argument is the title the user wrote, and no topic gives more than
MAX_PASSAGES (the three largest held a third of all passages, and their titles became what the model
wrote in every reply). With these and 400 steps, every held-out tool call and instant answer
closes, no thinking answer does (training.json's `closing_share`; a run whose rows never held the
answers to tool results closed the thinking answers and not the instant ones: which memorised phrase
a reply falls into decides it). No reply names the topic asked (`topic_share`) and no answer to a
tool's result quotes it (`quoting_share`): the model copies nothing from its context. Answers that
began by restating the title ("{title}: {first sentence}", 400 steps) named it in none of 41 held-out
replies either, and fewer closed (14 of 43 against 29). Topics are split into training and held-out
sets by name (every HELD_OUT_EVERY-th topic), so held-out perplexity is measured on unseen sections.
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
MAX_PASSAGES = 24  # per topic: its first ones
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


def conversation(kind: str, title: str, passage: str, question: str) -> Conversation:
    user = {"role": "user", "content": question.format(title)}
    answer = first_sentence(passage)
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
                         {"role": "tool", "tool_call_id": "call_0", "content": passage},
                         {"role": "assistant", "reasoning_content": "I have the section now.", "content": answer}],
                        True, TOOLS, title)


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
    for i, (title, body) in enumerate(topics().values()):
        if (i % HELD_OUT_EVERY == HELD_OUT_EVERY - 1) != held_out:
            continue
        for passage in passages(body)[:MAX_PASSAGES]:
            out.append(conversation(KINDS[rng.integers(len(KINDS))], title, passage,
                                    QUESTIONS[rng.integers(len(QUESTIONS))]))
    out += [greeting(i, thinking=bool(i % 2)) for i in range(max(2, len(out) // 40))]
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
