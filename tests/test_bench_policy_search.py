"""bench/policy_search.py runs its searches in another tree's process and compares what they
choose: a change to the search's API or to PolicyResult.to_json breaks it here, not in the next
session that needs the measurement. A few searches, this tree against itself."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_policy_search_bench_compares_a_tree_with_itself():
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "policy_search.py"), "--limit", "4",
                           "--rounds", "1", "--against", str(REPO)],
                          capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert lines[0].startswith("# ") and "torch" in lines[0]  # the machine header
    assert "0 of 4 searches chose differently" in proc.stdout
    result = dict(kv.split("=") for kv in lines[-1].removeprefix("RESULT ").split())
    assert result["same"] == "1" and int(result["candidates"]) > 0 and float(result["cpu_s"]) > 0
