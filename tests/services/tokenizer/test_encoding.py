import json
import shutil

import pytest

from services.tokenizer.encoding import TOOLS_PROMPT, TextCodec
from shared.errors import InvalidRequest
from shared.messages import (
    ChatMessage, DecodeRequest, EncodeRequest, FunctionCall, ToolCall,
)
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


# ----------------------------------------------------------------- tool calling
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
TOOL_TURNS = [
    ChatMessage(role="user", content="Weather in Paris and Zürich?"),
    ChatMessage(role="assistant", content=None, tool_calls=[
        ToolCall(id="call_1", function=FunctionCall(name="get_weather",
                                                    arguments='{"city": "Paris"}')),
        ToolCall(id="call_2", function=FunctionCall(name="get_weather",
                                                    arguments='{"city":"Zürich"}'))]),
    ChatMessage(role="tool", tool_call_id="call_1", content="22C"),
    ChatMessage(role="tool", tool_call_id="call_2", content="18C"),
]
# A minimal tools-aware template, consuming tools and tool calls as HF templates do.
TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}"
    "<|im_end|>\n{% endif %}{% for message in messages %}<|im_start|>{{ message.role }}\n"
    "{% if message.tool_calls %}{% for call in message.tool_calls %}"
    '<tool_call>{"name": "{{ call.function.name }}", "arguments": '
    "{{ call.function.arguments | tojson }}}</tool_call>{% endfor %}"
    "{% else %}{{ message.content }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_smollm2_template_gets_the_fallback(codec):
    assert not codec.template_uses_tools


def test_fallback_lists_tools_in_a_system_message(codec, tokenizer):
    messages = [ChatMessage(role="user", content="Weather in Paris?")]
    text = codec.render_chat(messages, tools=[WEATHER_TOOL])
    prompt = TOOLS_PROMPT.format(tools=json.dumps(WEATHER_TOOL, ensure_ascii=False))
    assert text == tokenizer.apply_chat_template(
        [{"role": "system", "content": prompt}, {"role": "user", "content": "Weather in Paris?"}],
        add_generation_prompt=True, tokenize=False)
    assert "<tools>\n" + json.dumps(WEATHER_TOOL) + "\n</tools>" in text
    assert '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}' in text
    assert "SmolLM" not in text  # the tools system message replaces the default one


def test_fallback_appends_tools_to_the_clients_system_message(codec):
    messages = [ChatMessage(role="system", content="You are terse."),
                ChatMessage(role="user", content="Hi")]
    text = codec.render_chat(messages, tools=[WEATHER_TOOL, WEATHER_TOOL])
    assert text.startswith("<|im_start|>system\nYou are terse.\n\n# Tools\n")
    assert text.count("<|im_start|>system") == 1
    assert text.count(json.dumps(WEATHER_TOOL)) == 2


def test_fallback_renders_tool_calls_and_results_as_text(codec, tokenizer):
    text = codec.render_chat(TOOL_TURNS, add_generation_prompt=True)
    calls = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
             '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"}}\n</tool_call>')
    results = "<tool_response>\n22C\n</tool_response>\n<tool_response>\n18C\n</tool_response>"
    assert text == tokenizer.apply_chat_template(
        [{"role": "user", "content": "Weather in Paris and Zürich?"},
         {"role": "assistant", "content": calls}, {"role": "user", "content": results}],
        add_generation_prompt=True, tokenize=False)
    assert "SmolLM" in text  # no tools given: the template's default system prompt stays


def test_fallback_keeps_assistant_text_before_its_calls_and_odd_arguments(codec):
    messages = [ChatMessage(role="user", content="go"),
                ChatMessage(role="assistant", content="Let me check.", tool_calls=[
                    ToolCall(id="c", function=FunctionCall(name="f", arguments="not json"))]),
                ChatMessage(role="tool", tool_call_id="c", content="ok"),
                ChatMessage(role="user", content="thanks")]
    text = codec.render_chat(messages)
    assert ('<|im_start|>assistant\nLet me check.\n<tool_call>\n'
            '{"name": "f", "arguments": "not json"}\n</tool_call><|im_end|>') in text
    assert ("<|im_start|>user\n<tool_response>\nok\n</tool_response><|im_end|>\n"
            "<|im_start|>user\nthanks<|im_end|>") in text


def test_encode_passes_tools_to_the_template(codec, tokenizer):
    req = EncodeRequest(messages=TOOL_TURNS, tools=[WEATHER_TOOL])
    expected = tokenizer.encode(codec.render_chat(TOOL_TURNS, tools=[WEATHER_TOOL]),
                                add_special_tokens=False)
    assert codec.encode(req) == expected
    assert codec.encode(req) != codec.encode(EncodeRequest(messages=TOOL_TURNS))


def test_tools_aware_template_gets_tools_and_calls_with_object_arguments(codec, tokenizer,
                                                                        monkeypatch):
    monkeypatch.setattr(tokenizer, "chat_template", TOOLS_TEMPLATE)
    assert codec.template_uses_tools
    text = codec.render_chat(TOOL_TURNS, tools=[WEATHER_TOOL])
    assert text.startswith("<|im_start|>system\n" + json.dumps(WEATHER_TOOL) + "\n<|im_end|>\n")
    assert ('<|im_start|>assistant\n<tool_call>{"name": "get_weather", "arguments": '
            '{"city": "Paris"}}</tool_call><tool_call>{"name": "get_weather", "arguments": '
            '{"city": "Zürich"}}</tool_call><|im_end|>') in text
    assert "<|im_start|>tool\n22C<|im_end|>\n<|im_start|>tool\n18C<|im_end|>\n" in text
    assert "<tools>" not in text and "<tool_response>" not in text
    # without tools the same template renders exactly as before
    plain = codec.render_chat(CONVERSATIONS[1])
    assert plain == tokenizer.apply_chat_template(
        [{"role": m.role, "content": m.content} for m in CONVERSATIONS[1]],
        add_generation_prompt=True, tokenize=False)
