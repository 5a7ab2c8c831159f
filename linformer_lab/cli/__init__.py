"""The command line: ``python cli.py SUBCOMMAND --config NAME.yaml [--key value ...]`` (docs/cli.md).

Its modules import one way, bottom to top (``tests/cli/test_cli_imports.py`` keeps it so)::

    compat  <  args  <  checks, config_help  <  callbacks  <  checkpoints  <  export
            <  kernel_check  <  lightning_cli  <  plot  <  entry

* :mod:`~linformer_lab.cli.compat`: every private member of Lightning and jsonargparse the CLI
  reads, and the forms of jsonargparse's error messages it reads, checked before any work;
* :mod:`~linformer_lab.cli.args`: argv and ``--config`` look-up, did-you-mean, one-line errors;
* :mod:`~linformer_lab.cli.checks`: a command's checks before it runs, the precision fallback;
* :mod:`~linformer_lab.cli.config_help`: ``SUBCOMMAND --config X --help`` read from sources;
* :mod:`~linformer_lab.cli.callbacks`: the checkpoint callbacks every fit gets;
* :mod:`~linformer_lab.cli.checkpoints`: run directories, ``--ckpt_path``, the checkpoint check;
* :mod:`~linformer_lab.cli.export`: ``cli.py export``, and an exported folder as ``--ckpt_path``;
* :mod:`~linformer_lab.cli.kernel_check`: what ``cli.py plugins --check`` runs on the kernels;
* :mod:`~linformer_lab.cli.lightning_cli`: :class:`LinformerCLI`, the first import of Lightning;
* :mod:`~linformer_lab.cli.plot`: ``cli.py plot``, runs' curves from their ``metrics.csv`` into a PNG;
* :mod:`~linformer_lab.cli.entry`: :func:`main`, which answers ``--help`` and ``plugins``
  without importing Lightning and hands the rest to :mod:`~linformer_lab.cli.lightning_cli`.

This file imports nothing, so that importing any of the modules above loads only those below it:
``from linformer_lab.cli.entry import main``.
"""
