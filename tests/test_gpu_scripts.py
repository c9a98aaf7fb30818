"""The GPU session's scripts name tests that exist: ``scripts/gpu_tests_first.sh`` lists the test files
and pytest node ids ``gpu_check.sh`` runs first on the device, where a misspelt one would cost device
minutes to find out."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_test_run_first_on_the_gpu_exists():
    listed = subprocess.run(
        ["bash", "-c", 'source scripts/gpu_tests_first.sh && printf "%s\\n" "${gpu_first[@]}"'],
        cwd=ROOT, capture_output=True, text=True, check=True,
    ).stdout.split()  # fmt: skip
    assert listed
    for entry in listed:
        path, _, name = entry.partition("::")
        source = (ROOT / path).read_text()
        assert not name or re.search(rf"^def {re.escape(name)}\(", source, re.MULTILINE), entry
