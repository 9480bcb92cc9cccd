"""Token bytes for logprobs: exact bytes per token, text with U+FFFD for split characters."""

from __future__ import annotations

from services.tokenizer.token_bytes import TokenBytes


def test_bytes_of_every_token_rebuild_the_text(tokenizer):
    text = " Hello wörld 😀 — tabs\tand\nnewlines"
    token_ids = tokenizer.encode(text, add_special_tokens=False)
    texts, data = TokenBytes(tokenizer).lookup(token_ids)
    assert b"".join(data).decode() == text
    assert texts == [piece.decode("utf-8", errors="replace") for piece in data]
    assert any("\ufffd" in t for t in texts)  # the emoji is split over tokens


def test_special_tokens_keep_their_name(tokenizer):
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert TokenBytes(tokenizer).lookup([eos, eos]) == (["<|im_end|>"] * 2, [b"<|im_end|>"] * 2)


def test_detokenize_names_the_logprob_tokens_an_item_asks_for(codec, tokenizer):
    from services.tokenizer.detokenizer import initial_state
    from shared.messages import DetokItem

    token_ids = tokenizer.encode(" café", add_special_tokens=False)
    asked, plain = codec.detokenize([
        DetokItem("a", token_ids, initial_state([]), logprob_token_ids=token_ids + token_ids[:1]),
        DetokItem("b", token_ids, initial_state([]))])
    texts, data = TokenBytes(tokenizer).lookup(token_ids + token_ids[:1])
    assert (asked.logprob_tokens, asked.logprob_token_bytes) == (texts, data)
    assert b"".join(asked.logprob_token_bytes[:-1]).decode() == " café"
    assert (plain.logprob_tokens, plain.logprob_token_bytes) == ([], [])
    assert asked.text == plain.text == " café"
