"""Every parameter of OpenAI's chat-completions and completions requests is implemented,
accepted and ignored, or refused by name (docs/openai-api.md); values OpenAI allows are
accepted; unknown parameters are refused unless the gateway accepts them; the model's
generation_config.json defaults apply to what a request leaves out."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from services.gateway.http_input import resolve_max_tokens
from services.gateway.config import GatewayConfig
from services.gateway.protocol import (ChatCompletionRequest, CompletionRequest,
                                       default_max_tokens, parse_request)
from shared.config import load_config
from shared.errors import InvalidRequest
from shared.messages import GenerationDefaults
from shared.models import read_generation_defaults

OPENAI_SCHEMA = Path(__file__).parents[2] / "fuzz" / "openai_openapi_subset.json"
VOCAB_SIZE = 1000
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
COMPLETION = {"model": "m", "prompt": "hi"}

IGNORED_CHAT = {  # realistic values clients send; none changes what is generated
    "store": False, "metadata": {"run": "7"}, "service_tier": "auto",
    "prompt_cache_key": "user-42", "prompt_cache_retention": "24h",
    "prompt_cache_options": {"ttl": "30m"}, "safety_identifier": "hash-1", "user": "u1",
    "modalities": ["text"], "reasoning_effort": "low", "verbosity": "medium",
    "prediction": {"type": "content", "content": "a likely answer"},
    "stream": True, "stream_options": {"include_usage": True, "include_obfuscation": False},
}
REFUSED_CHAT = [  # (parameter, value): honouring it is impossible here
    ("audio", {"voice": "alloy", "format": "wav"}),
    ("modalities", ["text", "audio"]),
    ("web_search_options", {}),
    ("moderation", {"model": "omni-moderation-latest"}),
    ("functions", [{"name": "f"}]),
    ("function_call", "auto"),
    ("tools", [{"type": "custom", "custom": {"name": "grammar_tool"}}]),
    ("tool_choice", {"type": "custom", "custom": {"name": "grammar_tool"}}),
]


def _openai_properties(schema_name: str) -> set[str]:
    schemas = json.loads(OPENAI_SCHEMA.read_text())["components"]["schemas"]

    def collect(schema: dict) -> set[str]:
        if "$ref" in schema:
            return collect(schemas[schema["$ref"].rsplit("/", 1)[1]])
        names = set(schema.get("properties", {}))
        for part in schema.get("allOf", []):
            names |= collect(part)
        return names

    return collect(schemas[schema_name])


@pytest.mark.parametrize("model, schema_name", [
    (ChatCompletionRequest, "CreateChatCompletionRequest"),
    (CompletionRequest, "CreateCompletionRequest"),
])
def test_every_openai_parameter_is_declared(model, schema_name):
    openai_names = _openai_properties(schema_name)
    assert len(openai_names) > 15
    assert openai_names - set(model.model_fields) == set()


def test_ignored_parameters_change_nothing():
    plain = parse_request(ChatCompletionRequest, {**CHAT, "stream": True})
    loaded = parse_request(ChatCompletionRequest, {**CHAT, **IGNORED_CHAT})
    assert loaded.sampling_params(8, VOCAB_SIZE) == plain.sampling_params(8, VOCAB_SIZE)
    assert loaded.include_usage
    completion = parse_request(CompletionRequest, {**COMPLETION, "user": "u1", "suffix": ""})
    assert completion.sampling_params(8, VOCAB_SIZE) == \
        parse_request(CompletionRequest, COMPLETION).sampling_params(8, VOCAB_SIZE)


@pytest.mark.parametrize("param, value", REFUSED_CHAT, ids=[p for p, _ in REFUSED_CHAT])
def test_impossible_parameters_are_refused_by_name(param, value):
    with pytest.raises(InvalidRequest) as error:
        parse_request(ChatCompletionRequest, {**CHAT, param: value})
    assert error.value.param == param and error.value.status == 400


def test_store_true_takes_one_choice():
    """(Honoured with the response store; the route refuses it without: docs/openai-api.md.)"""
    assert parse_request(ChatCompletionRequest, {**CHAT, "store": True}).store is True
    with pytest.raises(InvalidRequest) as error:
        parse_request(ChatCompletionRequest, {**CHAT, "store": True, "n": 2})
    assert error.value.param == "store" and error.value.status == 400


# (image_url parts parse; a text-only model refuses them in the route: test_media.py)
@pytest.mark.parametrize("part", [
    {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
    {"type": "file", "file": {"file_id": "file-1"}},
])
def test_non_text_content_is_refused(part):
    with pytest.raises(InvalidRequest) as error:
        parse_request(ChatCompletionRequest, {**CHAT, "messages": [
            {"role": "user", "content": [{"type": "text", "text": "what is this?"}, part]}]})
    assert error.value.param == "messages" and part["type"] in error.value.message


def test_null_means_the_default():
    nulls = {name: None for name in ("temperature", "top_p", "n", "stream", "stop",
                                     "max_tokens", "max_completion_tokens", "logit_bias",
                                     "logprobs", "top_logprobs", "seed", "presence_penalty",
                                     "frequency_penalty", "tools", "tool_choice", "user",
                                     "response_format", "stream_options", "store")}
    req = parse_request(ChatCompletionRequest, {**CHAT, **nulls})
    assert (req.n, req.stream, req.stop_strings, req.requested_max_tokens) == (1, False, [], None)
    completion = parse_request(CompletionRequest, {**COMPLETION, "max_tokens": None,
                                                   "echo": None, "best_of": None, "n": None})
    assert (completion.max_tokens, completion.echo, completion.num_sequences) == (16, False, 1)
    with pytest.raises(InvalidRequest) as error:  # a required parameter stays required
        parse_request(ChatCompletionRequest, {**CHAT, "model": None})
    assert error.value.param == "model"


def test_values_openai_allows_are_accepted():
    req = parse_request(ChatCompletionRequest, {
        **CHAT, "logit_bias": {"5": 10, "7": -100}, "stop": "\n", "top_p": 0,
        "messages": [{"role": "developer", "content": [{"type": "text", "text": "Be brief."}]},
                     {"role": "user", "content": "hi", "name": "ann"},
                     {"role": "assistant", "content": [{"type": "refusal", "refusal": "No."}],
                      "refusal": "No."}]})
    params = req.sampling_params(8, VOCAB_SIZE)
    assert params.logit_bias == {5: 10.0, 7: -100.0}
    assert (params.top_k, params.top_p) == (1, 1.0)  # top_p 0: only the top token
    assert req.messages[2].to_message().content == "No."
    assert parse_request(ChatCompletionRequest, {**CHAT, "stop": ["a", ""]}).stop_strings == ["a"]
    assert parse_request(ChatCompletionRequest, {**CHAT, "stop": ""}).stop_strings == []


def test_an_empty_or_null_prompt_starts_a_new_document():
    for prompt in ("", None):
        req = parse_request(CompletionRequest, {**COMPLETION, "prompt": prompt})
        assert req.prompts_or_document_start(0) == [[0]]
    batch = parse_request(CompletionRequest, {**COMPLETION, "prompt": ["", "x"]})
    assert batch.prompts_or_document_start(5) == [[5], "x"]
    with pytest.raises(InvalidRequest):
        parse_request(CompletionRequest, {**COMPLETION, "prompt": []}).prompts


def test_allowed_tools_choice_narrows_the_tools():
    tools = [{"type": "function", "function": {"name": name, "strict": None}}
             for name in ("a", "b")]
    req = parse_request(ChatCompletionRequest, {**CHAT, "tools": tools, "tool_choice": {
        "type": "allowed_tools", "allowed_tools": {"mode": "required", "tools": [
            {"type": "function", "function": {"name": "b"}}]}}})
    assert req.tools_and_choice() == ([{"type": "function", "function": {"name": "b"}}],
                                      "required")
    unknown = parse_request(ChatCompletionRequest, {**CHAT, "tools": tools, "tool_choice": {
        "type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": [
            {"type": "function", "function": {"name": "zzz"}}]}}})
    with pytest.raises(InvalidRequest, match="zzz"):
        unknown.tools_and_choice()


def test_unknown_fields_are_refused_unless_accepted():
    body = {**CHAT, "vendor_extension": {"x": 1}}
    with pytest.raises(InvalidRequest) as error:
        parse_request(ChatCompletionRequest, body)
    assert error.value.param == "vendor_extension"
    with capture_logs() as logs:
        req = parse_request(ChatCompletionRequest, body, accept_unknown_fields=True)
    assert req.messages[0].content == "hi"
    assert logs[0]["event"] == "unknown_fields_ignored"
    assert logs[0]["fields"] == ["vendor_extension"]
    with pytest.raises(InvalidRequest):  # a known parameter is still checked
        parse_request(ChatCompletionRequest, {**body, "temperature": 9},
                      accept_unknown_fields=True)


def test_gateway_flags_and_environment():
    config = load_config(GatewayConfig, ["--accept-unknown-fields", "--max-tokens-default", "64"],
                         environ={})
    assert config.accept_unknown_fields and config.max_tokens_default == 64
    from_env = load_config(GatewayConfig, [], environ={"FLOTILLA_ACCEPT_UNKNOWN_FIELDS": "1",
                                                       "FLOTILLA_MAX_TOKENS_DEFAULT": "32"})
    assert from_env.accept_unknown_fields and from_env.max_tokens_default == 32
    assert not load_config(GatewayConfig, [], environ={}).accept_unknown_fields
    with pytest.raises(ValueError):
        GatewayConfig(max_tokens_default=-1)


def test_generation_config_defaults_are_read(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps({
        "do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20,
        "repetition_penalty": 1.05, "max_new_tokens": 512, "min_p": "high", "bos_token_id": 1}))
    assert read_generation_defaults(tmp_path) == GenerationDefaults(
        temperature=0.6, top_p=0.95, top_k=20, repetition_penalty=1.05, max_new_tokens=512)
    assert read_generation_defaults(tmp_path / "missing") == GenerationDefaults()


def test_model_defaults_apply_only_to_what_the_request_leaves_out():
    defaults = GenerationDefaults(temperature=0.6, top_p=0.9, top_k=20, min_p=0.05,
                                  repetition_penalty=1.1)
    omitted = parse_request(ChatCompletionRequest, CHAT).sampling_params(
        8, VOCAB_SIZE, defaults=defaults)
    assert (omitted.temperature, omitted.top_p, omitted.top_k, omitted.min_p,
            omitted.repetition_penalty) == (0.6, 0.9, 20, 0.05, 1.1)
    explicit = parse_request(ChatCompletionRequest, {
        **CHAT, "temperature": 0, "top_p": 1, "top_k": -1, "min_p": 0,
        "repetition_penalty": 1}).sampling_params(8, VOCAB_SIZE, defaults=defaults)
    assert (explicit.temperature, explicit.top_p, explicit.top_k, explicit.min_p,
            explicit.repetition_penalty) == (0.0, 1.0, 0, 0.0, 1.0)
    none = parse_request(ChatCompletionRequest, CHAT).sampling_params(8, VOCAB_SIZE)
    assert (none.temperature, none.top_p, none.top_k) == (1.0, 1.0, 0)  # OpenAI's


def test_output_limit_of_a_request_that_sets_none():
    assert default_max_tokens(GenerationDefaults(), 0) is None
    assert default_max_tokens(GenerationDefaults(max_new_tokens=512), 0) == 512
    assert default_max_tokens(GenerationDefaults(max_new_tokens=512), 64) == 64
    assert default_max_tokens(GenerationDefaults(), 256) == 256
    assert resolve_max_tokens(None, 10, 8192) == 8182
    assert resolve_max_tokens(None, 10, 8192, default_limit=64) == 64
    assert resolve_max_tokens(None, 8180, 8192, default_limit=64) == 12  # the context is less
    assert resolve_max_tokens(100, 10, 8192, default_limit=64) == 100  # the request's own wins
    with pytest.raises(InvalidRequest):
        resolve_max_tokens(9000, 10, 8192, default_limit=64)


def test_values_that_would_overflow_the_sampler_are_greedy_or_refused():
    tiny = parse_request(ChatCompletionRequest, {**CHAT, "temperature": 5e-324, "top_p": 1e-300})
    params = tiny.sampling_params(8, VOCAB_SIZE)
    assert params.temperature == 0.0 and params.top_k == 1 and params.is_greedy
    for extra in ({"repetition_penalty": 5e-324}, {"top_k": 2**70}, {"priority": -2**70},
                  {"stop_token_ids": [2**64]}, {"max_completion_tokens": 2**63}):
        with pytest.raises(InvalidRequest) as error:
            parse_request(ChatCompletionRequest, {**CHAT, **extra})
        assert error.value.param.startswith(next(iter(extra))), error.value.param
    with pytest.raises(InvalidRequest) as error:
        parse_request(CompletionRequest, {**COMPLETION, "prompt": [1, 2**64]})
    assert error.value.param.startswith("prompt")


def test_integral_numbers_are_integers_and_strings_are_not():
    req = parse_request(ChatCompletionRequest, {**CHAT, "n": 2.0, "max_completion_tokens": 5.0})
    assert (req.n, req.max_completion_tokens) == (2, 5) and isinstance(req.n, int)
    for value in (2.5, "2"):
        with pytest.raises(InvalidRequest) as error:
            parse_request(ChatCompletionRequest, {**CHAT, "n": value})
        assert error.value.param == "n"
