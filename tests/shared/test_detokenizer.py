import itertools
import random
from typing import NamedTuple

import pytest

from shared.detokenizer import (
    MAX_UNREAD_TOKENS, NUM_CONTEXT_TOKENS, IncrementalDetokenizer, fast_decoder, find_stop,
    partial_stop_len,
)

MULTIBYTE_TEXTS = [
    "Ünïcödé 😀🎉 日本語 — done",
    " Café naïve résumé, Straße, Ελληνικά, русский текст.",
    "中文字符和日本語のテキスト🚀👩‍👩‍👧 mixed with ASCII & emoji 🇫🇷!",
    "\n\n```python\nprint('héllo')  # ✓\n```\n\t→ ok",
]
CHUNKINGS = [[1], [2, 1, 3], [5, 1, 1, 7], [1000]]
PROMPT = "<|im_start|>user\nSay something<|im_end|>\n<|im_start|>assistant\n"


class State(NamedTuple):
    window_ids: list[int]
    read_offset: int
    held_text: str


class Result(NamedTuple):
    """One step's outcome and the detokenizer's state after it."""

    text: str
    stopped: bool
    num_tokens_used: int
    state: State


def step(detok: IncrementalDetokenizer, token_ids, finished=False) -> Result:
    out = detok.step(token_ids, finished)
    return Result(out.text, out.stopped, out.num_tokens_used,
                  State(list(detok.window_ids), detok.read_offset, detok.held_text))


def stream(tokenizer, output_ids, sizes=(1,), stop=(), prompt_ids=(), finish=True,
           skip_special_tokens=True) -> tuple[str, list[Result]]:
    """Feed ``output_ids`` in chunks of ``sizes`` (cycled); the last chunk carries
    ``finished`` when ``finish``. Stops feeding once a result says ``stopped``."""
    detok = IncrementalDetokenizer(tokenizer, list(prompt_ids), list(stop), skip_special_tokens)
    results, start = [], 0
    for size in itertools.cycle(sizes):
        chunk = output_ids[start:start + size]
        start += size
        last = start >= len(output_ids)
        result = step(detok, chunk, finished=finish and last)
        results.append(result)
        if result.stopped or last:
            break
    return "".join(r.text for r in results), results


def truncate_at_stop(text: str, stops) -> tuple[str, bool]:
    """Reference: scan characters; the first stop string completed wins (longest on ties)."""
    for end in range(1, len(text) + 1):
        matches = [s for s in stops if s and text[:end].endswith(s)]
        if matches:
            return text[:end - max(map(len, matches))], True
    return text, False


def tokens_to_stop(tokenizer, output_ids, stops) -> int:
    """Reference: the fewest output tokens whose decoded text holds a stop string."""
    for count in range(1, len(output_ids) + 1):
        if truncate_at_stop(tokenizer.decode(output_ids[:count]), stops)[1]:
            return count
    raise AssertionError("no stop string in the output")


@pytest.fixture(scope="module")
def prompt_ids(tokenizer):
    return tokenizer.encode(PROMPT, add_special_tokens=False)


@pytest.mark.parametrize("sizes", CHUNKINGS)
@pytest.mark.parametrize("text", MULTIBYTE_TEXTS)
def test_streamed_text_equals_full_decode(tokenizer, prompt_ids, text, sizes):
    output_ids = tokenizer.encode(text, add_special_tokens=False)
    streamed, results = stream(tokenizer, output_ids, sizes, prompt_ids=prompt_ids)
    assert streamed == tokenizer.decode(output_ids, skip_special_tokens=True) == text
    assert all("\ufffd" not in r.text for r in results)
    assert all(not r.stopped for r in results)
    assert sum(r.num_tokens_used for r in results) == len(output_ids)


def test_characters_split_across_tokens_wait_for_completion(tokenizer):
    output_ids = tokenizer.encode("Ü", add_special_tokens=False)
    assert len(output_ids) == 2  # two byte tokens: the case under test
    _, results = stream(tokenizer, output_ids, finish=False)
    assert [r.text for r in results] == ["", "Ü"]
    assert results[0].state.read_offset < len(results[0].state.window_ids)


def test_empty_prompt_and_no_finish(tokenizer):
    text = "Ünïcödé 😀🎉 日本語 — done"
    output_ids = tokenizer.encode(text, add_special_tokens=False)
    assert stream(tokenizer, output_ids, finish=False)[0] == text


def test_special_tokens(tokenizer, prompt_ids):
    output_ids = tokenizer.encode("Paris.<|im_end|>", add_special_tokens=False)
    assert output_ids[-1] == 2
    assert stream(tokenizer, output_ids, prompt_ids=prompt_ids)[0] == "Paris."
    assert stream(tokenizer, output_ids, prompt_ids=prompt_ids,
                  skip_special_tokens=False)[0] == "Paris.<|im_end|>"


