"""Does the elu map's written-out backward (an autograd Function) pay 10 % anywhere? The Function
against plain autograd of the same phi, per layer call and per training update, interleaved in one
process, CPU time of the timing thread (the machine is shared).

    OMP_NUM_THREADS=1 uv run python benchmarks/dev/elu_function.py
    OMP_NUM_THREADS=1 uv run python benchmarks/dev/elu_function.py --cases speech_update --repeats 5

Variants of ``EluFeatureMap.forward`` (fp32, the same values bit for bit; each swapped in around its call):

* ``function``: an ``autograd.Function`` whose forward is ``elu_plus_one`` and whose backward is
  ``grad * min(phi, 1)`` from the saved output (``EluPlusOne``, copied here so the script times it
  whatever the library holds);
* ``autograd``: :func:`linformer_lab.ops.linear_attention.elu_plus_one` through autograd,
  ``where(x > 0, x + 1, exp(min(x, 0)))``.

Cases (forward + backward; the layers on random inputs, the updates with clipping and the config's
optimizer on random data, seed 0):

* ``noncausal_layer``: ``LinearAttention(causal=False)`` at the speech CPU recipe's shape
  (B 8, H 3, N 210, D 32) and ``noncausal_layer_large`` at (4, 8, 4096, 32): the map runs in Python;
* ``causal_layer``: ``LinearAttention(causal=True)`` at the MNIST CPU recipe's shape (4, 4, 784, 32)
  as dispatched (on CPU the fused C++ kernel, which computes phi itself), and
  ``causal_layer_reference`` with the ``causal_attention`` op forced to its reference (the map in
  Python, then the numerator's kernel: the path of maps the fused kernel lacks);
* ``mnist_update``: one update of ``configs/mnist_cpu_linear.yaml``'s model (causal);
* ``speech_update``: one update of ``configs/speech_cpu_linear.yaml``'s model (non-causal), its
  batch of 8 utterances of 420 frames, 60 phonemes each; ``speech_paper_update``: the same batch
  through ``configs/speech_linear.yaml``'s paper-shaped model (9 layers, d_model 192, no subsampling).

Results: ``<--out>.{csv,md}`` (default ``benchmarks/dev/results/elu_function``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py, which puts the repository on sys.path

import torch  # noqa: E402
import yaml  # noqa: E402
from common import (  # noqa: E402
    REPO,
    image_training_update,
    interleaved_medians,
    markdown_table,
    provenance,
    results_dir,
    write_csv,
)

from linformer_lab.attention.linear import LinearAttention  # noqa: E402
from linformer_lab.feature_maps.elu import EluFeatureMap  # noqa: E402
from linformer_lab.ops.linear_attention import elu_plus_one  # noqa: E402
from linformer_lab.tasks.speech import SpeechRecognitionTask  # noqa: E402


class EluWrittenOut(torch.autograd.Function):
    """phi = elu(x) + 1 with the backward grad * min(phi, 1), which needs only phi."""

    @staticmethod
    def forward(ctx, x):
        out = elu_plus_one(x)
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx, grad):
        (out,) = ctx.saved_tensors
        return grad * out.clamp(max=1)


VARIANTS = {"function": EluWrittenOut.apply, "autograd": elu_plus_one}


class ReferenceCausalAttention(LinearAttention):
    """The causal layer with the feature map applied in Python (the ``causal_attention`` reference)."""

    forced_kernels = {"causal_attention": "reference"}


def layer_call(layer_type, causal: bool, shape: tuple[int, int, int, int]):
    torch.manual_seed(0)
    layer = layer_type(causal=causal, query_dim=shape[-1])
    q, k, v = (torch.randn(*shape, requires_grad=True) for _ in range(3))
    grad = torch.randn(shape)

    def call():
        layer(q, k, v).backward(grad)
        for t in (q, k, v):
            t.grad = None
    return call


def speech_update(config: str, batch: int):
    with open(REPO / "configs" / config) as f:
        spec = yaml.safe_load(f)
    torch.manual_seed(0)
    task = SpeechRecognitionTask(**spec["model"]["init_args"])
    frames, phonemes = 420, 60
    data = {"features": torch.randn(batch, frames, 40), "feature_lengths": torch.full((batch,), frames),
            "targets": torch.randint(1, 40, (batch, phonemes)), "target_lengths": torch.full((batch,), phonemes)}
    optimizer = torch.optim.Adam(task.parameters(), lr=1e-3)

    def update():
        optimizer.zero_grad(set_to_none=True)
        task.ctc_loss(data)[0].backward()
        torch.nn.utils.clip_grad_norm_(task.parameters(), 1.0)
        optimizer.step()
    return update


CASES = {
    "noncausal_layer": lambda: layer_call(LinearAttention, False, (8, 3, 210, 32)),
    "noncausal_layer_large": lambda: layer_call(LinearAttention, False, (4, 8, 4096, 32)),
    "causal_layer": lambda: layer_call(LinearAttention, True, (4, 4, 784, 32)),
    "causal_layer_reference": lambda: layer_call(ReferenceCausalAttention, True, (4, 4, 784, 32)),
    "mnist_update": lambda: image_training_update("mnist_cpu_linear.yaml")[0],
    "speech_update": lambda: speech_update("speech_cpu_linear.yaml", 8),
    "speech_paper_update": lambda: speech_update("speech_linear.yaml", 8),
}


def cpu_timed(call, phi, samples: list[float]):
    """``call`` with ``phi`` as the elu map's forward, appending its CPU seconds (timing thread) to ``samples``."""
    def timed():
        original = EluFeatureMap.forward
        EluFeatureMap.forward = lambda self, x: phi(x)
        try:
            start = time.thread_time()
            call()
            samples.append(time.thread_time() - start)
        finally:
            EluFeatureMap.forward = original
    return timed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", nargs="+", choices=list(CASES), default=list(CASES))
    parser.add_argument("--repeats", type=int, default=9, help="interleaved rounds per case")
    parser.add_argument("--out", default=str(results_dir(__file__) / "elu_function"))
    args = parser.parse_args()
    torch.set_num_threads(1)  # CPU time of the timing thread is then the call's whole CPU time
    rows, table = [], []
    started = time.perf_counter()
    header = provenance(__file__, sys.argv[1:], rounds=f"{args.repeats} interleaved rounds per case, after one "
                        "untimed call of each variant; CPU time of the timing thread (1 torch thread)")
    for case in args.cases:
        call = CASES[case]()
        samples = {name: [] for name in VARIANTS}
        interleaved_medians({name: cpu_timed(call, phi, samples[name]) for name, phi in VARIANTS.items()},
                            args.repeats)
        median = {name: statistics.median(s[1:]) for name, s in samples.items()}  # s[0]: the warm-up call
        ratio = median["autograd"] / median["function"]
        rows.append({"case": case, **{f"{name}_cpu_ms": round(m * 1e3, 2) for name, m in median.items()},
                     "autograd_over_function": round(ratio, 3)})
        table.append([case, *(f"{m * 1e3:.2f}" for m in median.values()), f"{ratio:.3f}"])
        print(" | ".join(table[-1]), flush=True)
    write_csv(args.out + ".csv", rows)
    Path(args.out + ".md").write_text(
        "# The elu map: written-out backward (Function) against autograd, CPU time (fp32)\n\n" + "\n".join(header)
        + f"\n- {time.perf_counter() - started:.0f} s in all\n\n"
        + markdown_table(["case", "function ms", "autograd ms", "autograd / function"], table) + "\n")


if __name__ == "__main__":
    main()
