"""NATS subject names, built in one place.

``{ns}.v1.{service}.{verb}``            load-balanced over a queue group
``{ns}.v1.{service}.{instance}.{verb}`` addressed to one instance
``{ns}.v1.evt.{service}.{event}``       events, fan-out
The namespace prefix lets two deployments share one NATS.
"""

from __future__ import annotations

from dataclasses import dataclass

VERSION = "v1"


@dataclass(frozen=True)
class Subjects:
    namespace: str = "flotilla"

    def _svc(self, service: str, verb: str) -> str:
        return f"{self.namespace}.{VERSION}.{service}.{verb}"

    def _addressed(self, service: str, instance: str, verb: str) -> str:
        return f"{self.namespace}.{VERSION}.{service}.{instance}.{verb}"

    def queue_group(self, service: str) -> str:
        return f"{self.namespace}.{service}"

    # tokenizer (stateless, any replica)
    @property
    def tokenizer_encode(self) -> str:
        return self._svc("tokenizer", "encode")

    @property
    def tokenizer_decode(self) -> str:
        return self._svc("tokenizer", "decode")


    @property
    def tokenizer_info(self) -> str:
        return self._svc("tokenizer", "info")

    # scheduler
    @property
    def scheduler_submit(self) -> str:
        return self._svc("scheduler", "submit")

    def scheduler_submit_to(self, scheduler_id: str) -> str:
        """Submit to one scheduler (the gateway routes by load)."""
        return self._addressed("scheduler", scheduler_id, "submit")

    def scheduler_abort(self, scheduler_id: str) -> str:
        return self._addressed("scheduler", scheduler_id, "abort")

    def scheduler_lora(self, scheduler_id: str, verb: str) -> str:
        """Load or unload a LoRA adapter on one scheduler (verb: lora_load, lora_unload)."""
        return self._addressed("scheduler", scheduler_id, verb)

    def scheduler_blocks_snapshot(self, scheduler_id: str) -> str:
        """Every block hash in one scheduler's GPU prefix cache (BlockSnapshotRequest)."""
        return self._addressed("scheduler", scheduler_id, "blocks_snapshot")

    # worker: addressed by replica, paired with one scheduler
    def worker_step(self, replica_id: str) -> str:
        return self._addressed("worker", replica_id, "step")

    def worker_attach(self, replica_id: str) -> str:
        """A scheduler attaching: the worker drops all request state and says what it holds."""
        return self._addressed("worker", replica_id, "attach")

    def worker_ping(self, replica_id: str) -> str:
        """Liveness of one replica's worker; answered even while a step runs."""
        return self._addressed("worker", replica_id, "ping")

    # gateway: each instance receives the outputs of the requests it submitted
    def gateway_outputs(self, gateway_id: str) -> str:
        return self._addressed("gateway", gateway_id, "outputs")

    # stored responses (JetStream, docs/openai-api.md): a stored request's outputs go to
    # ``{ns}.v1.resp.{gateway}.{request}.out`` (the scheduler publishes there instead of the
    # gateway's outputs subject; the gateway hears it live), the gateways' records of it
    # (start, moves, failure, cancel) to ``....rec``; one stream keeps ``{ns}.v1.resp.>``.
    def response_outputs(self, gateway_id: str, request_id: str) -> str:
        return f"{self.namespace}.{VERSION}.resp.{gateway_id}.{request_id}.out"

    def response_records(self, gateway_id: str, request_id: str) -> str:
        return f"{self.namespace}.{VERSION}.resp.{gateway_id}.{request_id}.rec"

    def response_all(self, request_id: str) -> str:
        """Every message of one stored response, whichever gateway took it."""
        return f"{self.namespace}.{VERSION}.resp.*.{request_id}.*"

    def gateway_response_outputs(self, gateway_id: str, kind: str = "out") -> str:
        """The outputs (``kind`` "out") or records ("rec") of one gateway's stored requests."""
        return f"{self.namespace}.{VERSION}.resp.{gateway_id}.*.{kind}"

    @property
    def response_stream_subjects(self) -> str:
        return f"{self.namespace}.{VERSION}.resp.>"

    @property
    def response_stream(self) -> str:
        """The JetStream stream's name (no dots or wildcards in a stream name)."""
        safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in self.namespace)
        return f"{safe}_responses"

    # kvstore: one per node, addressed by node id; the worker and scheduler of a replica use
    # the worker's node's
    def kvstore(self, node_id: str, verb: str) -> str:
        """verbs: attach, reserve, commit, lookup, pin, release, stats, keepalive, health,
        blocks_snapshot (every block hash in its tiers: BlockSnapshotRequest).
        A node id may be a Kubernetes node name: its dots (subject token separators)
        become underscores, on every side alike."""
        return self._addressed("kvstore", node_id.replace(".", "_"), verb)

    # health of any service (one replica answers)
    def health(self, service: str) -> str:
        return self._svc(service, "health")

    # events
    @property
    def kvstore_blocks(self) -> str:
        """KvBlockEvent: blocks that entered or left a kvstore tier."""
        return f"{self.namespace}.{VERSION}.evt.kvstore.blocks"

    @property
    def scheduler_stats(self) -> str:
        return f"{self.namespace}.{VERSION}.evt.scheduler.stats"

    @property
    def scheduler_blocks(self) -> str:
        """SchedulerBlockEvent: blocks that entered or left a scheduler's GPU prefix cache."""
        return f"{self.namespace}.{VERSION}.evt.scheduler.blocks"
