"""Speculative decoding through the whole stack (``--speculative-config`` on the
scheduler, the worker overlapping steps as on a GPU): copy-heavy chats give exactly the
text of Hugging Face greedy decoding, drafts were sent and kept, and /metrics counts them."""

from __future__ import annotations

import json

import openai
import pytest

from tests.integration.conftest import start_stack, wait_for
from tests.integration.test_correctness import hf_greedy
from tests.integration.test_kvstore_tiers import metric

pytestmark = pytest.mark.integration
NGRAM = json.dumps({"method": "ngram", "num_speculative_tokens": 4})
CHATS = [
    "Repeat exactly, twice: red, orange, yellow, green, blue, indigo, violet.",
    "Copy this code, renaming add to plus:\ndef add(a, b):\n    return a + b\n",
]


@pytest.fixture(scope="module")
def spec_stack(tmp_path_factory):
    stack = start_stack(tmp_path_factory.mktemp("spec-logs"), kvstore=False, service_args={
        "scheduler": ["--speculative-config", NGRAM],
        "worker": ["--kv-cache-memory", "256MiB", "--overlap-steps", "on"]})
    yield stack
    stack.stop()


def test_greedy_chats_equal_the_reference_and_drafts_are_counted(
        spec_stack, model_name, hf_model, hf_tokenizer):
    client = openai.OpenAI(base_url=spec_stack.base_url + "/v1", api_key="x", max_retries=0)
    for text in CHATS:
        messages = [{"role": "user", "content": text}]
        response = client.chat.completions.create(model=model_name, messages=messages,
                                                  temperature=0, max_tokens=32)
        _, ref_ids = hf_greedy(hf_model, hf_tokenizer, messages, 32)
        assert response.choices[0].message.content == hf_tokenizer.decode(
            ref_ids, skip_special_tokens=True), text
    url = spec_stack.base_url + "/metrics"
    assert wait_for(lambda: metric(url, "flotilla_spec_decode_accepted_tokens_total") > 0)
    assert metric(url, "flotilla_spec_decode_draft_tokens_total") >= \
        metric(url, "flotilla_spec_decode_accepted_tokens_total")
    # kept drafts by position add up to the kept drafts; the first position is kept no more
    # often than there were verify passes
    assert wait_for(lambda: metric(url, "flotilla_spec_decode_accepted_tokens_per_pos_total")
                    == metric(url, "flotilla_spec_decode_accepted_tokens_total"))
    assert 0 < metric(url, "flotilla_spec_decode_accepted_tokens_per_pos_total",
                      'position="0"') <= metric(url, "flotilla_spec_decode_drafts_total")


@pytest.mark.slow  # (make test-slow: a stack of its own, half a minute or more)
def test_a_draft_model_through_the_stack_gives_the_reference_text(
        tmp_path, model_name, hf_model, hf_tokenizer):
    """``method: "draft_model"``: the worker loads the draft (here the served model itself)
    from the --speculative-config flotilla serve gives it too, fills each verify step's draft
    slots, and the text is Hugging Face's greedy text with nearly every draft kept."""
    spec = json.dumps({"method": "draft_model", "model": "smollm2", "num_speculative_tokens": 4})
    accepted, drafted = _greedy_chat_with_drafts(tmp_path, spec, CHATS[0], model_name,
                                                 hf_model, hf_tokenizer)
    assert 0 < accepted and accepted >= 0.9 * drafted


@pytest.mark.slow  # (a stack of its own: ~40 s on two cores)
def test_an_eagle3_head_through_the_stack_gives_the_reference_text(
        tmp_path, model_name, hf_model, hf_tokenizer):
    """``method: "eagle3"``: the worker loads the head (random weights of SmolLM2's shapes, a
    4,096-token draft vocabulary), captures the served model's hidden states, fills each
    verify step's draft slots from them; the text is Hugging Face's."""
    from shared.models import _write_dummy_head

    head = tmp_path / "head"
    head.mkdir()
    _write_dummy_head({"architectures": ["LlamaForCausalLMEagle3"], "hidden_size": 576,
                       "intermediate_size": 1536, "num_attention_heads": 9,
                       "num_key_value_heads": 3, "head_dim": 64, "num_hidden_layers": 1,
                       "vocab_size": 49152, "draft_vocab_size": 4096, "rms_norm_eps": 1e-5,
                       "rope_theta": 100000.0, "max_position_embeddings": 8192}, head)
    spec = json.dumps({"method": "eagle3", "model": str(head), "num_speculative_tokens": 4})
    _greedy_chat_with_drafts(tmp_path / "logs", spec, CHATS[1], model_name, hf_model,
                             hf_tokenizer)


def _greedy_chat_with_drafts(log_dir, spec: str, chat: str, model_name, hf_model,
                             hf_tokenizer) -> tuple[float, float]:
    """A stack whose scheduler and worker (overlapping steps, as on a GPU) take ``spec``
    answers ``chat`` with Hugging Face's greedy text, and drafts were made -> (draft tokens
    accepted, draft tokens proposed)."""
    stack = start_stack(log_dir, kvstore=False, service_args={
        "scheduler": ["--speculative-config", spec],
        "worker": ["--kv-cache-memory", "256MiB", "--speculative-config", spec,
                   "--overlap-steps", "on"]})
    try:
        client = openai.OpenAI(base_url=stack.base_url + "/v1", api_key="x", max_retries=0)
        messages = [{"role": "user", "content": chat}]
        response = client.chat.completions.create(model=model_name, messages=messages,
                                                  temperature=0, max_tokens=32)
        _, ref_ids = hf_greedy(hf_model, hf_tokenizer, messages, 32)
        assert response.choices[0].message.content == hf_tokenizer.decode(
            ref_ids, skip_special_tokens=True)
        url = stack.base_url + "/metrics"
        assert wait_for(lambda: metric(url, "flotilla_spec_decode_draft_tokens_total") > 0)
        return (metric(url, "flotilla_spec_decode_accepted_tokens_total"),
                metric(url, "flotilla_spec_decode_draft_tokens_total"))
    finally:
        stack.stop()
