"""`snakemake` for tests/test_slurm.py: the real CLI and Slurm executor plugin, with the plugin's
wait between two job-status checks capped at POLL_S seconds.

The plugin (2.8) lengthens that wait by 10 s after every check in which no job finished (1 s,
11 s, 21 s, ... up to 180 s) and goes back to slurm-init-seconds-before-status-checks when one
does. That suits a busy cluster; on the test's one-node cluster every rule is one job of 9-20 s,
so the next step started up to 21 s after a job had ended (~55 of the run's 165 s were such
waits). Only the wait is changed: what the checks ask (squeue), how their answers are read,
failures and retries are the plugin's own. 0.5 s, not 2: each of the run's ~8 steps waited on
average half the cap for its job's end to be seen (the run took 65 s at 2 s, 58 s at 0.5 s);
a check is one squeue call on a one-node cluster.

    python tests/cluster/snakemake_polling.py <snakemake arguments>
"""
from __future__ import annotations

import asyncio
import sys

from snakemake_executor_plugin_slurm import Executor

POLL_S = 0.5


async def _capped_sleep(self) -> None:
    await asyncio.sleep(min(self.next_seconds_between_status_checks, POLL_S))


Executor.sleep = _capped_sleep

if __name__ == "__main__":
    from snakemake.cli import main

    sys.exit(main())
