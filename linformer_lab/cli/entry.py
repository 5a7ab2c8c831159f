"""The entry of ``cli.py``: :func:`main` answers ``--help``, ``plugins``, ``export``, ``plot`` and
``SUBCOMMAND --config X --help`` without importing Lightning (most of a command's start-up), and
hands the Lightning subcommands to :mod:`~linformer_lab.cli.lightning_cli`."""

from __future__ import annotations

import argparse
import json
import sys
import textwrap
from dataclasses import asdict

from linformer_lab.cli.args import HELP_NAMES, SUBCOMMANDS, UsageError, config_values, help_requested, known_configs, prepare_argv
from linformer_lab.cli.checks import kernel_switch_error
from linformer_lab.cli.config_help import attention_by_name, config_help, subcommand_help


def top_level_help() -> str:
    """``cli.py --help``: the subcommands, where their options are listed, and the configs."""
    rows = [*SUBCOMMANDS.items(), ("export", "write a trained model as model.safetensors + config.json"),
            ("plot", "draw runs' training and validation curves into a PNG"),
            ("plugins", "list the attention backends and feature maps (--check, --json)")]
    return "\n".join([
        "usage: cli.py {fit,validate,test,predict} --config NAME.yaml [--group.option VALUE ...]",
        "       cli.py export RUN_FOLDER|CHECKPOINT [--ckpt_path best|last] [--output DIR]",
        "       cli.py plot RUN [RUN ...] [--output FILE.png]",
        "       cli.py plugins [--check] [--json]",
        "",
        "subcommands:",
        *(f"  {name:<10} {text}" for name, text in rows),
        "",
        "options of a subcommand:          cli.py fit --help",
        "and of a config's model and data: cli.py fit --config copy_linear.yaml --help",
        "a task's or data module's:        cli.py fit --model.help copy   (tasks: " + ", ".join(HELP_NAMES["model"])
        + "; data: " + ", ".join(HELP_NAMES["data"]) + ")",
        "",
        "configs (--config NAME looks in ./configs, then in this checkout's configs/):",
        textwrap.fill(", ".join(known_configs()) or "(none)", width=96, initial_indent="  ", subsequent_indent="  "),
        "docs/cli.md has the rest.",
    ]) + "\n"


def plugins_command(argv: list[str]) -> int:
    """``python cli.py plugins [--check] [--json]``: every registered backend and feature map with the
    distribution(s) that register it; ``--check`` also imports each and checks every kernel that runs
    here against its reference (a failing one: an error line, exit code 1)."""
    from linformer_lab.registry import ATTENTION, FEATURE_MAPS, PluginError

    parser = argparse.ArgumentParser(prog="cli.py plugins", description=plugins_command.__doc__)
    parser.add_argument("--check", action="store_true",
                        help="import every plugin and check every kernel against its reference; report failures")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args(argv)

    report, failed = {}, False
    for title, registry in (("attention", ATTENTION), ("feature_maps", FEATURE_MAPS)):
        entries = []
        for name, dists in registry.distributions().items():
            entry = {"name": name, "distributions": dists, "status": "conflict" if len(dists) > 1 else "ok"}
            if args.check and len(dists) == 1:
                try:
                    plugin = registry.get(name)
                except PluginError as err:
                    entry["status"], failed = f"broken: {err}", True
                else:  # a plugin may say it cannot run on this machine (linear_cuda without a GPU)
                    reason = getattr(plugin, "unavailable_reason", lambda **_: None)(**registry.arguments(name))
                    if reason:
                        entry["status"] = f"unavailable here: {reason}"
            failed |= len(dists) > 1
            entries.append(entry)
        report[title] = {"group": registry.group, "plugins": entries}
    kernel_lines, checked = [], []
    if args.check:
        from linformer_lab.models.generation import dynamic_step
        from linformer_lab.ops import kernel_check

        kernel_lines, checked = kernel_check.describe(), kernel_check.check_kernels(steps=dynamic_step.fused_steps)
        failed |= any(result.failed for result in checked)

    if args.json:
        print(json.dumps({**report, "kernels": kernel_lines, "kernel_check": [asdict(r) for r in checked]}
                         if args.check else report, indent=2))
    else:
        for title, section in report.items():
            print(f"{title} (entry-point group {section['group']!r}):")
            for e in section["plugins"]:
                status = "" if e["status"] == "ok" else f"  [{e['status']}]"
                print(f"  {e['name']:<16} {', '.join(e['distributions'])}{status}")
        if kernel_lines:
            print("kernels (ops/kernels.py):\n" + "\n".join(f"  {line}" for line in kernel_lines))
            print("kernel check (forward and backward against the float64 reference, small shapes):")
            print("\n".join(f"  {line}" for line in kernel_check.report(checked)))
    for result in checked:
        if result.failed:
            sys.stderr.write(kernel_check.error_line(result) + "\n")
    return 1 if failed else 0


