"""The multi-turn load: at most N conversations in flight, each sending turn k+1 only
after turn k finished, with turn k's generated text as the assistant's reply."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from cli.bench.client import HttpClient, RequestSettings, new_record, send
from cli.bench.conversations import Conversation, turn_messages
from cli.bench.datasets import BenchRequest
from cli.bench.load import DEADLINE_ERROR, RunResult
from cli.bench.metrics import RequestRecord

# messages -> (templated prompt text, its token ids): the benchmark's tokenizer
Render = Callable[[list[dict]], tuple[str, list[int]]]

SKIPPED_ERROR = "not sent: an earlier turn of its conversation failed"


def turn_request(conversation: Conversation, replies: list[str], render: Render,
                 session_ids: bool = True) -> BenchRequest:
    """The request of the conversation's next turn (turn ``len(replies)``)."""
    messages = turn_messages(conversation, replies)
    prompt, prompt_ids = render(messages)
    return BenchRequest(prompt, prompt_ids, conversation.output_len, messages=tuple(messages),
                        user=conversation.conversation_id if session_ids else None)


def turn_record(request: BenchRequest, conversation: Conversation, turn: int) -> RequestRecord:
    record = new_record(request)
    record.conversation_id, record.turn = conversation.conversation_id, turn
    return record


async def run_conversations(client: HttpClient, conversations: list[Conversation],
                            settings: RequestSettings, render: Render,
                            max_concurrency: int | None = None, session_ids: bool = True,
                            on_done: Callable[[RequestRecord], None] = lambda record: None,
                            max_duration_s: float | None = None) -> RunResult:
    """Run every conversation, at most ``max_concurrency`` at once (all at once if None),
    each turn after the one before it. A failed turn ends its conversation: its later
    turns are failed records (SKIPPED_ERROR), never sent. At ``max_duration_s`` what is
    in flight is cancelled (DEADLINE_ERROR) and the turns not yet sent are counted as not
    sent. Records come in conversation order, each conversation's turns in order."""
    finished: list[list[RequestRecord]] = [[] for _ in conversations]
    in_flight: dict[int, RequestRecord] = {}
    pending = iter(range(len(conversations)))  # shared by the workers: the next to start
    started = time.perf_counter()

    async def converse(index: int) -> None:
        conversation, replies = conversations[index], []
        for turn in range(conversation.num_turns):
            request = turn_request(conversation, replies, render, session_ids)
            record = in_flight[index] = turn_record(request, conversation, turn)
            await send(client, request, settings, started, record, keep_text=True)
            del in_flight[index]
            finished[index].append(record)
            on_done(record)
            if not record.success:
                for later in range(turn + 1, conversation.num_turns):
                    skipped = RequestRecord(prompt_len=0, output_len=conversation.output_len,
                                            error=SKIPPED_ERROR,
                                            conversation_id=conversation.conversation_id,
                                            turn=later)
                    finished[index].append(skipped)
                    on_done(skipped)
                return
            replies.append(record.output_text or "")

    async def worker() -> None:
        for index in pending:
            await converse(index)

    num_workers = min(max_concurrency or len(conversations), len(conversations))
    workers = [asyncio.create_task(worker()) for _ in range(num_workers)]
    done, unfinished = await asyncio.wait(workers, timeout=max_duration_s)
    duration_s = time.perf_counter() - started
    for task in unfinished:
        task.cancel()
    await asyncio.gather(*unfinished, return_exceptions=True)
    for task in done:
        task.result()  # a bug in a callback surfaces here
    records = [record for turns in finished for record in turns]
    if not unfinished:
        return RunResult(records, duration_s)
    cut = list(in_flight.values())
    for record in cut:
        record.error = DEADLINE_ERROR
    num_turns = sum(conversation.num_turns for conversation in conversations)
    return RunResult(records, duration_s, cut, num_not_sent=num_turns - len(records) - len(cut),
                     deadline_reached=True)
