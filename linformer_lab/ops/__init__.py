"""Tensor functions behind the attention backends; module state only for the compiled kernels
(docs/ARCHITECTURE.md, "Layers")."""
