"""A request's output text as its tokens arrive, and the stop strings found in it."""

from __future__ import annotations

from serve.sampling import SamplingParams


class OutputText:
    """A request's output text, detokenized as tokens arrive; `feed` says when a stop string appeared
    (the text is then cut before it, as OpenAI and vLLM return it, or after it with
    include_stop_str_in_output)."""

    def __init__(self, tokenizer, params: SamplingParams):
        self.decoder = tokenizer.incremental_decoder(
            skip_special_tokens=params.skip_special_tokens, keep_special_tokens=params.keep_special_tokens,
            spaces_between_special_tokens=params.spaces_between_special_tokens)
        self.stops = params.stop
        self.include_stop = params.include_stop_str_in_output
        self.text = ""
        self.stopped = False
        self.finished = False
        # Text that a stop string could still begin in is not handed out: it might be cut.
        self.holdback = max((len(stop) for stop in self.stops), default=1) - 1
        self.sent = 0

    def feed(self, token: int) -> bool:
        start = len(self.text)
        self.text += self.decoder.feed(token)
        # a stop string may straddle the previous text and the new piece; the earliest one wins
        found = [(at, stop) for stop in self.stops if (at := self.text.find(stop, max(0, start - len(stop) + 1))) >= 0]
        if found:
            at, stop = min(found)
            self.text = self.text[:at + len(stop) if self.include_stop else at]
            self.stopped = True
        return self.stopped

    def finish(self) -> None:
        """Completes the text with the bytes of a character the last token left unfinished, unless cut."""
        if not self.stopped and not self.finished:
            self.text += self.decoder.finish()
        self.finished = True

    def take(self, final: bool) -> str:
        """The text not handed out yet that no stop string can cut any more (all of it when final)."""
        end = len(self.text) if final else max(self.sent, len(self.text) - self.holdback)
        new, self.sent = self.text[self.sent:end], end
        return new
