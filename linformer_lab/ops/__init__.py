"""Pure tensor functions (no module state) behind the attention backends."""
