"""Training the embedded k3-tiny in JAX (optax), on CPU: the chat corpus (`corpus`), the training
loop with gradients through the MoE path and the router's bias balancing (`target`), what the
trained model is measured by (`metrics`), its tiny vision tower trained against the frozen text
model (`vision`: it exercises the image path but does not see, its held-out captions at chance), the
DSpark draft's self-distillation (`draft`), and `python -m k3jax.train`, which writes the shipped
weights (`k3jax/weights/k3-tiny`)."""
