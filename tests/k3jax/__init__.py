"""Tests of the model: config parsing, each layer against a NumPy version of its formulas, the decoder
over every cache kind, speculative windows and the compiled decode step."""
