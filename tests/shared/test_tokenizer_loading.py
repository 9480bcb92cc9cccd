"""The tokenizer loaded by its recorded class is AutoTokenizer's, and loads without torch."""

import json
import subprocess
import sys

from structlog.testing import capture_logs

from shared.models import resolve_model
from shared.tokenizer_loading import load_tokenizer, record_path

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Héllo <b>"}]
TEXTS = ["Hello world<|im_end|>", " spaced  out\n\ttabs", "naïve café 東京 🚀", ""]


def _same_tokenizer(ours, theirs) -> None:
    assert type(ours) is type(theirs)
    assert len(ours) == len(theirs) and ours.get_vocab() == theirs.get_vocab()
    assert ours.all_special_ids == theirs.all_special_ids
    assert ours.eos_token_id == theirs.eos_token_id and ours.chat_template == theirs.chat_template
    for text in TEXTS:
        assert ours.encode(text) == theirs.encode(text)
        assert ours.decode(theirs.encode(text)) == theirs.decode(theirs.encode(text))
    assert ours.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True) == \
        theirs.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)


def test_the_recorded_class_loads_what_autotokenizer_loads(tmp_path, tokenizer):
    model_dir = resolve_model("smollm2").path
    with capture_logs() as logs:
        first = load_tokenizer(model_dir, tmp_path)
        second = load_tokenizer(model_dir, tmp_path)
    paths = [entry["path"] for entry in logs if entry["event"] == "tokenizer_loaded"]
    assert paths == ["AutoTokenizer", "recorded class"]
    record = json.loads(record_path(model_dir.resolve(), tmp_path).read_text())
    assert record["class"] == type(tokenizer).__name__
    _same_tokenizer(first, tokenizer)
    _same_tokenizer(second, tokenizer)


def test_a_changed_file_or_a_bad_record_goes_through_autotokenizer(tmp_path, tokenizer):
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    for item in resolve_model("smollm2").path.iterdir():
        if item.suffix != ".safetensors":
            (model_dir / item.name).write_bytes(item.read_bytes())
    load_tokenizer(model_dir, tmp_path / "cache")
    record = record_path(model_dir.resolve(), tmp_path / "cache")
    record.write_text(json.dumps({"module": "transformers.nowhere", "class": "Missing"}))
    with capture_logs() as logs:
        _same_tokenizer(load_tokenizer(model_dir, tmp_path / "cache"), tokenizer)
    assert [e["path"] for e in logs if e["event"] == "tokenizer_loaded"] == ["AutoTokenizer"]
    (model_dir / "tokenizer_config.json").write_text(
        (model_dir / "tokenizer_config.json").read_text() + "\n")
    assert record_path(model_dir.resolve(), tmp_path / "cache") != record


def test_a_recorded_load_imports_no_torch(tmp_path):
    """What the restart saves: AutoTokenizer's config lookup imports torch (seconds)."""
    model_dir = resolve_model("smollm2").path
    load_tokenizer(model_dir, tmp_path)  # records the class
    code = ("import sys; from shared.tokenizer_loading import load_tokenizer; "
            f"load_tokenizer({str(model_dir)!r}, {str(tmp_path)!r}); "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True)
    assert out.stdout.strip().splitlines()[-1] == "False"
