"""The multi-turn dataset: tenants' system prompts, conversations, each turn's messages,
on the default model's tokenizer and chat template."""

from __future__ import annotations

import pytest

from cli.bench.conversations import MultiTurnShape, multi_turn_conversations, turn_messages
from cli.bench.datasets import DatasetError
from cli.bench.multi_turn import chat_renderer

SHAPE = MultiTurnShape(num_tenants=3, conversations_per_tenant=2, num_turns=3,
                       system_prompt_len=60, user_message_len=12, output_len=5)


def encoded_len(tokenizer, text: str) -> int:
    return len(tokenizer.encode(text, add_special_tokens=False))


def test_tenants_share_a_system_prompt_and_conversations_interleave(tokenizer):
    conversations = multi_turn_conversations(tokenizer, SHAPE, seed=7)
    assert len(conversations) == SHAPE.num_conversations == 6 and SHAPE.num_requests == 18
    # conversation c of every tenant before conversation c + 1 of any
    assert [c.tenant for c in conversations] == [0, 1, 2, 0, 1, 2]
    assert len({c.conversation_id for c in conversations}) == 6
    assert all(c.conversation_id.startswith("s7-") for c in conversations)
    by_tenant = {}
    for conversation in conversations:
        by_tenant.setdefault(conversation.tenant, set()).add(conversation.system_prompt)
    assert all(len(prompts) == 1 for prompts in by_tenant.values())
    assert len({c.system_prompt for c in conversations}) == 3
    assert [encoded_len(tokenizer, c.system_prompt) for c in conversations[:3]] == [60] * 3
    messages = [m for c in conversations for m in c.user_messages]
    assert len(messages) == 18 and len(set(messages)) == 18
    assert {encoded_len(tokenizer, m) for m in messages} == {12}
    assert {c.num_turns for c in conversations} == {3} and {c.output_len for c in conversations} == {5}


def test_the_seed_decides_every_text(tokenizer):
    first = multi_turn_conversations(tokenizer, SHAPE, seed=1)
    assert multi_turn_conversations(tokenizer, SHAPE, seed=1) == first
    other = multi_turn_conversations(tokenizer, SHAPE, seed=2)
    assert not {c.system_prompt for c in first} & {c.system_prompt for c in other}
    assert not {c.conversation_id for c in first} & {c.conversation_id for c in other}


def test_a_turn_carries_the_earlier_turns_and_their_replies(tokenizer):
    conversation = multi_turn_conversations(tokenizer, SHAPE)[0]
    assert turn_messages(conversation, []) == [
        {"role": "system", "content": conversation.system_prompt},
        {"role": "user", "content": conversation.user_messages[0]}]
    third = turn_messages(conversation, ["first reply", "second reply"])
    assert [m["role"] for m in third] == ["system", "user", "assistant", "user", "assistant", "user"]
    assert [third[2]["content"], third[4]["content"]] == ["first reply", "second reply"]
    assert third[5]["content"] == conversation.user_messages[2]
    with pytest.raises(ValueError, match="3 turns"):
        turn_messages(conversation, ["a", "b", "c"])


def test_a_turns_prompt_begins_with_the_turn_before_it(tokenizer):
    """What makes the workload cacheable: turn k's templated prompt, then its reply, are
    the first tokens of turn k + 1's."""
    render = chat_renderer(tokenizer)
    conversation = multi_turn_conversations(tokenizer, SHAPE)[1]
    replies = ["Sure, here is a reply.", " Another one, with a leading space."]
    prompts = [render(turn_messages(conversation, replies[:turn])) for turn in range(3)]
    for (text, ids), (next_text, next_ids), reply in zip(prompts, prompts[1:], replies):
        assert next_text.startswith(text + reply)
        assert next_ids[:len(ids)] == ids
    text, ids = prompts[0]
    assert text.endswith("<|im_start|>assistant\n") and conversation.system_prompt in text
    assert len(ids) == encoded_len(tokenizer, text) > 60 + 12


def test_sizes_below_one_are_refused_by_name(tokenizer):
    shape = MultiTurnShape(num_tenants=0, conversations_per_tenant=1, num_turns=0,
                           system_prompt_len=8, user_message_len=8, output_len=4)
    with pytest.raises(DatasetError, match="--num-tenants, --num-turns of at least 1"):
        multi_turn_conversations(tokenizer, shape)


def test_a_tokenizer_without_a_chat_template_is_refused():
    class Plain:
        chat_template = None

    with pytest.raises(DatasetError, match="chat template"):
        chat_renderer(Plain())
