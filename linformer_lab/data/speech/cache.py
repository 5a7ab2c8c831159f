"""Atomic cache directories: a corpus or a feature cache is written under a temporary name and
renamed into place, so an interrupted run never leaves a half-written cache that looks complete."""

from __future__ import annotations

import os
import shutil
import socket
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch


def temporary_name(name: str) -> str:
    # Host and pid in the name let a later run tell a dead writer's leftovers from a live one.
    return f".{name}.tmp-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def remove_stale_temporaries(parent: Path, name: str) -> list[Path]:
    """Delete temp dirs of ``name`` left by dead processes on this host; returns what was removed."""
    removed = []
    host = socket.gethostname()
    if not parent.is_dir():
        return removed
    for p in parent.glob(f".{name}.tmp-*"):
        rest = p.name[len(f".{name}.tmp-") :]
        try:
            p_host, p_pid, _ = rest.rsplit("-", 2)
            pid = int(p_pid)
        except ValueError:
            continue
        if p_host != host:
            continue  # another machine sharing the directory: cannot check, leave it
        try:
            os.kill(pid, 0)
            alive = True
        except ProcessLookupError:
            alive = False
        except PermissionError:
            alive = True  # exists, owned by someone else
        if not alive:
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p)
    return removed


@contextmanager
def atomic_directory(final: Path) -> Iterator[Path]:
    """Build the directory ``final`` atomically: yields an empty temporary directory beside it
    (after removing the ones dead writers left) for the block to fill, publishes it as ``final``
    when the block ends (if another process won the race, keeps theirs) and deletes it if the
    block raises. The block runs with one intra-op torch thread: its parallelism, if any, comes
    from worker threads, and utterance-sized STFTs gain nothing from more (on a loaded machine
    two OpenMP threads spin-wait on each other)."""
    remove_stale_temporaries(final.parent, final.name)
    tmp = final.parent / temporary_name(final.name)
    tmp.mkdir()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield tmp
        try:
            os.rename(tmp, final)
        except OSError:
            if not final.exists():
                raise
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        torch.set_num_threads(threads)
