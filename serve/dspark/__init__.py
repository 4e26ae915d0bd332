"""DSpark speculative decoding on the serving side: the draft model and its loading, proposals from
the target's tapped hidden states, verification windows and rejection sampling (ARCHITECTURE.md,
"DSpark draft")."""
