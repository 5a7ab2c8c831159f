"""The kernels' self-check (``cli.py plugins --check``) and :func:`describe`: every candidate of every
op in :mod:`linformer_lab.ops.kernels` that can run here, built or compiled at its first launch,
compared with its op's PyTorch reference at a small shape, forward and backward. One table of
inputs per op, :data:`PROBES`, serves both.

The expectation is the reference in float64 on the same inputs; a candidate passes when the normwise
relative error of every output and input gradient is within ``max(FLOOR[dtype], SLACK x the
reference's own error in the candidate's dtype)``: a kernel may round as the reference does, but a
wrong index or a lost term is an error of order one. The inputs are those a model gives: odd lengths,
state in and out, values of mean one (which expose cancellation in half precision), masked slots.
A candidate that raises or disagrees fails (:func:`error_line` names the switch that forces the
PyTorch form); one that does not apply or cannot be built here is reported, not a failure.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from linformer_lab.ops import kernels
from linformer_lab.registry import FEATURE_MAPS

#: Largest relative error any candidate may have in a dtype, whatever the reference's: float32
#: products on a GPU's matrix units round to tf32 (10 bits) inside Triton kernels.
FLOOR = {torch.float64: 1e-10, torch.float32: 5e-3, torch.float16: 1e-2, torch.bfloat16: 5e-2}
#: How many times the reference's own error in a dtype a candidate may have.
SLACK = 8.0


@dataclass
class CheckResult:
    """One candidate on one device and dtype: ``status`` ``pass``, ``FAIL``, ``error`` (raised) or
    ``not here``; ``error``/``allowed``: the worst relative error and its bound (None unless run)."""

    op: str
    candidate: str
    device: str
    dtype: str
    status: str
    detail: str = ""
    error: float | None = None
    allowed: float | None = None

    @property
    def failed(self) -> bool:
        return self.status in ("FAIL", "error")


# A probe makes an op's inputs (the same draws in every dtype): ``probe(device, dtype) -> (accepts_args,
# leaves, call)``, ``call(candidate) -> {name: output}``, ``leaves`` the inputs whose gradients are compared.


def _draw(seed: int, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _leaves(tensors, device, dtype) -> list[torch.Tensor]:
    return [t.to(device=device, dtype=dtype).requires_grad_() for t in tensors]


def _causal(device: str, dtype: torch.dtype):
    b, h, n, c, m = 2, 2, 37, 32, 32
    q, k = (_draw(s, b, h, n, c).abs().add(0.1).div(c**0.5) for s in (1, 2))  # feature-mapped: positive
    v, s0 = _draw(3, b, h, n, m).add(1.0), _draw(4, b, h, c, m)
    q, k, v, s0 = _leaves((q, k, v, s0), device, dtype)

    def call(candidate):
        out, s_n = candidate.run(q, k, v, None, s0, True)
        return {"out": out, "S_N": s_n}

    return (q, k, v, s0), {"q": q, "k": k, "v": v, "S_0": s0}, call


def _lsh_window(device: str, dtype: torch.dtype):
    b, h, chunks, chunk, d, m = 1, 2, 3, 4, 8, 6
    q, k = (_draw(s, b, h, chunks, chunk, d).div(d**0.5) for s in (5, 6))
    v = _draw(7, b, h, chunks, chunk, m).add(1.0)
    generator = torch.Generator().manual_seed(8)
    positions = torch.stack([torch.randperm(chunks * chunk, generator=generator) for _ in range(b * h)])
    positions = positions.view(b, h, chunks, chunk).to(device)
    valid = (torch.rand(b, h, chunks, chunk, generator=generator) > 0.2).to(device)
    q, k, v = _leaves((q, k, v), device, dtype)

    def call(candidate):
        out, lse = candidate.run(q, k, v, positions, valid, None, True)
        return {"out": out, "lse": torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))}  # masked rows: -inf

    return (q, k, v), {"q": q, "k": k, "v": v}, call


def _causal_attention(device: str, dtype: torch.dtype):
    b, h, n, d, m = 2, 2, 37, 16, 8
    q, k, v = _draw(9, b, h, n, d), _draw(10, b, h, n, d), _draw(11, b, h, n, m).add(1.0)
    s0, z0 = _draw(12, b, h, d, m), _draw(13, b, h, d).abs().add(1.0)
    q, k, v = _leaves((q, k, v), device, dtype)
    state_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    s0, z0 = _leaves((s0, z0), device, state_dtype)
    feature_map = FEATURE_MAPS.get("elu")(d).to(device)  # through the registry: ops sits below feature_maps
    reference_numerator = kernels.fallback("causal").run

    def dot_product(phi_q, phi_k, v, initial_state=None, return_final_state=False):
        return reference_numerator(phi_q, phi_k, v, None, initial_state, return_final_state)

    def call(candidate):
        out, state = candidate.run(feature_map, q, k, v, None, 1e-6, dot_product, (s0, z0), True)
        return {"out": out, "S_N": state[0], "Z_N": state[1]}

    return (feature_map, q, k, v), {"q": q, "k": k, "v": v, "S_0": s0, "Z_0": z0}, call


def _fused_step(device: str, dtype: torch.dtype, steps: Callable | None = None):
    """Generation's fused step (no backward): ``steps(x (B, T, D), candidate) -> (B, T, D)`` runs a
    small model over ``x`` with the candidate forced. Building a model is above ``ops/``: the CLI
    passes ``steps`` (without it the probe gives :func:`describe` its inputs only, ``call`` None)."""
    x = _draw(14, 1, 5, 16).to(device=device, dtype=dtype)
    return (x[:, 0],), {}, (lambda candidate: {"out": steps(x, candidate)}) if steps else None


#: op -> (what :func:`describe` says of the inputs, the probe).
PROBES: dict[str, tuple[str, Callable]] = {
    "causal": ("float32, C = M = 32", _causal), "lsh_window": ("float32", _lsh_window),
    "fused_step": ("float32, batch 1", _fused_step), "causal_attention": ("float32, elu map", _causal_attention)}


def describe() -> list[str]:
    """One line per op and device (the CPU; CUDA where a GPU is visible): the candidate that runs
    it here, e.g. ``lsh_window op on cpu (float32): C++ window kernel (...), avx512``; then the
    switch. Builds the C++ extensions that are not built yet."""
    lines = []
    for op, (inputs, probe) in PROBES.items():
        for device in _devices():
            chosen = kernels.select(op, *probe(device, torch.float32)[0])
            detail = f", {chosen.detail()}" if chosen.detail is not None else ""
            lines.append(f"{op} op on {device} ({inputs}): {chosen.description}{detail}")
    value = os.environ.get(kernels.SWITCH, "").strip()
    lines.append(f"{kernels.SWITCH}={value}: forced {kernels.forced()}" if value
                 else f"{kernels.SWITCH} unset: each op takes its first candidate that applies")
    return lines


def _devices() -> list[str]:
    return ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _relative(got: torch.Tensor | None, want: torch.Tensor | None) -> float:
    if got is None or want is None:
        return 0.0 if got is None and want is None else float("inf")
    got, want = got.detach().double().cpu(), want.detach().double().cpu()
    if got.shape != want.shape or not bool(torch.isfinite(got).all()):
        return float("inf")
    return float((got - want).norm() / want.norm().clamp_min(1e-30))


def _evaluate(probe: Callable, device: str, dtype: torch.dtype, candidate) -> tuple[list[torch.Tensor], list[str]]:
    """The candidate's outputs and input gradients on ``probe``, with their names."""
    _, leaves, call = probe(device, dtype)
    with torch.autocast(device, enabled=False):
        named = call(candidate)
    outputs, names = list(named.values()), list(named)
    if leaves:
        weights = [_draw(20 + i, *o.shape).to(device=o.device, dtype=o.dtype) for i, o in enumerate(outputs)]
        loss = sum((o * w).sum() for o, w in zip(outputs, weights))
        outputs += list(torch.autograd.grad(loss, list(leaves.values()), allow_unused=True))
        names += [f"grad {name}" for name in leaves]
    return outputs, names


