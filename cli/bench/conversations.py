"""The ``multi-turn`` dataset: tenants × conversations × turns, as chat clients send them.

Each tenant has its own long system prompt, which all its conversations begin with. A
conversation's turn k+1 sends turn k's messages, turn k's reply and one new user message,
so its templated prompt begins with turn k's whole prompt: a prefix cache that still holds
turn k (or a router that knows which replica does) serves most of it. The reply is the
text the server generated for turn k, as a real chat client sends it back; everything else
is drawn from the seed. Pure: the conversations here, the replies from the caller.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from cli.bench.datasets import DatasetError, Tokenizer, drawable_ids, fit_prompt


@dataclass(frozen=True)
class MultiTurnShape:
    """How many of everything, and how long (in tokens of the benchmark's tokenizer)."""

    num_tenants: int
    conversations_per_tenant: int
    num_turns: int
    system_prompt_len: int
    user_message_len: int
    output_len: int

    @property
    def num_conversations(self) -> int:
        return self.num_tenants * self.conversations_per_tenant

    @property
    def num_requests(self) -> int:
        return self.num_conversations * self.num_turns

    def check(self) -> None:
        fields = vars(self)
        too_small = [name for name, value in fields.items() if value < 1]
        if too_small:
            flags = ", ".join("--" + name.replace("_", "-") for name in too_small)
            raise DatasetError(f"multi-turn needs {flags} of at least 1")


@dataclass(frozen=True)
class Conversation:
    conversation_id: str  # unique per seed: the requests' ``user`` (a session id)
    tenant: int
    system_prompt: str  # the tenant's, shared by its conversations
    user_messages: tuple[str, ...]  # one per turn
    output_len: int

    @property
    def num_turns(self) -> int:
        return len(self.user_messages)


def multi_turn_conversations(tokenizer: Tokenizer, shape: MultiTurnShape,
                             seed: int = 0) -> list[Conversation]:
    """Conversations in the order they start: conversation c of every tenant before
    conversation c + 1 of any, so the conversations in flight at once span the tenants
    (a cache or a router must keep them all apart to help)."""
    shape.check()
    rng = random.Random(seed)
    allowed_ids = drawable_ids(tokenizer)

    def text(length: int) -> str:
        return fit_prompt(tokenizer, "", rng.choices(allowed_ids, k=length), length,
                          allowed_ids, rng)[0]

    system_prompts = [text(shape.system_prompt_len) for _ in range(shape.num_tenants)]
    return [Conversation(conversation_id=f"s{seed}-t{tenant}-c{index}", tenant=tenant,
                         system_prompt=system_prompts[tenant],
                         user_messages=tuple(text(shape.user_message_len)
                                             for _ in range(shape.num_turns)),
                         output_len=shape.output_len)
            for index in range(shape.conversations_per_tenant)
            for tenant in range(shape.num_tenants)]


def turn_messages(conversation: Conversation, replies: list[str]) -> list[dict]:
    """The chat messages of turn ``len(replies)``: the system prompt, then each earlier
    turn's user message and reply, then this turn's user message."""
    turn = len(replies)
    if turn >= conversation.num_turns:
        raise ValueError(f"{conversation.conversation_id} has {conversation.num_turns} turns")
    messages = [{"role": "system", "content": conversation.system_prompt}]
    for user_message, reply in zip(conversation.user_messages, replies):
        messages += [{"role": "user", "content": user_message},
                     {"role": "assistant", "content": reply}]
    messages.append({"role": "user", "content": conversation.user_messages[turn]})
    return messages
