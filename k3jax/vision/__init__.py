"""Vision input: image preprocessing, the MoonViT tower and projector, and their checkpoint loading."""
