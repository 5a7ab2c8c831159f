"""Generation speed, in one wing: what makes sampling one position at a time (paper §3.4) fast,
beside the readable ``Transformer.step`` every path is tested equal to. Its modules, which import
one way (sampling > graph_step > dynamic_step > cpu_step > weights > form): docs/ARCHITECTURE.md,
"Layers" and "Where speed code goes". The names other code uses are exported here.
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
