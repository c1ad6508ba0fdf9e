"""What importing printpress does to the process."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

SHOW = "import printpress, os; print(os.environ['OMP_WAIT_POLICY'])"


@pytest.mark.parametrize("given,expected", [(None, "PASSIVE"), ("ACTIVE", "ACTIVE")])
def test_openmp_threads_wait_passively_unless_the_user_chose(given, expected):
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if given is not None:
        env["OMP_WAIT_POLICY"] = given
    out = subprocess.run([sys.executable, "-c", SHOW], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == expected
