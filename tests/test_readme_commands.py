"""The README's commands work as written: every `snakemake` / `make run` line in its bash blocks
composes a valid config and plans a workflow (a Snakemake dry run), so an example with a stale
key, a missing file or broken quoting fails here instead of in a user's shell.

Lines that cannot run in the test are skipped by rule, not by hand: `make test` (this suite),
pip installs, and the Slurm profiles and cluster script (they need a running Slurm:
tests/test_slurm.py runs them). Checkpoint paths
under /models or /shared are replaced by the tiny test checkpoint."""
from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SNAKEMAKE = str(Path(sys.executable).parent / "snakemake")
SKIP = ("make test", "pip install", "profiles/slurm", "slurm_up.sh", "tests/cluster/profile")
PLACEHOLDER_MODEL = re.compile(r"model\.path=\S*?(?=[\s\"']|$)")


def readme_commands() -> list[str]:
    """Shell commands from the README's ```bash blocks, continuation lines joined."""
    text = (REPO / "README.md").read_text()
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.strip()
            if line and not line.startswith("#"):
                commands.append(line)
    return commands


def snakemake_args(command: str) -> list[str]:
    """The arguments `command` passes to snakemake (`make run` runs snakemake --cores all
    $(SNAKEMAKE_ARGS), see the Makefile)."""
    words = shlex.split(command)
    if words[:2] == ["make", "run"]:
        args = ["--cores", "all"]
        for word in words[2:]:
            if word.startswith("SNAKEMAKE_ARGS="):
                args += shlex.split(word.split("=", 1)[1])
        return args
    assert words[0].endswith("snakemake"), f"README command not covered by this test: {command}"
    return words[1:]


def test_readme_has_the_quick_start_and_examples():
    commands = readme_commands()
    assert commands[:2] == ["make run", "make test"], "Quick start must be exactly two commands"
    assert sum("overrides=" in c for c in commands) >= 4


@pytest.mark.parametrize("command", [c for c in readme_commands() if not any(s in c for s in SKIP)])
def test_readme_command_dry_runs(command, tmp_path, tiny_mixtral_dir):
    # Relative paths in the examples (data/, workflow/profiles/) resolve from the repository root.
    for name in ("data", "workflow", "config"):
        (tmp_path / name).symlink_to(REPO / name)
    command = PLACEHOLDER_MODEL.sub(f"model.path={tiny_mixtral_dir}", command)
    args = snakemake_args(command)
    proc = subprocess.run([SNAKEMAKE, "-s", str(REPO / "Snakefile"), "--directory", str(tmp_path), *args, "-n"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{command}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    assert "rule generate" in proc.stdout or "generate" in proc.stdout, proc.stdout[-2000:]
