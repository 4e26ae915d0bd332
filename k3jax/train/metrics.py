"""What the trained model is measured by: held-out perplexity, whether its chat replies close
their markers the way K3's format asks, and whether they depend on what was asked: trained questions
and greetings get their trained reply, held-out tool calls name the topic asked (served through the
engine, parsed by serve/chat)."""

from __future__ import annotations

import json

import numpy as np

from k3jax.model import K3Model
from k3jax.train.corpus import Conversation
from serve.chat.parsing import END_OF_MESSAGE, MESSAGE_CLOSE, RESPONSE_CLOSE, THINK_CLOSE, parse_output
from serve.chat.tokenizer import Tokenizer
from serve.engine import Engine, EngineOptions
from serve.sampling import SamplingParams

REPLY_TOKENS = 600  # a reply that has not closed by then does not close
QUOTED_WORDS = 3


def perplexity(model: K3Model, token_lists: list[list[int]], batch: int = 8) -> float:
    """exp of the mean next-token negative log-likelihood over every token but each list's first;
    the lists are scored whole, right-padded to the longest (one compiled shape)."""
    width = max(map(len, token_lists))
    nll, count = 0.0, 0
    for i in range(0, len(token_lists), batch):
        rows = token_lists[i:i + batch]
        tokens = np.zeros((batch, width), np.int32)
        lengths = np.ones(batch, np.int32)
        for r, row in enumerate(rows):
            tokens[r, :len(row)], lengths[r] = row, len(row)
        logits = model.logits(tokens, lengths)
        logp = logits - np.logaddexp.reduce(logits, axis=-1, keepdims=True)
        picked = np.take_along_axis(logp[:, :-1], tokens[:, 1:, None], -1)[..., 0]
        scored = np.arange(width - 1)[None] < lengths[:, None] - 1
        nll -= float(picked[scored].sum())
        count += int(scored.sum())
    return float(np.exp(nll / count))


def closes_markers(text: str, finish_reason: str, conversation: Conversation) -> bool:
    """Whether a reply (special tokens kept) ended its turn as K3's format asks: generation stopped
    at `<|end_of_msg|>` right after `<|close|>message<|sep|>`, the think channel (thinking mode) and
    the response channel closed, and the parser finds a reply in it: content, or a tool call when the
    conversation declared tools."""
    text = text.removesuffix(END_OF_MESSAGE)  # the stop token's own text, kept with the special tokens
    if finish_reason != "stop" or not text.endswith(MESSAGE_CLOSE) or RESPONSE_CLOSE not in text:
        return False
    if conversation.thinking and THINK_CLOSE not in text:
        return False
    parsed = parse_output(text, thinking=conversation.thinking, tools=conversation.tools)
    return bool(parsed.tool_calls) if conversation.tools else bool(parsed.content)


def names_topic(text: str, conversation: Conversation) -> bool:
    """Whether a reply to a tool conversation's first turn (special tokens kept) is about the topic
    the user named: a tool call whose `topic` argument is the title (case-insensitive)."""
    parsed = parse_output(text.removesuffix(END_OF_MESSAGE), thinking=conversation.thinking, tools=conversation.tools)
    for call in parsed.tool_calls or []:
        try:
            argument = json.loads(call["arguments"]).get("topic")
        except (json.JSONDecodeError, AttributeError):
            continue
        if isinstance(argument, str) and argument.lower() == conversation.topic.lower():
            return True
    return False


def quotes_result(text: str, finish_reason: str, conversation: Conversation) -> bool:
    """Whether a reply to a tool's result (special tokens kept) closes its turn with content that
    begins with the result's first QUOTED_WORDS words, as the corpus' answers do: copied from the
    prompt, since held-out topics were never trained on."""
    result = conversation.messages[2]["content"]
    text = text.removesuffix(END_OF_MESSAGE)
    parsed = parse_output(text, thinking=True, tools=conversation.tools)
    words = (parsed.content or "").split()
    return (finish_reason == "stop" and text.endswith(MESSAGE_CLOSE)
            and not parsed.tool_calls and len(words) >= QUOTED_WORDS
            and words[:QUOTED_WORDS] == result.split()[:QUOTED_WORDS])


def recites(text: str, finish_reason: str, conversation: Conversation) -> bool:
    """Whether a reply to a training conversation's first turn (special tokens kept) closes its
    markers with the content it was trained on (the topic's summary, or the greeting's reply)."""
    parsed = parse_output(text.removesuffix(END_OF_MESSAGE), thinking=conversation.thinking, tools=conversation.tools)
    return closes_markers(text, finish_reason, conversation) and parsed.content == conversation.messages[1]["content"]


def replies(model: K3Model, tokenizer: Tokenizer, prompts: list[list[int]]) -> list[tuple[str, str]]:
    """(text with special tokens, finish reason) of the greedy reply to each prompt."""
    engine = Engine(model, EngineOptions(max_model_len=2048, max_num_seqs=8), tokenizer=tokenizer)
    params = SamplingParams(temperature=0.0, max_tokens=REPLY_TOKENS, skip_special_tokens=False,
                            spaces_between_special_tokens=False)  # as the parsers read it
    outputs = engine.generate(prompts, [params] * len(prompts))
    return [(o.text, o.finish_reason) for o in outputs]


def reply_figures(model: K3Model, tokenizer: Tokenizer, conversations: list[Conversation]) -> dict:
    """Of the greedy replies to `conversations`' first turns: the share that `closes_markers`, and of
    the tool conversations', the share that `names_topic`; of the replies to the tool conversations'
    results, the share that `quotes_result`."""
    with_result = [c for c in conversations if c.tools]
    done = replies(model, tokenizer, [c.prompt(tokenizer) for c in conversations]
                   + [c.result_prompt(tokenizer) for c in with_result])
    first, answers = done[:len(conversations)], done[len(conversations):]
    closes = [closes_markers(text, reason, c) for (text, reason), c in zip(first, conversations)]
    on_topic = [names_topic(text, c) for (text, _), c in zip(first, conversations) if c.tools]
    quoting = [quotes_result(text, reason, c) for (text, reason), c in zip(answers, with_result)]
    return dict(closing_share=float(np.mean(closes)), topic_share=float(np.mean(on_topic)),
                quoting_share=float(np.mean(quoting)))


def recall_figures(model: K3Model, tokenizer: Tokenizer, conversations: list[Conversation]) -> dict:
    """Of the greedy replies to `conversations`' first turns (training conversations without tools),
    the share that `recites` its trained reply: over those asking about a topic (`recall_share`: a
    reply that depends on what was asked) and over the greetings (`greeting_share`)."""
    done = replies(model, tokenizer, [c.prompt(tokenizer) for c in conversations])
    recited = [recites(text, reason, c) for (text, reason), c in zip(done, conversations)]
    topics = [r for r, c in zip(recited, conversations) if c.topic is not None]
    greetings = [r for r, c in zip(recited, conversations) if c.topic is None]
    return dict(recall_share=float(np.mean(topics)), greeting_share=float(np.mean(greetings)))
