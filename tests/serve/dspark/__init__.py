"""Tests of DSpark speculative decoding: the draft against NumPy references, loading, rejection
sampling, and speculative engines and servers against plain ones."""
