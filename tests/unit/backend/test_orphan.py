"""A process whose parent dies saves what it can and ends (as an orphaned backend stub must)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

# The middle process starts the watched child, waits until it watches, then exits: the child is
# orphaned.
MIDDLE = """
import subprocess, sys, time
from pathlib import Path
child = subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2]], stdout=subprocess.DEVNULL)
watching = Path(sys.argv[2]).parent / "watching"
while not watching.exists():
    time.sleep(0.05)
print(child.pid, flush=True)
"""
CHILD = """
import sys, time
from pathlib import Path
from backend.orphan import exit_when_orphaned
marker = Path(sys.argv[1])
exit_when_orphaned(lambda: marker.write_text("saved"), poll_s=0.05)
(marker.parent / "watching").write_text("")
time.sleep(600)
"""


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_an_orphaned_process_runs_its_last_work_and_exits(tmp_path):
    marker = tmp_path / "marker"
    middle = subprocess.run(
        [sys.executable, "-c", MIDDLE, CHILD, str(marker)],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
        cwd=Path(__file__).resolve().parents[3],
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[3])},
    )
    child = int(middle.stdout.split()[0])
    deadline = time.monotonic() + 60
    while alive(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(child), "the orphaned process is still running"
    assert marker.read_text() == "saved"


# An orphan whose last work never ends (a response send waiting for the dead server does not).
STUCK_CHILD = """
import sys, time
from pathlib import Path
from backend.orphan import exit_when_orphaned
marker = Path(sys.argv[1])
exit_when_orphaned(lambda: (marker.write_text("saving"), time.sleep(600)), poll_s=0.05, deadline_s=1.0)
(marker.parent / "watching").write_text("")
time.sleep(600)
"""


def test_an_orphan_whose_last_work_hangs_still_ends_at_its_deadline(tmp_path):
    marker = tmp_path / "marker"
    middle = subprocess.run(
        [sys.executable, "-c", MIDDLE, STUCK_CHILD, str(marker)],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
        cwd=Path(__file__).resolve().parents[3],
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[3])},
    )
    orphaned = time.monotonic()
    child = int(middle.stdout.split()[0])
    while alive(child) and time.monotonic() < orphaned + 30:
        time.sleep(0.05)
    assert not alive(child), "the orphaned process is still running"
    assert marker.read_text() == "saving"
    assert time.monotonic() - orphaned < 5
