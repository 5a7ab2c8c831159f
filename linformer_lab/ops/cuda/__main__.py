"""Command line for the linear_cuda extension.

    python -m linformer_lab.ops.cuda build [--arch 8.0 9.0 ...] [--build-dir DIR] [-v]
    python -m linformer_lab.ops.cuda info

`build` compiles the extension into the cache (for the given architectures, else
TORCH_CUDA_ARCH_LIST, else the visible GPUs). With --arch it needs no GPU, so a login node with
nvcc can prepare the cache that GPU nodes without a compiler then load: point both at the same
folder (shared home, or LINFORMER_LAB_BUILD_DIR / --build-dir).
"""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m linformer_lab.ops.cuda", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p_build = sub.add_parser("build", help="compile the extension into the cache")
    p_build.add_argument(
        "--arch",
        nargs="+",
        metavar="CC",
        help="compute capabilities, e.g. 8.0 9.0 (append +PTX to also embed PTX for newer GPUs); "
        "default: $TORCH_CUDA_ARCH_LIST, else the visible GPUs",
    )
    p_build.add_argument(
        "--build-dir", help="cache root (default: $LINFORMER_LAB_BUILD_DIR/cuda or ~/.cache/linformer_lab/cuda)"
    )
    p_build.add_argument(
        "-v", "--verbose", action="store_true", help="show the compiler commands and ptxas register/shared-memory usage"
    )
    sub.add_parser("info", help="show toolchain, GPUs and cached builds")
    args = parser.parse_args(argv)

    from linformer_lab.ops import cuda  # after argument parsing: importing torch is slow

    if args.command == "build":
        try:
            archs = cuda.parse_arch_list(args.arch) if args.arch else cuda.default_archs()
            library = cuda.build(archs, build_dir=args.build_dir, verbose=args.verbose, ptxas_verbose=args.verbose)
        except (RuntimeError, ValueError) as err:
            print(f"error: {err}", file=sys.stderr)
            return 1
        print(f"built {library} for {' '.join(map(str, archs))}")
        return 0

    import torch

    print(f"torch {torch.__version__} (CUDA {torch.version.cuda}), Python {sys.version.split()[0]}")
    print(f"CUDA toolkit: {cuda.find_cuda_home() or 'not found'}")
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            major, minor = torch.cuda.get_device_capability(i)
            print(f"cuda:{i}: {torch.cuda.get_device_name(i)} (compute capability {major}.{minor})")
    else:
        print("no CUDA GPU visible")
    root = cuda.cache_root()
    builds = sorted(root.glob("*/*/build_info.json"))
    print(f"cache {root}: " + (", ".join(str(b.parent.relative_to(root)) for b in builds) if builds else "no builds"))
    print(f"is_available(): {cuda.is_available()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
