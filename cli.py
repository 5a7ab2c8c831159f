"""Command line: ``python cli.py {fit,validate,test,predict,plugins} --config NAME.yaml``. See docs/cli.md.

``linformer_lab.cli.entry`` answers ``--help`` and ``plugins`` without importing Lightning; the
four Lightning subcommands import it there, on demand.
"""

import os
import sys

from linformer_lab.cli.entry import close_process_group, main

if __name__ == "__main__":
    try:
        code = main()
        close_process_group()
        sys.stdout.flush()  # here, not at exit: a closed pipe is then caught below
    except BrokenPipeError:
        # the reader stopped early (cli.py plugins --json | head): as for any Unix filter, no
        # traceback; the output still buffered goes nowhere instead of failing again at exit
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        code = 1
    raise SystemExit(code)
