"""Codebase rules a reviewer would otherwise count by hand (tools/check_size.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CHECK = [sys.executable, str(REPO / "tools" / "check_size.py")]


def test_every_file_and_function_over_the_size_limits_is_reviewed():
    proc = subprocess.run(CHECK, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_the_size_check_reports_what_nobody_reviewed(tmp_path):
    long_function = "def f():\n" + "    x = 1\n" * 60
    (tmp_path / "big.py").write_text(long_function + "\n" * 400)
    proc = subprocess.run([*CHECK, str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    assert "big.py:1: 461 lines (over 400)" in proc.stdout
    assert "big.py:1: f has 61 lines (over 60)" in proc.stdout
    (tmp_path / "big.py").write_text("def f():\n    pass\n")
    assert subprocess.run([*CHECK, str(tmp_path)], capture_output=True, timeout=60).returncode == 0


def test_a_reviewed_entry_that_is_no_longer_oversized_is_reported():
    sys.path.insert(0, str(REPO / "tools"))
    try:
        import check_size
    finally:
        sys.path.pop(0)
    check_size.REVIEWED["molt/quiet.py"] = "a test entry"
    new, stale = check_size.unreviewed([REPO / "molt"])
    assert stale == ["molt/quiet.py"] and new == []
