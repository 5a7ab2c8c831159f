"""linformer_lab: linear attention from "Transformers are RNNs" (Katharopoulos et al. 2020).

Public API::

    import linformer_lab as ll
    ll.list_feature_maps()                      # ['elu', 'favor', 'poly2', 'random_fourier', ...]
    ll.list_attention()                         # ['linear', 'linear_cuda', 'lsh', 'softmax', ...]
    fm = ll.build_feature_map("elu", query_dim=32)
    attn = ll.build_attention("linear", causal=True, query_dim=32, feature_map="favor")
    out = attn(q, k, v, key_lengths=None)       # (B, H, N, D), (B, H, N, D), (B, H, N, M) -> (B, H, N, M)
    out_t, state = attn.step(q_t, k_t, v_t)     # RNN mode: (B, H, D), (B, H, D), (B, H, M) -> (B, H, M)
    # building blocks of your own model; attention as a name, a dict, an AttentionConfig (or, for
    # one layer, a built Attention)
    stack = ll.Transformer(6, 128, 4, attention="linear")  # (B, N, 128) -> (B, N, 128); step: (B, 128)
    mha = ll.MultiHeadAttention(128, 4, attention={"backend": "linear", "feature_map": "favor"})
    out = mha(x, context=memory)                # cross attention: keys and values from memory (B, L, 128)
    kept = ll.clone_state(state)                # any state (a backend's, a stack's) in memory of its own
    task = ll.from_pretrained("export")         # a folder cli.py export wrote, in eval mode
    ll.context_parallel(stack)                  # each process's input: its consecutive segment of one sequence
    ll.plot_runs(["logs/mnist_linear"], "curves.png")  # runs' training and validation curves (cli.py plot)
"""

import importlib
from types import ModuleType

__version__ = "0.1.0"

#: Public name -> the module that defines it. Imported on first use (``__getattr__`` below), so
#: ``import linformer_lab`` loads no torch: ``cli.py --help`` and ``cli.py plugins`` need none.
_EXPORTS = {
    "ATTENTION": "linformer_lab.registry",
    "AttentionConfig": "linformer_lab.attention.config",
    "FEATURE_MAPS": "linformer_lab.registry",
    "MultiHeadAttention": "linformer_lab.attention.multihead",
    "PluginError": "linformer_lab.registry",
    "Transformer": "linformer_lab.models.transformer",
    "TransformerLayer": "linformer_lab.models.transformer",
    "build_attention": "linformer_lab.attention.config",
    "build_feature_map": "linformer_lab.feature_maps",
    "clone_state": "linformer_lab.ops.state",
    "context_parallel": "linformer_lab.attention.context_parallel",
    "context_segment": "linformer_lab.attention.context_parallel",
    "detach_state": "linformer_lab.ops.state",
    "from_pretrained": "linformer_lab.tasks.export",
    "list_attention": "linformer_lab.attention.config",
    "list_feature_maps": "linformer_lab.feature_maps",
    "plot_runs": "linformer_lab.tasks.curves",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups find it without coming here
    return value


def __dir__() -> list[str]:
    # the public names, the module's own dunders and its loaded subpackages; not the helpers this file imports
    own = {name for name, value in globals().items()
           if name.startswith("__") or (isinstance(value, ModuleType) and value.__name__ == f"{__name__}.{name}")}
    return sorted(own | set(_EXPORTS))