def plot_command(argv: list[str]) -> int:
    """``cli.py plot RUN [RUN ...] [--output FILE.png] [--title TEXT]``: runs' curves in one PNG
    (:mod:`linformer_lab.tasks.curves`); returns the exit code."""
    from linformer_lab.tasks import curves  # matplotlib, neither torch nor Lightning

    parser = argparse.ArgumentParser(prog="cli.py plot", description=curves.__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", metavar="RUN", help="a run root (logs/NAME) or one of its version_N folders")
    parser.add_argument("--output", "-o", default="curves.png", help="the PNG to write (default: curves.png)")
    parser.add_argument("--title", default=None, help="a line above the panels")
    args = parser.parse_args(argv)
    if not args.output.lower().endswith(".png"):
        sys.stderr.write(f"error: --output {args.output}: the picture is a PNG; name a file ending in .png\n")
        return 2
    try:
        metrics, names = curves.plot_runs(args.runs, args.output, args.title)
    except curves.PlotError as err:
        sys.stderr.write(f"error: {err}\n")
        return 2
    print(f"wrote {args.output}: {', '.join(metrics)} of {len(names)} run{'s' * (len(names) != 1)} ({', '.join(names)})")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``cli.py``; returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    switch_error = kernel_switch_error(argv)
    if switch_error:
        sys.stderr.write(f"error: {switch_error}\n")
        return 2
    if argv[:1] == ["plugins"]:
        return plugins_command(argv[1:])
    if argv[:1] == ["export"]:  # reads a checkpoint, builds no Trainer
        from linformer_lab.cli.export import export_command

        return export_command(argv[1:])
    if argv[:1] == ["plot"]:  # reads metrics.csv files: neither torch nor Lightning
        return plot_command(argv[1:])
    if argv[:1] in (["-h"], ["--help"]):
        sys.stdout.write(top_level_help())
        return 0
    try:
        if not argv:
            raise UsageError("error: name a subcommand, e.g. cli.py fit --config copy_linear.yaml (cli.py --help lists them)")
        argv = attention_by_name(prepare_argv(argv))
    except UsageError as err:
        sys.stderr.write(f"{err}\n")
        return 2
    configs = config_values(argv)
    class_help = any(arg.split("=")[0] in ("--model.help", "--data.help") for arg in argv)  # LightningCLI's
    if help_requested(argv) and (configs or not class_help):  # from the sources: no Lightning
        sys.stdout.write(config_help(argv[0], configs) if configs else subcommand_help(argv[0]))
        return 0
    from linformer_lab.cli.lightning_cli import run_lightning_cli  # the first import of Lightning

    return run_lightning_cli(argv)


def close_process_group() -> None:
    """Destroy the process group a DDP run leaves (Lightning keeps it for a next Trainer): at shutdown
    gloo's threads could otherwise abort a process whose run succeeded."""
    distributed = sys.modules.get("torch.distributed")  # never imported by --help or plugins: nothing to close
    if distributed is not None and distributed.is_available() and distributed.is_initialized():
        distributed.destroy_process_group()
