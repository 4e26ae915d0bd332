"""Prefill/decode disaggregation: a prefill server computes prompts, a decode server generates.

`python -m k3jax.serve --role prefill --transfer-port P` runs the prefill side: its engine runs
prompts (all but their last token) and hands their caches to decode servers (`prefill_server.py`).
`python -m k3jax.serve --role decode --prefill-url HOST:P` is the server clients talk to: it asks
the prefill server for each prompt's cache, writes it into its own pages and slot, and continues as
if it had prefilled the prompt itself (`decode.py`). What travels (`handoff.py`): the prompt's MLA
page rows in every MLA layer (as stored, fp8 included), its KDA recurrent state and short-conv window
in every KDA layer, and how many tokens they hold; the decode side computes the last prompt token and
samples from there. Control messages are frames over TCP (`frames.py`); the arrays go in those frames
or device to device through `jax.experimental.transfer` (`transport.py`, `--transfer-backend`).
"""
