"""Command line: ``python cli.py {fit,validate,test,predict,plugins} --config NAME.yaml``. See docs/cli.md."""

from linformer_lab.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
