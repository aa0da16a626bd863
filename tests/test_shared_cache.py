"""helpers.py's cache of the test run's engine data, heads and built-in readings (`made_once`): whichever
pytest-xdist worker asks first makes it, the others wait and read it, and a make that failed is made again."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from helpers import made_once

TESTS = Path(__file__).parent

RACER = """
import os, sys, time
from pathlib import Path
sys.path.insert(0, {tests!r})
from helpers import made_once

def make(path):
    with open({log!r}, "a") as f:
        f.write(f"{{os.getpid()}}\\n")
    time.sleep(2.0)  # long enough that the other process asks while this one is making it
    path.mkdir()
    (path / "out.txt").write_text("made")

print((made_once(Path({path!r}), make) / "out.txt").read_text())
"""


def test_two_processes_asking_at_once_make_it_once(tmp_path):
    log, path = tmp_path / "makers.log", tmp_path / "cache" / "thing"
    code = RACER.format(tests=str(TESTS), log=str(log), path=str(path))
    racers = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [r.communicate(timeout=120)[0] for r in racers]
    assert [r.returncode for r in racers] == [0, 0]
    assert [o.strip() for o in outs] == ["made", "made"]
    assert len(log.read_text().splitlines()) == 1  # one maker; the other waited and read


def test_a_failed_make_is_made_again_from_nothing(tmp_path):
    path = tmp_path / "thing"

    def fails(p: Path) -> None:
        p.mkdir()
        (p / "half.txt").write_text("half")
        raise RuntimeError("killed half-way")

    with pytest.raises(RuntimeError, match="half-way"):
        made_once(path, fails)
    made = []

    def works(p: Path) -> None:
        made.append(p)
        p.mkdir()
        (p / "out.txt").write_text("made")

    assert made_once(path, works) == path and made == [path]
    assert sorted(x.name for x in path.iterdir()) == ["out.txt"]  # the failed make's half is gone
    assert made_once(path, works) == path and made == [path]  # made: read, not made again
