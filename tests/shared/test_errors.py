"""check_token_ids: a client's token ids inside the vocabulary, or a 400 naming the first
that is not."""

from __future__ import annotations

import pytest

from shared.errors import InvalidRequest, check_token_ids


@pytest.mark.parametrize("token_ids", [[1, 2, 3], [9, 0], list(range(10)) * 2_000])
def test_ids_inside_the_vocabulary_come_back_as_a_new_list(token_ids):
    checked = check_token_ids(token_ids, 10, "prompt")
    assert checked == token_ids and checked is not token_ids


@pytest.mark.parametrize("token_ids, bad", [
    ([1, 10], 10), ([-1, 3], -1), ([5, 11, -3], 11), ([0] * 20_000 + [12], 12), ([1, 2**70], 2**70),
])
def test_the_first_id_outside_is_named(token_ids, bad):
    with pytest.raises(InvalidRequest) as error:
        check_token_ids(token_ids, 10, "prompt")
    assert error.value.message == f"token id {bad} is out of range: the vocabulary has 10 tokens"
    assert error.value.param == "prompt"


def test_an_empty_prompt_is_refused():
    with pytest.raises(InvalidRequest, match="the prompt is empty"):
        check_token_ids([], 10, "prompt")
