"""Generation speed, in one wing: what makes sampling one position at a time (paper §3.4) fast,
beside the readable ``Transformer.step`` every path is tested equal to (docs/ARCHITECTURE.md,
"Where speed code goes"). Imports go one way, down this list:

* :mod:`~linformer_lab.models.generation.sampling`: the sampling loop of
  ``PixelTransformer.generate``, the choice of decoder (``auto``, ``dynamic``, ``graph``), the
  kernel settings and the sampling noise;
* :mod:`~linformer_lab.models.generation.graph_step`: the GPU graph step, the whole generation
  step on static buffers (a CUDA graph per step on CUDA, eager elsewhere);
* :mod:`~linformer_lab.models.generation.dynamic_step`: ``fast_step``, the Python step;
* :mod:`~linformer_lab.models.generation.cpu_step`: the fused C++ CPU step
  (``linformer_lab/ops/cpu/fused_step.cpp``) that ``fast_step`` takes where it applies;
* :mod:`~linformer_lab.models.generation.weights`: the weight copies the steps read, and the
  fused plan made from them;
* :mod:`~linformer_lab.models.generation.form`: whether a stack is of the paper's form, and why not.

The names other code uses are exported here.
"""

from linformer_lab.models.generation.dynamic_step import CPU_MATMUL_MIN_ROWS, fast_step, split_heads
from linformer_lab.models.generation.form import why_not_paper_form
from linformer_lab.models.generation.sampling import (
    DECODERS,
    NOISE_BLOCK,
    SINGLE_THREAD_MAX_BATCH,
    generation_kernels,
    noise_per_position,
)
from linformer_lab.models.generation.weights import (
    STEP_WEIGHT_FORMATS,
    check_step_weight_format,
    quantize_int8,
    step_linear,
    weight_copies_for_steps,
)

__all__ = [
    "CPU_MATMUL_MIN_ROWS",
    "DECODERS",
    "NOISE_BLOCK",
    "SINGLE_THREAD_MAX_BATCH",
    "STEP_WEIGHT_FORMATS",
    "check_step_weight_format",
    "fast_step",
    "generation_kernels",
    "noise_per_position",
    "quantize_int8",
    "split_heads",
    "step_linear",
    "weight_copies_for_steps",
    "why_not_paper_form",
]
