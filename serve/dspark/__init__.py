"""DSpark speculative decoding on the serving side: proposals from the target's tapped hidden states,
verification windows and rejection sampling (ARCHITECTURE.md, "DSpark draft"). The draft model and
its loading are k3jax.dspark."""
