"""Who is alive: the last time each owner (a worker or scheduler instance) was heard
from. Pure: the caller passes the clock's time in."""

from __future__ import annotations


class OwnerClock:
    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._last_seen: dict[str, float] = {}

    def touch(self, owner_id: str, now: float) -> None:
        self._last_seen[owner_id] = now

    def expire(self, now: float) -> list[str]:
        """Forget, and return, the owners silent for longer than the timeout."""
        silent = [owner for owner, seen in self._last_seen.items()
                  if now - seen > self.timeout_s]
        for owner in silent:
            del self._last_seen[owner]
        return silent

    def __contains__(self, owner_id: str) -> bool:
        return owner_id in self._last_seen

    def __len__(self) -> int:
        return len(self._last_seen)
