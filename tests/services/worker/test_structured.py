"""GrammarBank: masks, resumption, completion, and end-to-end generation with the real model."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from services.worker.structured import GrammarBank, apply_token_bitmask, bitmask_width
from shared.messages import StructuredSpec
from shared.models import resolve_model

VOCAB_SIZE = 49152
EOS = 2
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0,
                                                   "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}


def _spec(schema: dict) -> StructuredSpec:
    return StructuredSpec(kind="json_schema", json_schema=json.dumps(schema))


def _allowed(row: torch.Tensor, vocab_size: int = VOCAB_SIZE) -> list[int]:
    """The token ids whose bit is set in one bitmask row."""
    bits = (row[:, None] >> torch.arange(32, dtype=torch.int32)) & 1
    return bits.reshape(-1)[:vocab_size].nonzero().flatten().tolist()


@pytest.fixture(scope="module")
def model_dir():
    return resolve_model("smollm2").path


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return AutoTokenizer.from_pretrained(str(model_dir))


@pytest.fixture(scope="module")
def bank(model_dir):
    return GrammarBank(model_dir, VOCAB_SIZE, [EOS])


def _feed(bank: GrammarBank, request_id: str, token_ids: list[int]) -> None:
    for token_id in token_ids:
        assert token_id in _allowed(bank.fill_bitmask([request_id])[0]), token_id
        bank.accept(request_id, token_id)


def test_bitmask_shape_and_rows_outside_the_bank(bank):
    bank.add("a", _spec(PERSON), [])
    try:
        bitmask = bank.fill_bitmask(["zz", "a", "yy"])
        assert bitmask.shape == (3, bitmask_width(VOCAB_SIZE)) == (3, 1536)
        assert bitmask.dtype == torch.int32 and bitmask.device.type == "cpu"
        assert bool((bitmask[0] == -1).all()) and bool((bitmask[2] == -1).all())
        assert 0 < len(_allowed(bitmask[1])) < 200  # '{' and the like
        assert "a" in bank and "zz" not in bank
    finally:
        bank.remove("a")
    bank.remove("a")  # unknown: no error
    assert "a" not in bank


def test_single_space_separators_only(bank, tokenizer):
    bank.add("ws", _spec(PERSON), [])
    try:
        _feed(bank, "ws", tokenizer.encode('{"name": "Al", "age": 3'))
        allowed = {tokenizer.decode([t]) for t in _allowed(bank.fill_bitmask(["ws"])[0])}
        assert "}" in allowed
        assert not any(t.strip() == "" for t in allowed)  # no whitespace-only token
        bank.add("ws2", _spec(PERSON), tokenizer.encode('{"name":"Al"'))
        assert bank.is_finished("ws2")  # compact ":" was refused: the matcher is broken
    finally:
        bank.remove("ws")
        bank.remove("ws2")


def test_after_completion_only_stop_tokens(bank, tokenizer):
    bank.add("done", _spec(PERSON), [])
    try:
        _feed(bank, "done", tokenizer.encode('{"name": "Al", "age": 42}'))
        assert _allowed(bank.fill_bitmask(["done"])[0]) == [EOS]
        bank.accept("done", EOS)
        assert bank.is_finished("done")
        # a step already in flight samples for it once more: still only the stop token
        assert _allowed(bank.fill_bitmask(["done"])[0]) == [EOS]
        bank.accept("done", EOS)
        assert _allowed(bank.fill_bitmask(["done"])[0]) == [EOS]
    finally:
        bank.remove("done")


def test_a_refused_token_leaves_only_stop_tokens(bank, tokenizer):
    bank.add("bad", StructuredSpec(kind="json_object"), [])
    try:
        bank.accept("bad", tokenizer.encode("hello")[0])  # logged, not raised
        assert bank.is_finished("bad")
        assert _allowed(bank.fill_bitmask(["bad"])[0]) == [EOS]
    finally:
        bank.remove("bad")


def test_resumed_request_continues_where_it_was(bank, tokenizer):
    token_ids = tokenizer.encode('{"name": "Bo", "age": 7}')
    bank.add("live", _spec(PERSON), [])
    try:
        for cut in range(len(token_ids) + 1):
            bank.add("resumed", _spec(PERSON), token_ids[:cut])
            masks = bank.fill_bitmask(["live", "resumed"])
            assert torch.equal(masks[0], masks[1]), cut
            if cut < len(token_ids):
                assert not bank.is_finished("resumed")
                bank.accept("live", token_ids[cut])
        assert bank.is_finished("resumed")  # the closing brace completed it
        assert _allowed(bank.fill_bitmask(["resumed"])[0]) == [EOS]
    finally:
        bank.remove("live")
        bank.remove("resumed")


def test_invalid_spec_is_a_value_error(bank):
    with pytest.raises(ValueError):
        bank.add("x", _spec({"type": "foo"}), [])
    with pytest.raises(ValueError):
        bank.add("x", StructuredSpec(kind="json_schema", json_schema="{nope"), [])
    assert "x" not in bank


def test_apply_bitmask_on_cpu_tensors():
    generator = torch.Generator().manual_seed(0)
    vocab_size = 100  # 4 words, the last one partly past the vocabulary
    allowed = torch.rand(3, vocab_size, generator=generator) < 0.3
    allowed[1] = True  # a row that allows everything
    bits = torch.zeros(3, bitmask_width(vocab_size) * 32, dtype=torch.int64)
    bits[:, :vocab_size] = allowed.long()
    words = (bits.view(3, -1, 32) << torch.arange(32)).sum(-1)
    bitmask = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    logits = torch.randn(3, vocab_size, generator=generator)
    expected = logits.masked_fill(~allowed, float("-inf"))
    GrammarBank.apply_bitmask(logits, bitmask)
    assert torch.equal(logits, expected)
    # logits wider than the bitmask (a model vocabulary padded past the mask): the rest is -inf
    wide = torch.zeros(3, vocab_size + 40)
    apply_token_bitmask(wide, bitmask)
    assert bool(torch.isinf(wide[:, 128:]).all())
    assert torch.equal(torch.isinf(wide[:, :vocab_size]), ~allowed)


def test_logits_wider_than_the_tokenizer(model_dir):
    bank = GrammarBank(model_dir, VOCAB_SIZE + 64, [EOS])  # like a dummy model's vocabulary
    bank.add("w", StructuredSpec(kind="json_object"), [])
    bitmask = bank.fill_bitmask(["w"])
    assert bitmask.shape == (1, bitmask_width(VOCAB_SIZE + 64))
    assert max(_allowed(bitmask[0], VOCAB_SIZE + 64)) < VOCAB_SIZE


# ----------------------------------------------------------------- end to end, real model
E2E_SCHEMAS = {
    "nested": {"type": "object", "properties": {
        "user": {"type": "object", "properties": {
            "name": {"type": "string", "maxLength": 16},
            "address": {"type": "object", "properties": {
                "city": {"type": "string", "maxLength": 16}}, "required": ["city"],
                "additionalProperties": False}},
            "required": ["name", "address"], "additionalProperties": False}},
        "required": ["user"], "additionalProperties": False},
    "array": {"type": "object", "properties": {
        "colors": {"type": "array", "items": {"type": "string", "maxLength": 10},
                   "minItems": 2, "maxItems": 4}},
        "required": ["colors"], "additionalProperties": False},
    "enum": {"type": "object", "properties": {
        "sentiment": {"enum": ["positive", "negative", "neutral"]},
        "confident": {"type": "boolean"}},
        "required": ["sentiment", "confident"], "additionalProperties": False},
    "number_bounds": {"type": "object", "properties": {
        "age": {"type": "integer", "minimum": 18, "maximum": 65},
        "height_m": {"type": "number", "minimum": 1, "maximum": 2.5}},
        "required": ["age", "height_m"], "additionalProperties": False},
    "ref_any_of": {"$defs": {"point": {"type": "object", "properties": {
        "x": {"type": "integer", "minimum": -100, "maximum": 100},
        "y": {"type": "integer", "minimum": -100, "maximum": 100}},
        "required": ["x", "y"], "additionalProperties": False}},
        "type": "object", "properties": {
            "start": {"$ref": "#/$defs/point"},
            "label": {"anyOf": [{"type": "string", "maxLength": 8}, {"type": "null"}]}},
        "required": ["start", "label"], "additionalProperties": False},
}
SAMPLES_PER_SCHEMA = 3
MAX_NEW_TOKENS = 160


@pytest.fixture(scope="module")
def model(model_dir):
    # one thread: on a shared 2-core box two torch threads made a token ~20x slower
    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    torch.set_num_threads(num_threads)


def _generate(model, tokenizer, bank: GrammarBank, request_id: str, prompt: str,
              seed: int | None) -> str:
    """Sample at temperature 1.0 (greedy if seed is None) under the grammar until a stop
    token, reusing the KV cache."""
    input_ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, return_tensors="pt",
        return_dict=True)["input_ids"]
    generator = torch.Generator().manual_seed(seed) if seed is not None else None
    past, output = None, []
    with torch.no_grad():
        for _ in range(MAX_NEW_TOKENS):
            out = model(input_ids=input_ids, past_key_values=past, use_cache=True)
            past = out.past_key_values
            logits = out.logits[:, -1, :].float()  # [1, vocab_size]
            bank.apply_bitmask(logits, bank.fill_bitmask([request_id]))
            token_id = (int(logits.argmax()) if generator is None else
                        int(torch.multinomial(logits.softmax(-1), 1, generator=generator)))
            bank.accept(request_id, token_id)
            if token_id == EOS:
                return tokenizer.decode(output)
            output.append(token_id)
            input_ids = torch.tensor([[token_id]])
    raise AssertionError(f"no stop token after {MAX_NEW_TOKENS}: {tokenizer.decode(output)!r}")


@pytest.mark.parametrize("name", list(E2E_SCHEMAS))
def test_generation_follows_the_schema(model, tokenizer, bank, name):
    schema = E2E_SCHEMAS[name]
    prompt = f"Reply with only a JSON object that follows this JSON schema:\n{json.dumps(schema)}"
    for sample in range(SAMPLES_PER_SCHEMA):
        request_id = f"{name}-{sample}"
        bank.add(request_id, _spec(schema), [])
        try:
            text = _generate(model, tokenizer, bank, request_id, prompt, seed=sample)
        finally:
            bank.remove(request_id)
        jsonschema.validate(json.loads(text), schema)


def test_json_object_generation_parses(model, tokenizer, bank):
    # greedy: json_object bounds no string, and at temperature 1.0 the 135M model rambles
    bank.add("obj", StructuredSpec(kind="json_object"), [])
    try:
        text = _generate(model, tokenizer, bank, "obj",
                         "Describe a cat as a short JSON object with two keys.", seed=None)
    finally:
        bank.remove("obj")
    assert isinstance(json.loads(text), dict)
