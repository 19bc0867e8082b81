"""NIXL's progress thread, paced by the connector, sleeps when there is nothing to do.

Each case makes a real NIXL agent (UCX on host memory) in a process of its
own and reads, from /proc, how much CPU that process's busiest thread took
over the next second: unpaced (nixl's own delay of 0), its progress thread
spins a whole core; paced, it stays near nothing.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from handoff_vllm.settings import SettingsError, parse

PROBE = """
import os, sys, time, uuid
from handoff_vllm.pacing import pace_progress_thread
delay = int(sys.argv[1])
if delay:
    assert pace_progress_thread(delay)
from nixl._api import nixl_agent
agent = nixl_agent(str(uuid.uuid4()))

def ticks():
    found = {}
    for tid in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{tid}/stat") as stat:
            text = stat.read()
        fields = text[text.rindex(")") + 2 :].split()
        found[tid] = int(fields[11]) + int(fields[12])
    return found

before = ticks()
time.sleep(1.0)
after = ticks()
print(max(after[t] - before.get(t, 0) for t in after) / os.sysconf("SC_CLK_TCK"))
"""


def busiest_thread_cpu_s(delay_us: int) -> float:
    """CPU seconds of the busiest thread of a process with one NIXL agent, over 1 s."""
    done = subprocess.run(
        [sys.executable, "-c", PROBE, str(delay_us)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return float(done.stdout.split()[-1])


def test_the_paced_progress_thread_sleeps_where_nixl_s_own_spins() -> None:
    assert busiest_thread_cpu_s(0) > 0.5  # nixl's own: a core, the whole second
    assert busiest_thread_cpu_s(1000) < 0.1


@pytest.mark.parametrize("delay", [-1, 1.5, True, 2_000_000, "1000"])
def test_a_bad_progress_delay_is_refused_naming_its_key(delay: object) -> None:
    extra = {"handoff": {"coordinator": "h:1", "engine_id": "e", "nixl_progress_delay_us": delay}}
    with pytest.raises(SettingsError, match="nixl_progress_delay_us"):
        parse(extra, None)
