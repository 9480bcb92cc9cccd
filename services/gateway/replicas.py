"""What the gateway knows of each scheduler (one replica's scheduler instance), keyed by
scheduler id: its latest stats, when it was last heard from, this gateway's requests
running there, and whether it is still finishing steps. Pure synchronous code; the
service (service.py) feeds it from stats events and its own submits, and reads it to
route, report readiness and find lost requests. Times are the caller's monotonic clock.
"""

from __future__ import annotations

from dataclasses import dataclass

from shared.scheduler_stats import SchedulerStats


@dataclass
class ReplicaRecord:
    stats: SchedulerStats | None = None  # latest stats; None until heard, or once dropped
    heard_at: float | None = None  # last stats (or first submit); None once replaced
    num_outstanding: int = 0  # our requests still running there
    num_outstanding_at_stats: int = 0  # num_outstanding when its last stats came
    num_steps: int = -1  # steps it had finished at its last stats ...
    steps_changed_at: float = 0.0  # ... and when that count last changed, or it was idle
    stalled: bool = False  # its current stall was already acted on


@dataclass(frozen=True)
class Stall:
    scheduler_id: str
    replica_id: str
    stuck_s: float


class ReplicaTable:
    def __init__(self, heartbeat_timeout_s: float, stall_timeout_s: float) -> None:
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.stall_timeout_s = stall_timeout_s
        # Records are kept once made: a replaced scheduler's requests still count down.
        self._records: dict[str, ReplicaRecord] = {}

    def record(self, scheduler_id: str) -> ReplicaRecord:
        """The scheduler's record, made empty on first use."""
        record = self._records.get(scheduler_id)
        if record is None:
            record = self._records[scheduler_id] = ReplicaRecord()
        return record

    def stats(self, scheduler_id: str) -> SchedulerStats | None:
        record = self._records.get(scheduler_id)
        return record.stats if record is not None else None

    # ------------------------------------------------------------ updates
    def heard(self, stats: SchedulerStats, now: float) -> list[str]:
        """Take a scheduler's stats. Returns the ids of the schedulers they replace: a new
        scheduler for a replica that had another means the old one restarted (their stats
        and heartbeat are dropped here; their requests are the caller's to move)."""
        if self.stats(stats.scheduler_id) is not None:
            replaced, record = [], self._records[stats.scheduler_id]
        else:  # (back) in the list: last, so that ties go to those heard from first
            replaced = self._replaced_by(stats)
            record = self._records.pop(stats.scheduler_id, None) or ReplicaRecord()
            self._records[stats.scheduler_id] = record
        record.heard_at = now
        # The stall clock runs only while there is work: stats that show none (or a new
        # step) restart it, so work that comes after an idle spell is not stuck at once.
        if record.num_steps != stats.num_steps or not (stats.num_running or stats.num_waiting):
            record.num_steps, record.steps_changed_at = stats.num_steps, now
            record.stalled = False
        record.stats = stats
        # our requests there as these stats came: the rest of their load is other gateways'
        record.num_outstanding_at_stats = record.num_outstanding
        return replaced

    def _replaced_by(self, stats: SchedulerStats) -> list[str]:
        replaced = [sid for sid, record in self._records.items()
                    if record.stats is not None and record.stats.replica_id == stats.replica_id
                    and sid != stats.scheduler_id]
        for sid in replaced:
            record = self._records[sid]
            record.stats, record.heard_at, record.num_outstanding_at_stats = None, None, 0
        return replaced

    def submitted(self, scheduler_id: str, num_requests: int, now: float) -> None:
        """It took ``num_requests`` of ours; one never heard from counts as heard now."""
        record = self.record(scheduler_id)
        if record.heard_at is None:
            record.heard_at = now
        record.num_outstanding += num_requests

    def add_outstanding(self, scheduler_id: str, num_requests: int) -> None:
        """Count requests sent (or, negative, ended or moved away) without a heartbeat."""
        self.record(scheduler_id).num_outstanding += num_requests

    def drop_stats(self, scheduler_id: str) -> None:
        """It refused a submit as gone: not routed to until its stats come again."""
        record = self._records.get(scheduler_id)
        if record is not None:
            record.stats = None

    # ------------------------------------------------------------ reads
    def live(self, now: float) -> list[SchedulerStats]:
        """The stats of every scheduler heard from within the heartbeat timeout."""
        return [record.stats for record in self._records.values()
                if record.stats is not None
                and now - (record.heard_at or 0.0) < self.heartbeat_timeout_s]

    def silent_s(self, scheduler_id: str, now: float) -> float:
        """Seconds since it was last heard from (0 when it has no heartbeat)."""
        record = self._records.get(scheduler_id)
        if record is None or record.heard_at is None:
            return 0.0
        return now - record.heard_at

    def silent(self, now: float) -> list[str]:
        """Schedulers with a heartbeat older than the heartbeat timeout."""
        return [sid for sid, record in self._records.items()
                if record.heard_at is not None
                and now - record.heard_at > self.heartbeat_timeout_s]

    def seconds_since_step(self, scheduler_id: str, now: float) -> float:
        """How long the replica has gone without finishing a step (0 when it has no work)."""
        record = self._records.get(scheduler_id)
        if record is None or record.stats is None or \
                not (record.stats.num_running or record.stats.num_waiting):
            return 0.0
        return now - record.steps_changed_at

    def is_ready(self, stats: SchedulerStats, now: float) -> bool:
        """Ready: heard from, its worker attached, and stepping whenever it has work."""
        return stats.worker_ready and \
            self.seconds_since_step(stats.scheduler_id, now) <= self.stall_timeout_s

    def newly_stalled(self, now: float) -> list[Stall]:
        """Replicas alive but not stepping with work queued for over the stall timeout (a
        hung worker), each reported once per stall."""
        found = []
        for scheduler_id, record in self._records.items():
            if record.stats is None or record.stalled:
                continue
            stuck_s = self.seconds_since_step(scheduler_id, now)
            if stuck_s > self.stall_timeout_s:
                record.stalled = True
                found.append(Stall(scheduler_id, record.stats.replica_id, stuck_s))
        return found
