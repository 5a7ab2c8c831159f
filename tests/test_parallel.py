"""The README's `uv run pytest -n 2`: the tests of a module that share a fixture of its own run on
one xdist worker (conftest.py's grouping, `--dist loadgroup`), so the fixture is made once."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
from conftest import REPO

#: A cheap module whose tests share a module-scoped fixture of its own (the parsed uv.lock).
GROUPED = "tests/benchmarks/test_offline_wheels.py"


@pytest.mark.slow
def test_a_modules_tests_sharing_its_fixture_run_on_one_worker():
    done = subprocess.run([sys.executable, "-m", "pytest", "-n", "2", "-v", "-p", "no:cacheprovider", GROUPED],
                          cwd=REPO, capture_output=True, text=True, timeout=300, env={**os.environ, "COLUMNS": "400"})
    assert done.returncode == 0, done.stdout[-3000:]
    ran = re.findall(r"^\[(gw\d)\] .*PASSED (\S+)", done.stdout, flags=re.M)
    # pytest 9.2 with pytest-xdist 3.8 drops the group suffix: the tests spread over both workers
    grouped = [(worker, nodeid) for worker, nodeid in ran if nodeid.endswith(f"@{GROUPED}")]
    assert len(grouped) >= 3, done.stdout[-3000:]
    assert {worker for worker, _ in grouped} == {grouped[0][0]}, grouped