def test_state_stays_small_over_long_output(tokenizer, prompt_ids):
    text = " ".join(MULTIBYTE_TEXTS) * 8
    output_ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(output_ids) > 500
    stops = ["never appears", "ZZZ"]
    streamed, results = stream(tokenizer, output_ids, [1], stops, prompt_ids=prompt_ids)
    assert streamed == text
    assert max(len(r.state.window_ids) for r in results) <= NUM_CONTEXT_TOKENS + 4
    assert max(len(r.state.held_text) for r in results) < len(stops[0])


def test_invalid_bytes_are_flushed_and_state_bounded(tokenizer):
    lone_lead_byte = tokenizer.encode("Ü", add_special_tokens=False)[0]
    output_ids = [lone_lead_byte] * 50 + tokenizer.encode(" ok", add_special_tokens=False)
    streamed, results = stream(tokenizer, output_ids)
    assert streamed == tokenizer.decode(output_ids)
    assert max(len(r.state.window_ids) for r in results) <= NUM_CONTEXT_TOKENS + MAX_UNREAD_TOKENS


# ---------------------------------------------------------------- stop strings
STOP_CASES = [
    # (output text, stop strings, expected released text)
    ("Hello world, this is a test. STOP here", ["STOP"], "Hello world, this is a test. "),
    ("Hello world, this is a test.", ["lo wor"], "Hel"),  # spans tokens
    ("Hello world, this is a test.", ["xyz", "test", "world"], "Hello "),
    ("Hello world, this is a test.", ["Hello"], ""),  # at the very start
    ("Hello world, this is a test.", ["H"], ""),
    ("abc Ünïcödé 😀🎉 日本語 — done", ["本語"], "abc Ünïcödé 😀🎉 日"),  # inside a character's bytes
    ("abc Ünïcödé 😀🎉 日本語 — done", ["🎉 日"], "abc Ünïcödé 😀"),
    ("one two three four", ["two three four", "three"], "one two "),  # first completed wins
    ("one two three four", ["two three", "o t"], "one tw"),  # starts later, ends first
    ("line one\n\nline two", ["\n\n"], "line one"),
]


@pytest.mark.parametrize("sizes", CHUNKINGS)
@pytest.mark.parametrize("text, stops, expected", STOP_CASES)
def test_stop_strings(tokenizer, prompt_ids, text, stops, expected, sizes):
    output_ids = tokenizer.encode(text, add_special_tokens=False)
    assert truncate_at_stop(text, stops) == (expected, True)  # the reference agrees
    streamed, results = stream(tokenizer, output_ids, sizes, stops, prompt_ids=prompt_ids)
    assert streamed == expected
    assert results[-1].stopped and not any(r.stopped for r in results[:-1])
    consumed = sum(r.num_tokens_used for r in results)
    assert consumed == tokens_to_stop(tokenizer, output_ids, stops)
    assert results[-1].state.held_text == ""


def test_num_tokens_used_within_one_group(tokenizer):
    output_ids = tokenizer.encode("alpha beta gamma delta epsilon", add_special_tokens=False)
    result = step(IncrementalDetokenizer(tokenizer, [], ["gamma"]), output_ids)
    assert result.stopped and result.text == "alpha beta "
    assert result.num_tokens_used == tokens_to_stop(tokenizer, output_ids, ["gamma"]) == 3


def test_held_prefix_released_when_not_a_stop(tokenizer):
    pieces = ["hello", " world", " war", " and", " world", " peace", " after"]
    ids = [tokenizer.encode(p, add_special_tokens=False) for p in pieces]
    assert all(len(i) == 1 for i in ids)  # one token each: the steps below rely on it
    detok, texts, held = IncrementalDetokenizer(tokenizer, [], ["world peace"]), [], []
    for token_ids in ids:
        result = step(detok, token_ids)
        texts.append(result.text)
        held.append(result.state.held_text)
        if result.stopped:
            break
    assert texts == ["hello", " ", "world war", " and", " ", ""]
    assert held == ["", "world", "", "", "world", ""]
    assert result.stopped and "".join(texts) == "hello world war and "


def test_finished_flushes_held_text(tokenizer):
    output_ids = tokenizer.encode("hello world", add_special_tokens=False)
    streamed, results = stream(tokenizer, output_ids, [1], ["world peace"])
    assert streamed == "hello world" and not results[-1].stopped
    assert results[-2].state.held_text == "" and results[-1].state.held_text == ""
    # held until an empty, finishing item comes
    detok = IncrementalDetokenizer(tokenizer, [], ["world peace"])
    results = [step(detok, [token_id]) for token_id in output_ids]
    assert results[-1].state.held_text == "world"
    flush = step(detok, [], finished=True)
    assert flush.text == "world" and flush.state.held_text == "" and flush.num_tokens_used == 0


def test_stop_completed_by_finish_flush(tokenizer):
    # the last token waits for a second byte that never comes: finishing decodes it
    lone_lead_byte = tokenizer.encode("Ü", add_special_tokens=False)[0]
    output_ids = tokenizer.encode("abc", add_special_tokens=False) + [lone_lead_byte]
    streamed, results = stream(tokenizer, output_ids, [1], ["c\ufffd"])
    assert streamed == "ab" and results[-1].stopped
    assert sum(r.num_tokens_used for r in results) == len(output_ids)


