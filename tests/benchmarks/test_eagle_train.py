"""The EAGLE-3 training script (benchmarks/eagle_train.py) against the real serving path: a
small head trained in the fixture on SmolLM2's own greedy replies (features from Hugging
Face's forward) drafts in flotilla's engine from the features its forward captures, so the
two must agree position for position for any draft to be kept. Greedy tokens stay those of
the run without drafts; the drafts are kept often (a head trained on these very replies)."""

from __future__ import annotations

import json

import pytest

from benchmarks.eagle_data import greedy_replies, hidden_states, load_target
from benchmarks.eagle_train import TrainOptions, aux_layers, train_head, write_head
from cli.engine import Engine
from services.scheduler.config import SchedulerConfig
from services.worker.config import WorkerConfig
from shared.messages import SamplingParams
from shared.models import resolve_model
from shared.sections.speculative import parse_speculative_config

pytestmark = pytest.mark.slow  # (the fixture trains for about a minute on two cores)
TEXTS = ["Repeat this paragraph word for word: The harbour opens at six. Boats leave from the "
         "north pier in summer and from the south pier in winter. Tickets are sold on board.",
         "Copy this list exactly, one item per line: flour, sugar, eggs, butter, milk, salt."]


def engine(model, spec: str = "") -> Engine:
    config = parse_speculative_config(spec)
    return Engine(SchedulerConfig(speculative_config=config, max_num_seqs=4),
                  WorkerConfig(device="cpu", dtype="float32", kv_cache_memory="128MiB",
                               speculative_config=config), model)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    model = resolve_model("smollm2")
    tokenizer, hf = load_target(model.path)
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                             add_generation_prompt=True, tokenize=True)
               for text in TEXTS]
    prompts = [list(p["input_ids"] if hasattr(p, "keys") else p) for p in prompts]
    replies = greedy_replies(model.path, prompts, 48)
    conversations = [hidden_states(hf, p + r, len(p), aux_layers(30))
                     for p, r in zip(prompts, replies)]
    head = train_head(model.path, conversations, TrainOptions(
        draft_vocab=512, epochs=25, batch_size=1, lr=2e-3, context_tokens=32))
    path = tmp_path_factory.mktemp("eagle3-head")
    write_head(head, path)
    return model, prompts, replies, path


def test_the_trained_head_drafts_what_the_served_model_says(trained):
    model, prompts, replies, path = trained
    head_config = json.loads((path / "config.json").read_text())
    assert head_config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert head_config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 15, 27]
    spec = json.dumps({"method": "eagle3", "model": str(path), "num_speculative_tokens": 4,
                       "adaptive": False, "disable_by_batch_size": 0})
    drafted = engine(model, spec)
    for prompt, reply in zip(prompts, replies):  # one at a time: batch 1
        [completion], _ = drafted.generate([prompt], [SamplingParams(
            temperature=0.0, max_tokens=48)])
        assert completion.output_token_ids == reply
    books = drafted.scheduler.draft_books
    mean_kept = books.num_accepted_drafts / books.num_drafted_steps
    assert mean_kept > 1.5, (books.num_accepted_drafts, books.num_drafted_steps)
