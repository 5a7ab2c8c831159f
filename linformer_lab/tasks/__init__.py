"""LightningModules: the copy task, pixel-by-pixel image generation and CTC speech recognition."""
