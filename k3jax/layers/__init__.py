"""The decoder's building blocks: NNX modules named after the checkpoint modules they load from."""
