"""The engine's side of images: the vision encoder's outputs, cached, cut to each prefill chunk.

A request's images arrive prepared (serve/multimodal.py: pixels, content digest, pad span). The
encoder runs on an image the first time a prefill chunk reaches one of its pad positions, on the
engine's thread inside the step (so an image the encoder fails on fails its request alone, as any
failing step does), and its output [tokens, H] is kept by the image's digest under a byte budget,
least recently used first out (vLLM's encoder cache): a later chunk of the same image, a prefix-cache
hit that resumes inside its span, a preempted request's recompute and another request with the same
pixels reuse it. An output larger than the whole budget is used and not kept.
"""

from __future__ import annotations

import collections

import numpy as np

from serve.multimodal import ImageInput

DEFAULT_BUDGET_BYTES = 1 << 30


class EncoderCache:
    def __init__(self, encoder, budget_bytes: int = DEFAULT_BUDGET_BYTES):
        """encoder: a k3jax.vision.encoder.VisionEncoder."""
        self.encoder = encoder
        self.budget_bytes = budget_bytes
        self._outputs: collections.OrderedDict[bytes, np.ndarray] = collections.OrderedDict()
        self.num_bytes = 0
        self.hits = self.misses = 0

    def __contains__(self, image: ImageInput) -> bool:
        return image.digest in self._outputs

    def get(self, image: ImageInput) -> np.ndarray:
        """float32 [image.num_tokens, H]: the embeddings of the image's pad positions, in order."""
        if (out := self._outputs.get(image.digest)) is not None:
            self._outputs.move_to_end(image.digest)
            self.hits += 1
            return out
        self.misses += 1
        out = self.encoder.encode(image.prepared)
        if out.shape[0] != image.num_tokens:
            raise ValueError(f"the encoder gave {out.shape[0]} embeddings for an image of {image.num_tokens} tokens")
        if out.nbytes <= self.budget_bytes:
            while self.num_bytes + out.nbytes > self.budget_bytes:
                self.num_bytes -= self._outputs.popitem(last=False)[1].nbytes
            self._outputs[image.digest] = out
            self.num_bytes += out.nbytes
        return out

    def step_embeds(self, rows, positions: list[int], num_rows: int, num_tokens: int):
        """The embeddings override of a step (`serve.runner.Runner.run`'s `embeds`): rows are (new
        tokens, request) with the chunk starting at request.computed, at `positions` of the step's
        rows. None when no chunk reaches an image's pads (a decode step never does: a prompt ends
        after its last image's <|media_end|>)."""
        values = mask = None
        for i, (new, request) in zip(positions, rows):
            start, end = request.computed, request.computed + len(new)
            for span in request.images:  # serve.multimodal.ImageSpan, in prompt order
                lo, hi = max(span.start, start), min(span.end, end)
                if lo >= hi:
                    continue
                if values is None:
                    values = np.zeros((num_rows, num_tokens, self.encoder.config.text_hidden_size), np.float32)
                    mask = np.zeros((num_rows, num_tokens), bool)
                values[i, lo - start:hi - start] = self.get(span.image)[lo - span.start:hi - span.start]
                mask[i, lo - start:hi - start] = True
        return None if values is None else (values, mask)
