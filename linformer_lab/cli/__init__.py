"""The command line: ``python cli.py SUBCOMMAND --config NAME.yaml [--key value ...]`` (docs/cli.md).

Its modules import one way, bottom to top (``tests/cli/test_cli_imports.py`` keeps it so), so that
``--help`` and ``plugins`` load neither torch nor Lightning::

    compat  <  args  <  config_help  <  checks  <  callbacks  <  checkpoints  <  export
            <  kernel_check  <  lightning_cli  <  plot  <  entry

compat: the private Lightning and jsonargparse members read; args: argv and ``--config`` look-up;
config_help: ``--help`` read from the sources; checks: one-line errors before any work; callbacks,
checkpoints: the last/best checkpoints, run folders, ``--ckpt_path``; export, plot: ``cli.py export``
and ``cli.py plot``; kernel_check: ``plugins --check``; lightning_cli: :class:`LinformerCLI`, the first
import of Lightning; entry: :func:`main`. This file imports nothing: ``from linformer_lab.cli.entry import main``.
"""
