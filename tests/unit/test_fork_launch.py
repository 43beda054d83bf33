"""The fork launcher's wait for its ranks (lightning_5d/fork_launch.py), on stand-in processes."""

import os
import time

import pytest

from lightning_5d.fork_launch import _wait_for_ranks


class StandIn:
    """A rank as the wait sees it: an exit code read by polling, a sentinel readable once it ended.

    ``running_reads``: how many reads of ``exitcode`` answer None before it answers ``code``.
    """

    def __init__(self, running_reads: int, code: int = 0):
        self.reads, self.running_reads, self.code = 0, running_reads, code
        self.sentinel, self._w = os.pipe()

    @property
    def exitcode(self):
        self.reads += 1
        if self.reads <= self.running_reads:
            return None
        os.write(self._w, b".")  # ended: the sentinel becomes readable, as the fork server's is
        return self.code

    def close(self):
        os.close(self.sentinel)
        os.close(self._w)


@pytest.fixture
def stand_ins():
    made = []

    def make(*args, **kwargs):
        made.append(StandIn(*args, **kwargs))
        return made[-1]

    yield make
    for proc in made:
        proc.close()


@pytest.mark.timeout(30)
def test_a_rank_that_ends_between_two_reads_of_its_exit_code_ends_the_wait(stand_ins):
    # CI hung here once: the loop read "running" to decide to wait and "ended" to list whom to
    # wait on, and a wait on no process with no deadline never returns.
    procs = [stand_ins(running_reads=0), stand_ins(running_reads=1)]
    assert _wait_for_ranks(procs, deadline=None, failure_grace_s=5.0) is False


@pytest.mark.timeout(30)
def test_a_deadline_that_passed_is_reported():
    procs = [StandIn(running_reads=10**9)]
    try:
        assert _wait_for_ranks(procs, deadline=time.monotonic() - 1.0, failure_grace_s=5.0) is True
    finally:
        procs[0].close()


@pytest.mark.timeout(30)
def test_a_failed_rank_ends_the_wait_after_its_grace(stand_ins):
    # The peer never ends; the failed rank's grace (0 s here) ends the wait, not a deadline.
    procs = [stand_ins(running_reads=0, code=1), stand_ins(running_reads=10**9)]
    assert _wait_for_ranks(procs, deadline=None, failure_grace_s=0.0) is False
