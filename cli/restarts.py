"""When a supervised child of the stack (cli/stack.py) that exited is started again: a
doubling backoff, given up after too many restarts in a window. Pure: the caller passes the
clock's time in."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True)
class RestartPolicy:
    """When a supervised child that exited is started again."""

    initial_backoff_s: float = 0.5
    max_backoff_s: float = 10.0  # the wait doubles after each exit, up to this
    reset_after_s: float = 30.0  # a child up this long starts over from initial_backoff_s
    max_restarts: int = 5  # this many restarts within window_s and one more exit: give up
    window_s: float = 60.0


class Backoff:
    """One child's restart state. Pure: the caller passes the clock's time in."""

    def __init__(self, policy: RestartPolicy) -> None:
        self.policy = policy
        self.started_at: float | None = None
        self.next_delay_s = policy.initial_backoff_s
        self.restart_times: deque[float] = deque()  # exits that got a restart, within window_s

    def started(self, now: float) -> None:
        self.started_at = now

    def exited(self, now: float) -> float | None:
        """Seconds to wait before starting the child again, or None: it exited again after
        ``max_restarts`` restarts within ``window_s``; give up."""
        policy = self.policy
        if self.started_at is not None and now - self.started_at >= policy.reset_after_s:
            self.next_delay_s = policy.initial_backoff_s
        while self.restart_times and now - self.restart_times[0] > policy.window_s:
            self.restart_times.popleft()
        if len(self.restart_times) >= policy.max_restarts:
            return None
        self.restart_times.append(now)
        delay, self.next_delay_s = self.next_delay_s, min(self.next_delay_s * 2,
                                                          policy.max_backoff_s)
        return delay
