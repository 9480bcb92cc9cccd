"""A transfer speed measured from recent transfers (bytes/s). Pure."""

from __future__ import annotations


class RateMeter:
    """Bytes over seconds of the recent transfers, each past one's weight decaying by
    ``decay`` per new one: one slow read (a cold file) moves it, but does not own it."""

    def __init__(self, decay: float = 0.9) -> None:
        self.decay = decay
        self._bytes = 0.0
        self._seconds = 0.0

    def record(self, num_bytes: int, seconds: float) -> None:
        if num_bytes <= 0 or seconds <= 0:
            return
        self._bytes = self._bytes * self.decay + num_bytes
        self._seconds = self._seconds * self.decay + seconds

    @property
    def bytes_per_s(self) -> float:
        """0.0 until something was measured."""
        return self._bytes / self._seconds if self._seconds > 0 else 0.0
