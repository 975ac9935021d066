"""Codebase rules a reviewer would otherwise count by hand (tools/check_size.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_no_molt_file_over_400_lines_and_no_function_over_60():
    proc = subprocess.run([sys.executable, str(REPO / "tools" / "check_size.py"), str(REPO / "molt")],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_the_size_check_reports_what_breaks_the_rules(tmp_path):
    long_function = "def f():\n" + "    x = 1\n" * 60
    (tmp_path / "big.py").write_text(long_function + "\n" * 400)
    proc = subprocess.run([sys.executable, str(REPO / "tools" / "check_size.py"), str(tmp_path)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    assert "big.py:1: 461 lines (at most 400)" in proc.stdout
    assert "big.py:1: f has 61 lines (at most 60)" in proc.stdout
