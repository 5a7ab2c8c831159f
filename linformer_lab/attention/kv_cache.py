"""Where :class:`KVCache` and :class:`SequenceBuffer` were defined before the states found their one
home, :mod:`linformer_lab.ops.state`: a state pickled then names this module, and loads through these names."""

from linformer_lab.ops.state import KVCache, SequenceBuffer

__all__ = ["KVCache", "SequenceBuffer"]
