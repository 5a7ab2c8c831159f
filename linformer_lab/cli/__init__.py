"""The command line: ``python cli.py SUBCOMMAND --config NAME.yaml [--key value ...]`` (docs/cli.md).

Its modules import bottom to top (``tests/cli/test_cli_imports.py``), so that ``--help`` and
``plugins`` load neither torch nor Lightning: args < config_help < checks < callbacks <
checkpoints < export < lightning_cli (the first import of Lightning) < entry (:func:`main`).
"""
