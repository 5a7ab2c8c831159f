"""Command line: ``python cli.py {fit,validate,test,predict,plugins} --config NAME.yaml``. See docs/cli.md.

``linformer_lab.cli_args`` answers ``--help`` and ``plugins`` without importing Lightning; the
four Lightning subcommands import it there, on demand.
"""

from linformer_lab.cli_args import main

if __name__ == "__main__":
    raise SystemExit(main())
