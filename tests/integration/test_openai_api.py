"""The OpenAI surface through the real stack, with the official openai client."""

from __future__ import annotations

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.integration

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def client(stack):
    return openai.OpenAI(base_url=stack.base_url + "/v1", api_key="unused", max_retries=0)


def test_chat_answers_paris(client, model_name):
    response = client.chat.completions.create(model=model_name, messages=QUESTION, temperature=0,
                                              max_tokens=32)
    choice = response.choices[0]
    assert "Paris" in choice.message.content
    assert choice.message.role == "assistant"
    assert choice.finish_reason == "stop"
    assert response.usage.prompt_tokens > 0
    assert response.usage.total_tokens == response.usage.prompt_tokens + response.usage.completion_tokens


def test_streaming_yields_the_same_text_as_non_streaming(client, model_name):
    full = client.chat.completions.create(model=model_name, messages=QUESTION, temperature=0,
                                          max_tokens=40)
    chunks = list(client.chat.completions.create(
        model=model_name, messages=QUESTION, temperature=0, max_tokens=40, stream=True,
        stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [full.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def test_completions_length_and_usage(client, model_name, hf_tokenizer):
    response = client.completions.create(model=model_name, prompt="The sky is", max_tokens=12,
                                         temperature=0)
    choice = response.choices[0]
    assert choice.finish_reason == "length"
    assert response.usage.completion_tokens == 12
    assert response.usage.prompt_tokens == len(hf_tokenizer("The sky is")["input_ids"])
    assert len(choice.text) > 0


def test_completions_streaming_matches(client, model_name):
    full = client.completions.create(model=model_name, prompt="Once upon a time", max_tokens=20,
                                     temperature=0)
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=model_name, prompt="Once upon a time", max_tokens=20, temperature=0, stream=True))
    assert streamed == full.choices[0].text


def test_stop_string_cuts_the_text(client, model_name):
    full = client.completions.create(model=model_name, prompt="1, 2, 3, 4,", max_tokens=20,
                                     temperature=0).choices[0].text
    assert " 6" in full, full
    stopped = client.completions.create(model=model_name, prompt="1, 2, 3, 4,", max_tokens=20,
                                        temperature=0, stop=[" 6"])
    assert stopped.choices[0].text == full[:full.index(" 6")]
    assert stopped.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=model_name, prompt="1, 2, 3, 4,", max_tokens=20, temperature=0, stop=[" 6"],
        stream=True))
    assert streamed == stopped.choices[0].text


def test_seeded_sampling_is_reproducible(client, model_name):
    def sample():
        return client.completions.create(model=model_name, prompt="My favourite colour is",
                                         max_tokens=16, temperature=1.0, top_p=0.9, seed=1234)
    assert sample().choices[0].text == sample().choices[0].text


def test_models_lists_the_served_model(client, model_name, stack):
    assert [m.id for m in client.models.list().data] == [model_name]


def test_tokenize_and_detokenize(stack, model_name, hf_tokenizer):
    tokens = httpx.post(stack.base_url + "/tokenize",
                        json={"model": model_name, "prompt": "Hello world"}).json()
    assert tokens["tokens"] == hf_tokenizer("Hello world")["input_ids"]
    chat = httpx.post(stack.base_url + "/tokenize", json={"messages": QUESTION}).json()
    assert chat["tokens"] == hf_tokenizer.apply_chat_template(
        QUESTION, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    text = httpx.post(stack.base_url + "/detokenize", json={"tokens": tokens["tokens"]}).json()
    assert text == {"prompt": "Hello world"}


def test_health_reports_every_service(stack):
    health = httpx.get(stack.base_url + "/health").json()
    assert health["status"] == "ok"
    assert set(health["services"]) == {"gateway", "tokenizer", "scheduler", "worker"}


def test_metrics_are_exposed(stack, client, model_name):
    client.completions.create(model=model_name, prompt="Hi", max_tokens=2, temperature=0)
    text = httpx.get(stack.base_url + "/metrics").text
    for name in ("flotilla_requests_total", "flotilla_time_to_first_token_seconds_bucket",
                 "flotilla_inter_token_latency_seconds_bucket", "flotilla_num_requests_running",
                 "flotilla_kv_cache_blocks_used", "flotilla_num_requests_waiting"):
        assert name in text, name
    # vLLM's names too, labelled with the served model (what llm-d and dashboards read)
    vllm = {sample.name: sample for family in text_string_to_metric_families(text)
            for sample in family.samples if sample.name.startswith("vllm:")}
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:kv_cache_usage_perc", "vllm:prompt_tokens_total",
                 "vllm:generation_tokens_total", "vllm:request_success_total",
                 "vllm:time_to_first_token_seconds_bucket", "vllm:e2e_request_latency_seconds_sum",
                 "vllm:request_queue_time_seconds_count", "vllm:prefix_cache_queries_total",
                 "vllm:num_preemptions_total"):
        assert vllm[name].labels["model_name"] == model_name, name
    assert 0 <= vllm["vllm:kv_cache_usage_perc"].value <= 1


def test_streamed_chunks_are_measured(stack, client, model_name):
    """Each streamed chunk's size and its lag behind the scheduler's publish are in
    /metrics (issue 27: where a stream's gaps come from)."""
    def counts() -> dict[str, float]:
        text = httpx.get(stack.base_url + "/metrics").text
        return {family.name: next(s.value for s in family.samples if s.name.endswith("_count"))
                for family in text_string_to_metric_families(text)
                if family.name in ("flotilla_stream_tokens_per_chunk",
                                   "flotilla_output_delivery_seconds")}
    before = counts()
    chunks = list(client.completions.create(model=model_name, prompt="Count to ten:",
                                            max_tokens=8, temperature=0, stream=True))
    after = counts()
    num_with_text = sum(1 for c in chunks if c.choices and c.choices[0].text)
    for name in ("flotilla_stream_tokens_per_chunk", "flotilla_output_delivery_seconds"):
        assert after[name] - before[name] >= num_with_text > 0, name