@pytest.mark.parametrize("seed", range(40))
def test_random_texts_stops_and_chunkings(tokenizer, prompt_ids, seed):
    rng = random.Random(seed)
    alphabet = list("abc  de.,\n") + list("éüß日本語😀🎉—Ω")
    text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 80)))
    output_ids = tokenizer.encode(text, add_special_tokens=False)
    stops = []
    for _ in range(rng.randint(0, 3)):
        start = rng.randrange(len(text))
        stops.append(text[start:start + rng.randint(1, 4)])
    if rng.random() < 0.3:
        stops.append("not-in-text")
    sizes = [rng.randint(1, 4) for _ in range(3)]
    expected, matched = truncate_at_stop(text, stops)
    streamed, results = stream(tokenizer, output_ids, sizes, stops, prompt_ids=prompt_ids)
    assert streamed == expected
    assert results[-1].stopped == matched
    assert all("\ufffd" not in r.text for r in results)
    consumed = sum(r.num_tokens_used for r in results)
    assert consumed == (tokens_to_stop(tokenizer, output_ids, stops) if matched
                        else len(output_ids))


@pytest.mark.parametrize("text, stops, expected", [
    ("abcd", ["abcd", "bc"], 1),
    ("world", ["world", "d"], 0),
    ("xyz", ["q"], None),
    ("xyz", [], None),
])
def test_find_stop(text, stops, expected):
    assert find_stop(text, stops) == expected


@pytest.mark.parametrize("text, stops, expected", [
    ("hello wor", ["world"], 3),
    ("hello world", ["world"], 0),  # a full match is find_stop's job
    ("aaa", ["aab", "ab"], 2),
    ("x", ["y"], 0),
    ("", ["abc"], 0),
])
def test_partial_stop_len(text, stops, expected):
    assert partial_stop_len(text, stops) == expected


# ---------------------------------------------------------------- SentencePiece style
@pytest.fixture(scope="module")
def sentencepiece_tokenizer():
    """A tiny Llama-2-style tokenizer: Unigram pieces with '▁' for spaces, byte
    fallback, and a decoder that drops the first token's leading space."""
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    pieces = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)]
    letters = "abcdefghijklmnopqrstuvwxyz"
    words = ["▁Hello", "▁world", "▁the", "▁is", "▁a", "▁test", "▁"] + list(letters + ".,!")
    words += ["▁" + c for c in letters]
    vocab = [(p, 0.0) for p in pieces] + [(w, -1.0 - i / 10) for i, w in enumerate(words)]
    tok = Tokenizer(models.Unigram(vocab, unk_id=0, byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"),
                                           normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>")


@pytest.mark.parametrize("sizes", CHUNKINGS)
def test_sentencepiece_spacing_and_byte_fallback(sentencepiece_tokenizer, sizes):
    tok = sentencepiece_tokenizer
    all_ids = tok.encode("Hello world 日本 is a test ok", add_special_tokens=False)
    prompt_ids, output_ids = all_ids[:1], all_ids[1:]
    assert tok.decode(output_ids) == "world 日本 is a test ok"  # space lost alone
    streamed, results = stream(tok, output_ids, sizes, prompt_ids=prompt_ids)
    assert streamed == " world 日本 is a test ok"  # the prompt context keeps it
    assert all("\ufffd" not in r.text for r in results)
    # with no prompt, the stream matches decoding the output alone
    assert stream(tok, output_ids, sizes)[0] == "world 日本 is a test ok"
    assert stream(tok, output_ids, sizes, ["本 is"], prompt_ids)[0] == " world 日"


def test_nothing_after_a_stop(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, [], ["b"])
    assert detok.step(tokenizer.encode("a b c", add_special_tokens=False)).stopped
    later = detok.step(tokenizer.encode(" more", add_special_tokens=False), finished=True)
    assert later.stopped and later.text == "" and later.num_tokens_used == 0


def test_fast_decoder_decodes_as_the_tokenizer(tokenizer, prompt_ids):
    decoder = fast_decoder(tokenizer)
    assert decoder is not tokenizer  # SmolLM2: the Rust backend, no clean-up step
    for text in MULTIBYTE_TEXTS + ["Paris.<|im_end|>"]:
        ids = prompt_ids + tokenizer.encode(text, add_special_tokens=False)
        for skip in (True, False):
            for end in range(1, len(ids) + 1):
                assert decoder.decode(ids[:end], skip_special_tokens=skip) == \
                    tokenizer.decode(ids[:end], skip_special_tokens=skip)
    streamed, _ = stream(decoder, tokenizer.encode(MULTIBYTE_TEXTS[2], add_special_tokens=False),
                         [2, 1], prompt_ids=prompt_ids)
    assert streamed == MULTIBYTE_TEXTS[2]
