"""Models built from the attention plugins: the transformer stack and output heads."""
