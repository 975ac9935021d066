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


def import_graph():
    sys.path.insert(0, str(REPO / "tools"))
    try:
        import import_graph
    finally:
        sys.path.pop(0)
    return import_graph


def test_the_wings_meet_only_through_the_contract():
    """agents, rollout, trainer and algo import none of each other (but the reviewed KNOWN_CROSSINGS) and
    nothing below the driver imports it; the SFT loop does not borrow from the RL loop."""
    graph = import_graph()
    edges = graph.graph()
    crossings = graph.wing_crossings(edges)
    assert sorted(set(crossings) - set(graph.KNOWN_CROSSINGS)) == []
    assert sorted(set(graph.KNOWN_CROSSINGS) - set(crossings)) == [], "no longer crossing: drop the entry"
    assert graph.into_orchestration(edges) == []
    assert "molt.driver.loop" not in edges["molt.driver.sft_loop"]


def test_no_two_folders_import_each_other():
    """Imports point down the layers: the spec imports no wing, nor plan/ nor inputs/ (they read it), and
    inputs/ sits below agents/."""
    graph = import_graph()
    edges = graph.graph()
    assert graph.circles(edges) == []
    spec_reads = {graph.folder(dst) for src, dsts in edges.items() if graph.folder(src) == "spec"
                  for dst in dsts}
    assert spec_reads <= {"spec", "contract"}, spec_reads
    assert "molt.agents.chat" in edges["molt.agents"]   # a lazy import in __getattr__ counts


def test_the_import_graph_sees_an_import_inside_a_function(tmp_path):
    graph = import_graph()
    path = tmp_path / "m.py"
    path.write_text("def f():\n    from molt.rollout.dispatch import Dispatcher\n")
    assert graph.imports(path, {"molt.rollout.dispatch", "molt.rollout"}) == {"molt.rollout.dispatch"}


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
