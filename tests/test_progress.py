"""draftsmith.core.progress: plain lines (logging, INFO) when stderr is not a terminal."""

import logging

import pytest

from draftsmith.core.progress import PlainProgress, progress


@pytest.fixture
def lines(caplog):
    """lines() -> the progress lines logged so far."""
    caplog.set_level(logging.INFO, logger="draftsmith.core.progress")
    return lambda: [r.getMessage() for r in caplog.records if r.name == "draftsmith.core.progress"]


def test_plain_lines_name_done_total_rate_and_eta(lines):
    bar = PlainProgress(total=4, desc="regenerate", unit="prompt", interval=0)
    bar.update(1)
    bar.update(3)
    bar.close()
    lines = lines()
    assert lines[0].startswith("regenerate: 1/4 (25%), ") and "prompt/s" in lines[0] and "ETA" in lines[0]
    assert lines[-1].startswith("regenerate: 4/4 (100%), ") and "ETA" not in lines[-1]


def test_interval_limits_lines_and_close_always_prints(lines):
    bar = PlainProgress(total=1000, desc="train", unit="step", interval=3600)
    for _ in range(1000):
        bar.update(1)
    assert lines() == []  # nothing before the interval has passed
    bar.close()
    bar.close()  # once only
    assert len(lines()) == 1
    assert lines()[0].startswith("train: 1000/1000 (100%)")


def test_iterates_and_disabled_prints_nothing(lines, capsys, monkeypatch):
    monkeypatch.setenv("DRAFTSMITH_PROGRESS_INTERVAL", "0")
    assert list(progress(range(3), desc="eval", unit="prompt")) == [0, 1, 2]  # stderr is captured: not a tty
    assert any("eval: 3/3 (100%)" in line for line in lines())
    before = len(lines())
    assert list(progress(range(3), desc="eval", enabled=False)) == [0, 1, 2]
    assert len(lines()) == before and capsys.readouterr().err == ""


def test_close_does_not_repeat_the_last_line(lines):
    bar = PlainProgress(total=2, desc="capture", interval=0)
    bar.update(2)
    bar.close()
    assert len(lines()) == 1


def test_timer_prints_while_no_update_comes(lines):
    import time

    bar = PlainProgress(total=3, desc="regenerate", unit="prompt", interval=0.1)
    time.sleep(0.45)  # one long item: no update at all
    bar.close()
    lines = lines()
    assert len(lines) >= 2 and all(ln.startswith("regenerate: 0/3 (0%)") for ln in lines)
