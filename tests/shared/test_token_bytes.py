"""Token bytes for logprobs: exact bytes per token, text with U+FFFD for split characters."""

from __future__ import annotations

from shared.detokenizer import TokenBytes


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