def check_kernels(devices: list[str] | None = None, ops: list[str] | None = None,
                  steps: Callable | None = None) -> list[CheckResult]:
    """Every candidate but the references of ``ops`` (default: all, ``fused_step`` where ``steps`` is
    given: :func:`_fused_step`) on ``devices`` (default: the CPU, and CUDA where a GPU is visible) in
    float32, on a GPU also in bfloat16."""
    results = []
    for op in ops or [op for op in PROBES if steps or op != "fused_step"]:
        probe = functools.partial(PROBES[op][1], steps=steps) if op == "fused_step" else PROBES[op][1]
        reference = kernels.fallback(op)
        for device in devices or _devices():
            for dtype in [torch.float32, torch.bfloat16] if device == "cuda" else [torch.float32]:
                label = str(dtype).removeprefix("torch.")
                want = None
                for candidate in kernels.CANDIDATES[op][:-1]:
                    result = CheckResult(op, candidate.name, device, label, "not here")
                    results.append(result)
                    if not candidate.accepts(*probe(device, dtype)[0]):
                        result.detail = f"needs {candidate.condition}"
                        continue
                    if not candidate.available():
                        result.detail = f"cannot be built or loaded here; {op} runs on its next candidate"
                        continue
                    if want is None:  # the expectation, and the reference's own error in this dtype
                        want, names = _evaluate(probe, device, torch.float64, reference)
                        own = _evaluate(probe, device, dtype, reference)[0]
                        reference_error = max(_relative(g, w) for g, w in zip(own, want))
                    try:
                        got, _ = _evaluate(probe, device, dtype, candidate)
                    except Exception as err:  # noqa: BLE001 - any failure to build, compile or launch is the finding
                        first = str(err).strip().splitlines()[0][:300] if str(err).strip() else ""
                        result.status, result.detail = "error", f"{type(err).__name__}: {first}"
                        continue
                    errors = [_relative(g, w) for g, w in zip(got, want)]
                    worst = max(range(len(errors)), key=errors.__getitem__)
                    result.error, result.allowed = errors[worst], max(FLOOR[dtype], SLACK * reference_error)
                    result.status = "pass" if result.error <= result.allowed else "FAIL"
                    result.detail = f"worst: {names[worst]}; the reference in {label}: {reference_error:.1e}"
    return results


def error_line(result: CheckResult) -> str:
    """One line for a failed candidate, naming the switch that runs the PyTorch form instead."""
    what = ("failed to compile or launch" if result.status == "error"
            else f"disagrees with the reference (relative error {result.error:.2e} > {result.allowed:.1e})")
    return (f"error: kernel {result.op}={result.candidate} on {result.device} {result.dtype} {what}: {result.detail}; "
            f"run with {kernels.SWITCH}={result.op}={kernels.PYTORCH} (or {kernels.SWITCH}={kernels.PYTORCH} "
            "for every op) to use the PyTorch form")


def report(results: list[CheckResult]) -> list[str]:
    """The check as lines, one per candidate, device and dtype."""
    return [f"{r.op}={r.candidate} on {r.device} {r.dtype}: {r.status} ("
            + (f"relative error {r.error:.1e}, allowed {r.allowed:.1e}; " if r.error is not None else "") + f"{r.detail})"
            for r in results]
