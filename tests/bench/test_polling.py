"""The shared wait loop: a deadline that a frozen machine does not use up, a last read after it."""

from __future__ import annotations

import pytest

from bench.loadgen import polling


class FakeClock:
    """time.monotonic and time.sleep for the polling module. A sleep advances the clock by its
    length, plus the length of a freeze set to fall inside it."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.freeze_in_next_sleep = 0.0

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds + self.freeze_in_next_sleep
        self.freeze_in_next_sleep = 0.0


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    fake = FakeClock()
    monkeypatch.setattr(polling.time, "monotonic", fake.monotonic)
    monkeypatch.setattr(polling.time, "sleep", fake.sleep)
    return fake


def test_a_deadline_expires_after_its_timeout(clock: FakeClock) -> None:
    deadline = polling.Deadline(10.0)
    deadline.sleep(9.9)
    assert not deadline.expired()
    deadline.sleep(0.2)
    assert deadline.expired()


def test_a_freeze_inside_a_sleep_does_not_use_up_the_deadline(clock: FakeClock) -> None:
    deadline = polling.Deadline(300.0)
    deadline.sleep(20.0)
    clock.freeze_in_next_sleep = 330.0  # the machine stopped for 5.5 minutes
    deadline.sleep(0.5)
    deadline.sleep(279.0)  # 299.5 s of running time in all
    assert not deadline.expired()
    deadline.sleep(1.0)
    assert deadline.expired()


def test_an_overrun_up_to_the_freeze_bound_counts_as_waiting(clock: FakeClock) -> None:
    deadline = polling.Deadline(10.0)
    clock.freeze_in_next_sleep = polling.FREEZE_GAP_S
    deadline.sleep(5.5)
    assert deadline.expired()


def test_a_slow_read_counts_as_waiting(clock: FakeClock) -> None:
    def slow_read() -> None:
        clock.now += 60.0  # the waited-on process answering slowly, not a freeze

    assert polling.poll(slow_read, timeout=100.0, interval=1.0) is None
    assert clock.now == 1000.0 + 3 * 60.0 + 2 * 1.0


def test_poll_reads_once_more_after_the_deadline(clock: FakeClock) -> None:
    reads: list[float] = []

    def read() -> str | None:
        reads.append(clock.now)
        return "up" if clock.now > 1005.0 else None

    assert polling.poll(read, timeout=5.0, interval=1.0) == "up"
    assert reads[-1] == 1006.0  # the clock said expired before this read; its answer still counts


def test_poll_gives_up_with_none_when_nothing_answers(clock: FakeClock) -> None:
    assert polling.poll(lambda: None, timeout=5.0, interval=1.0) is None
    assert clock.now == 1006.0


def test_wait_until_says_whether_the_check_came_true(clock: FakeClock) -> None:
    assert polling.wait_until(lambda: clock.now >= 1002.0, timeout=5.0, interval=1.0)
    assert not polling.wait_until(lambda: False, timeout=5.0, interval=1.0)
