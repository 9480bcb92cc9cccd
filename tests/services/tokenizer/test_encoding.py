import json
import shutil

import pytest

from services.tokenizer.detokenizer import initial_state
from services.tokenizer.encoding import TextCodec
from shared.errors import InvalidRequest
from shared.messages import ChatMessage, DecodeRequest, DetokItem, EncodeRequest
from shared.models import resolve_model

CONVERSATIONS = [
    [ChatMessage(role="user", content="What is the capital of France?")],
    [ChatMessage(role="system", content="You are terse."),
     ChatMessage(role="user", content="Hi!")],
    [ChatMessage(role="system", content="Answer in French."),
     ChatMessage(role="user", content="Hello"),
     ChatMessage(role="assistant", content="Bonjour !"),
     ChatMessage(role="user", content="Ünïcödé 😀🎉 日本語 — done?")],
    [ChatMessage(role="user", content="one"),
     ChatMessage(role="assistant", content="two"),
     ChatMessage(role="user", content=""),
     ChatMessage(role="assistant", content="  spaces\n\nand lines  ")],
]


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("conversation", CONVERSATIONS)
def test_chat_encoding_equals_apply_chat_template(codec, tokenizer, conversation,
                                                  add_generation_prompt):
    req = EncodeRequest(messages=conversation, add_generation_prompt=add_generation_prompt)
    expected = tokenizer.apply_chat_template(
        [{"role": m.role, "content": m.content} for m in conversation],
        add_generation_prompt=add_generation_prompt, tokenize=True, return_dict=False)
    assert codec.encode(req) == expected


def test_chat_template_adds_default_system_prompt_and_generation_prompt(codec, tokenizer):
    ids = codec.encode(EncodeRequest(messages=CONVERSATIONS[0]))
    text = tokenizer.decode(ids, skip_special_tokens=False)
    assert text.startswith("<|im_start|>system\n")
    assert text.endswith("<|im_start|>assistant\n")


def test_text_prompt_and_special_tokens(codec, tokenizer):
    text = "Hello <|im_end|> world"
    ids = codec.encode(EncodeRequest(prompt=text))
    assert ids == tokenizer(text, add_special_tokens=True).input_ids
    assert 2 in ids  # special tokens in text are parsed as such
    assert codec.decode(DecodeRequest(token_ids=ids)) == "Hello  world"
    assert codec.decode(DecodeRequest(token_ids=ids, skip_special_tokens=False)) == text


def test_token_prompt_passes_through(codec):
    assert codec.encode(EncodeRequest(prompt=[1, 2, 3, 49151])) == [1, 2, 3, 49151]


@pytest.mark.parametrize("req, param", [
    (EncodeRequest(), "prompt"),
    (EncodeRequest(prompt="hi", messages=[ChatMessage(role="user", content="hi")]), "messages"),
    (EncodeRequest(messages=[]), "messages"),
    (EncodeRequest(prompt=[5, 49152]), "prompt"),
    (EncodeRequest(prompt=[-1]), "prompt"),
    (EncodeRequest(prompt=[]), "prompt"),
    (EncodeRequest(prompt=""), "prompt"),
    (EncodeRequest(messages=[ChatMessage(role="user")]), "messages"),  # content None
])
def test_encode_errors(codec, req, param):
    with pytest.raises(InvalidRequest) as info:
        codec.encode(req)
    assert info.value.param == param
    assert info.value.status == 400 and info.value.message


def test_template_raising_is_invalid_request(codec, tokenizer, monkeypatch):
    monkeypatch.setattr(tokenizer, "chat_template",
                        "{{ raise_exception('roles must alternate') }}")
    with pytest.raises(InvalidRequest, match="roles must alternate"):
        codec.encode(EncodeRequest(messages=CONVERSATIONS[0]))


def test_no_chat_template(codec, tokenizer, monkeypatch):
    monkeypatch.setattr(tokenizer, "chat_template", None)
    assert not codec.info("m").has_chat_template
    with pytest.raises(InvalidRequest, match="no chat template") as info:
        codec.encode(EncodeRequest(messages=CONVERSATIONS[0]))
    assert info.value.param == "messages"


def test_decode_rejects_out_of_range(codec):
    with pytest.raises(InvalidRequest) as info:
        codec.decode(DecodeRequest(token_ids=[1, 10**6]))
    assert info.value.param == "token_ids"


def test_info(codec):
    info = codec.info("SmolLM2-135M-Instruct")
    assert info.model_name == "SmolLM2-135M-Instruct"
    assert info.max_model_len == 8192
    assert info.vocab_size == 49152
    assert info.eos_token_ids == [2]
    assert info.has_chat_template


def test_info_merges_eos_lists_and_honours_max_model_len(tmp_path):
    model_dir = tmp_path / "model"
    shutil.copytree(resolve_model("smollm2").path, model_dir,
                    ignore=shutil.ignore_patterns("*.safetensors"))
    generation = json.loads((model_dir / "generation_config.json").read_text())
    generation["eos_token_id"] = [0, 2]
    (model_dir / "generation_config.json").write_text(json.dumps(generation))
    codec = TextCodec(model_dir, max_model_len=1024)
    info = codec.info("m")
    assert info.eos_token_ids == [0, 2]
    assert info.max_model_len == 1024


def test_detokenize_batch(codec, tokenizer):
    prompt = codec.encode(EncodeRequest(messages=CONVERSATIONS[0]))
    out_a = tokenizer.encode(" Paris is the capital.", add_special_tokens=False)
    out_b = tokenizer.encode(" Ünïcödé 😀", add_special_tokens=False)
    items = [DetokItem("a", out_a, initial_state(prompt), finished=True),
             DetokItem("b", out_b, initial_state(prompt), stop=["😀"], finished=True)]
    results = codec.detokenize(items)
    assert [r.request_id for r in results] == ["a", "b"]
    assert results[0].text == " Paris is the capital." and not results[0].stopped
    assert results[1].text == " Ünïcödé " and results[1].stopped
