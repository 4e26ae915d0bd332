"""The K3 DSpark draft model, beside the target model it drafts for (ARCHITECTURE.md, "DSpark draft"):
its config (`config`, pure Python, what `convert` reads), the model and its two jittable steps
(`model`: inject_context, propose), the Markov head's sampling (`markov`) and checkpoint loading
(`loading`). Built from k3jax/layers/; the serving side that drives it is serve/dspark/.

Nothing is imported here, so that `k3jax.dspark.config` stays free of jax for `convert`.
"""
