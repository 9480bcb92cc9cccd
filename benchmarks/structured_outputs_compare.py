"""Compare grammar libraries for structured outputs on the default model's tokenizer.

    .venv/bin/python -m benchmarks.structured_outputs_compare [--walks 5] [--out result.json]

For xgrammar, llguidance and outlines-core, on SmolLM2's tokenizer (vocab 49,152, eos id 2),
each configured for single-space JSON separators (", " and ": ", nothing else between tokens):

- one-off setup: the library's tokenizer/vocabulary object;
- per schema of a feature suite: cold compile (no cache) and cached compile (what a second
  request with the same schema pays before its first mask);
- per-token mask time, walking each case's first valid instance token by token;
- correctness: every valid instance (serialized with ", " / ": ") must be accepted and end in
  an accepting state, every invalid instance rejected; and ``--walks`` random walks per schema
  (random logits, +4 on quote/closing-bracket tokens and EOS so strings end, mask applied,
  up to 400 tokens) whose finished outputs must pass
  ``jsonschema.validate`` (soundness of the grammar, not just of the hand-picked examples);
- how an invalid schema is reported (without a vocabulary where the library allows it).

Results and the choice: docs/structured-outputs.md.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path
from typing import Any


import jsonschema
import torch
from transformers import AutoTokenizer

from shared.models import resolve_model

VOCAB_SIZE = 49152
EOS_ID = 2
MAX_WALK_TOKENS = 400

# name -> (schema, valid instances, invalid instances)
CASES: dict[str, tuple[dict, list[Any], list[Any]]] = {
    "nested_objects": (
        {"type": "object", "properties": {
            "user": {"type": "object", "properties": {
                "name": {"type": "string"},
                "address": {"type": "object", "properties": {"city": {"type": "string"},
                                                             "zip": {"type": "string"}},
                            "required": ["city"]}},
                "required": ["name", "address"]}},
         "required": ["user"]},
        [{"user": {"name": "Ann", "address": {"city": "Oslo", "zip": "0150"}}},
         {"user": {"name": "Bo", "address": {"city": "Rome"}}}],
        [{"user": {"name": "Ann"}}, {"user": {"name": 3, "address": {"city": "x"}}}]),
    "array_min_max_items": (
        {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string"},
                                                   "minItems": 2, "maxItems": 3}},
         "required": ["tags"]},
        [{"tags": ["a", "b"]}, {"tags": ["a", "b", "c"]}],
        [{"tags": ["a"]}, {"tags": ["a", "b", "c", "d"]}, {"tags": [1, 2]}]),
    "enum": (
        {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                          "size": {"enum": [1, 2, None]}},
         "required": ["color", "size"]},
        [{"color": "red", "size": 1}, {"color": "blue", "size": None}],
        [{"color": "pink", "size": 1}, {"color": "red", "size": 3}]),
    "number_bounds": (
        {"type": "object", "properties": {
            "age": {"type": "integer", "minimum": 18, "maximum": 99},
            "score": {"type": "number", "minimum": 0, "maximum": 1},
            "temp": {"type": "number", "exclusiveMinimum": -10.5, "exclusiveMaximum": 40}},
         "required": ["age", "score", "temp"]},
        [{"age": 18, "score": 0.5, "temp": -3.25}, {"age": 99, "score": 1, "temp": 39.9}],
        [{"age": 17, "score": 0.5, "temp": 0}, {"age": 100, "score": 0.5, "temp": 0},
         {"age": 20, "score": 1.5, "temp": 0}, {"age": 20, "score": 0.5, "temp": 40},
         {"age": 20.5, "score": 0.5, "temp": 0}]),
    "string_pattern": (
        {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}},
         "required": ["code"]},
        [{"code": "ABC-12"}],
        [{"code": "abc-12"}, {"code": "ABCD-12"}]),
    "string_length": (
        {"type": "object", "properties": {"name": {"type": "string", "minLength": 2,
                                                   "maxLength": 5}},
         "required": ["name"]},
        [{"name": "ab"}, {"name": "abcde"}],
        [{"name": "a"}, {"name": "abcdef"}]),
    "string_formats": (
        {"type": "object", "properties": {
            "email": {"type": "string", "format": "email"},
            "day": {"type": "string", "format": "date"},
            "when": {"type": "string", "format": "date-time"},
            "id": {"type": "string", "format": "uuid"}},
         "required": ["email", "day", "when", "id"]},
        [{"email": "a.b@example.com", "day": "2026-11-22", "when": "2026-11-22T10:20:30Z",
          "id": "123e4567-e89b-12d3-a456-426614174000"}],
        [{"email": "not-an-email", "day": "2026-11-22", "when": "2026-11-22T10:20:30Z",
          "id": "123e4567-e89b-12d3-a456-426614174000"},
         {"email": "a@b.co", "day": "22/11/2026", "when": "2026-11-22T10:20:30Z",
          "id": "123e4567-e89b-12d3-a456-426614174000"}]),
    "required_optional": (
        {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"},
                                          "c": {"type": "boolean"}},
         "required": ["a"]},
        [{"a": 1}, {"a": 1, "b": "x"}, {"a": 1, "c": True}, {"a": 1, "b": "x", "c": False}],
        [{"b": "x"}, {}]),
    "additional_properties_false": (
        {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
         "additionalProperties": False},
        [{"a": 1}],
        [{"a": 1, "z": 2}]),
    "ref_defs": (
        {"$defs": {"point": {"type": "object", "properties": {"x": {"type": "number"},
                                                             "y": {"type": "number"}},
                             "required": ["x", "y"], "additionalProperties": False}},
         "type": "object", "properties": {"start": {"$ref": "#/$defs/point"},
                                          "end": {"$ref": "#/$defs/point"}},
         "required": ["start", "end"]},
        [{"start": {"x": 0, "y": 1.5}, "end": {"x": -2, "y": 3}}],
        [{"start": {"x": 0}, "end": {"x": 1, "y": 1}}]),
    "recursive_ref": (
        {"$defs": {"node": {"type": "object", "properties": {
            "value": {"type": "integer"},
            "children": {"type": "array", "items": {"$ref": "#/$defs/node"}}},
            "required": ["value"], "additionalProperties": False}},
         "$ref": "#/$defs/node"},
        [{"value": 1, "children": [{"value": 2}, {"value": 3, "children": [{"value": 4}]}]}],
        [{"value": 1, "children": [{"children": []}]}]),
    "any_of": (
        {"type": "object", "properties": {"id": {"anyOf": [{"type": "integer"},
                                                           {"type": "string", "maxLength": 4}]}},
         "required": ["id"]},
        [{"id": 5}, {"id": "ab"}],
        [{"id": True}, {"id": 1.5}, {"id": "abcdef"}]),
}

# keywords outside the suite: does the library enforce them, reject the schema, or ignore them?
# Checked like the invalid schemas (no vocabulary); "(accepted)" may mean silently ignored.
UNSUPPORTED_PROBES: dict[str, dict] = {
    "uniqueItems": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True},
    "not": {"not": {"type": "string"}},
    "if/then": {"type": "object", "if": {"properties": {"a": {"const": 1}}},
                "then": {"required": ["b"]}},
    "contains": {"type": "array", "contains": {"type": "integer"}},
    "dependentRequired": {"type": "object", "properties": {"a": {}, "b": {}},
                          "dependentRequired": {"a": ["b"]}},
    "external $ref": {"$ref": "https://example.com/s.json"},
    "minProperties": {"type": "object", "minProperties": 2},
}

INVALID_SCHEMAS: dict[str, str] = {
    "unknown type": '{"type": "foo"}',
    "bad pattern": '{"type": "string", "pattern": "[a-"}',
    "dangling $ref": '{"$ref": "#/$defs/missing"}',
    "not an object": '[1, 2]',
    "malformed JSON": '{"type": ',
    "minimum not a number": '{"type": "integer", "minimum": "x"}',
    "unknown format": '{"type": "string", "format": "no-such-format"}',
}


# ----------------------------------------------------------------- adapters
class XGrammar:
    name = "xgrammar"

    def __init__(self, tokenizer) -> None:
        import xgrammar as xgr
        self.xgr = xgr
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=VOCAB_SIZE,
                                                       stop_token_ids=[EOS_ID])
        self.cached = xgr.GrammarCompiler(self.info, max_threads=2, cache_enabled=True)

    def compile(self, schema: str, cold: bool):
        compiler = (self.xgr.GrammarCompiler(self.info, max_threads=2, cache_enabled=False)
                    if cold else self.cached)
        return compiler.compile_json_schema(schema, any_whitespace=False)

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, matcher, bitmask: torch.Tensor) -> None:
        matcher.fill_next_token_bitmask(bitmask, 0)

    def accept(self, matcher, token_id: int) -> bool:
        return matcher.accept_token(token_id)

    def done(self, matcher) -> bool:
        return matcher.is_terminated()

    def can_end(self, matcher) -> bool:
        return matcher.accept_token(EOS_ID) and matcher.is_terminated()

    def check_schema(self, schema: str) -> str | None:
        try:
            self.xgr.Grammar.from_json_schema(schema, any_whitespace=False)
        except Exception as exc:  # noqa: BLE001
            return f"{type(exc).__name__}: {str(exc).strip().splitlines()[0]}"
        return None


class LLGuidance:
    """The cache keeps one matcher per schema and hands out deep copies (~20 us; building
    an LLMatcher is ~1 ms, and copies share the lexer states it has built so far)."""
    name = "llguidance"
    OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

    def __init__(self, tokenizer) -> None:
        import llguidance
        import llguidance.hf
        self.llg = llguidance
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=VOCAB_SIZE,
                                                      eos_token=[EOS_ID])
        self.templates: dict[str, Any] = {}

    def compile(self, schema: str, cold: bool):
        if cold or schema not in self.templates:
            grammar = self.llg.LLMatcher.grammar_from_json_schema(schema, overrides=self.OPTIONS)
            matcher = self.llg.LLMatcher(self.tokenizer, grammar, log_level=0)
            if matcher.is_error():
                raise ValueError(matcher.get_error())
            self.templates[schema] = matcher
        return self.templates[schema]

    def matcher(self, template):
        return template.deep_copy()

    def fill(self, matcher, bitmask: torch.Tensor) -> None:
        matcher.unsafe_compute_mask_ptr(bitmask.data_ptr(), bitmask.numel() * 4)

    def accept(self, matcher, token_id: int) -> bool:
        return matcher.consume_token(token_id) and not matcher.is_error()

    def done(self, matcher) -> bool:
        return matcher.is_stopped()

    def can_end(self, matcher) -> bool:
        return matcher.is_accepting()

    def check_schema(self, schema: str) -> str | None:
        try:
            grammar = self.llg.LLMatcher.grammar_from_json_schema(schema, overrides=self.OPTIONS)
        except Exception as exc:  # noqa: BLE001
            return f"{type(exc).__name__}: {str(exc).strip().splitlines()[0]}"
        error = self.llg.LLMatcher.validate_grammar(grammar, None)
        return error.strip().splitlines()[0] if error else None


class OutlinesCore:
    name = "outlines-core"

    def __init__(self, tokenizer) -> None:
        import outlines_core
        self.oc = outlines_core
        self.vocabulary = outlines_core.Vocabulary(EOS_ID, _token_bytes(tokenizer))
        self.indexes: dict[str, Any] = {}

    def _regex(self, schema: str) -> str:
        return self.oc.json_schema.build_regex_from_schema(schema, " ?")

    def compile(self, schema: str, cold: bool):
        if cold or schema not in self.indexes:
            self.indexes[schema] = self.oc.Index(self._regex(schema), self.vocabulary)
        return self.indexes[schema]

    def matcher(self, index):
        return self.oc.Guide(index)

    def fill(self, matcher, bitmask: torch.Tensor) -> None:
        matcher.write_mask_into(bitmask.data_ptr(), bitmask.numel(), 4)

    def accept(self, matcher, token_id: int) -> bool:
        if token_id not in matcher.get_tokens():
            return False
        matcher.advance(token_id)
        return True

    def done(self, matcher) -> bool:
        return matcher.is_finished()

    def can_end(self, matcher) -> bool:
        return EOS_ID in matcher.get_tokens()

    def check_schema(self, schema: str) -> str | None:
        try:
            self._regex(schema)
        except Exception as exc:  # noqa: BLE001
            return f"{type(exc).__name__}: {str(exc).strip().splitlines()[0]}"
        return None


def _token_bytes(tokenizer) -> dict[bytes, list[int]]:
    """Byte-level BPE pieces -> their bytes (GPT-2's byte-to-unicode table inverted)."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    codes, extra = list(printable), 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            codes.append(256 + extra)
            extra += 1
    to_byte = {chr(c): b for b, c in zip(printable, codes)}
    special = set(tokenizer.all_special_ids) | {
        i for i, t in tokenizer.added_tokens_decoder.items() if t.special}
    vocab: dict[bytes, list[int]] = {}
    for piece, token_id in tokenizer.get_vocab().items():
        if token_id in special or token_id >= VOCAB_SIZE:
            continue
        vocab.setdefault(bytes(to_byte[c] for c in piece), []).append(token_id)
    return vocab


# ----------------------------------------------------------------- measurements
def _allowed(bitmask: torch.Tensor) -> torch.Tensor:
    bits = (bitmask[0, :, None] >> torch.arange(32, dtype=torch.int32)) & 1
    return bits.reshape(-1)[:VOCAB_SIZE].bool()


def _accepts(lib, compiled, token_ids: list[int]) -> bool:
    matcher = lib.matcher(compiled)
    for token_id in token_ids:
        if not lib.accept(matcher, token_id):
            return False
    return lib.can_end(matcher)


def _closing_bias(tokenizer) -> torch.Tensor:
    """+4 on the stop token and on tokens holding a quote or a closing bracket, so that random
    walks finish their strings and containers in a few hundred tokens."""
    bias = torch.zeros(VOCAB_SIZE)
    for token_id in range(VOCAB_SIZE):
        if any(c in tokenizer.decode([token_id]) for c in '"}]'):
            bias[token_id] = 4.0
    bias[EOS_ID] = 4.0
    return bias


def _walk(lib, compiled, rng: torch.Generator, bitmask: torch.Tensor, tokenizer,
          bias: torch.Tensor) -> str | None:
    """Random logits under the mask until a stop token; None if MAX_WALK_TOKENS run out."""
    matcher, token_ids = lib.matcher(compiled), []
    for _ in range(MAX_WALK_TOKENS):
        lib.fill(matcher, bitmask)
        logits = torch.randn(VOCAB_SIZE, generator=rng) + bias
        logits[~_allowed(bitmask)] = -float("inf")
        token_id = int(torch.multinomial(logits.softmax(-1), 1, generator=rng))
        if token_id == EOS_ID:
            return tokenizer.decode(token_ids)
        if not lib.accept(matcher, token_id):
            return "<rejected its own masked token>"
        token_ids.append(token_id)
    return None


def measure(lib_cls, tokenizer, walks: int, bias: torch.Tensor) -> dict:
    started = time.perf_counter()
    lib = lib_cls(tokenizer)
    result: dict[str, Any] = {"setup_s": time.perf_counter() - started, "cases": {},
                              "invalid_schemas": {}}
    mask_times: list[float] = []
    bitmask = torch.zeros((1, (VOCAB_SIZE + 31) // 32), dtype=torch.int32)
    for name, (schema, valid, invalid) in CASES.items():
        text = json.dumps(schema)
        row: dict[str, Any] = {}
        try:
            started = time.perf_counter()
            lib.compile(text, cold=True)
            row["cold_ms"] = (time.perf_counter() - started) * 1e3
            lib.compile(text, cold=False)  # fills the cache
            started = time.perf_counter()
            compiled = lib.compile(text, cold=False)
            matcher = lib.matcher(compiled)
            row["cached_ms"] = (time.perf_counter() - started) * 1e3
        except Exception as exc:  # noqa: BLE001
            row["error"] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:120]}"
            result["cases"][name] = row
            continue
        for token_id in tokenizer.encode(json.dumps(valid[0])):
            started = time.perf_counter()
            lib.fill(matcher, bitmask)
            mask_times.append(time.perf_counter() - started)
            lib.accept(matcher, token_id)
        row["valid_ok"] = sum(_accepts(lib, compiled, tokenizer.encode(json.dumps(v)))
                              for v in valid)
        row["invalid_rejected"] = sum(not _accepts(lib, compiled, tokenizer.encode(json.dumps(v)))
                                      for v in invalid)
        row["num_valid"], row["num_invalid"] = len(valid), len(invalid)
        rng = torch.Generator().manual_seed(0)
        outcomes = {"valid": 0, "invalid": 0, "unfinished": 0}
        for _ in range(walks):
            out = _walk(lib, compiled, rng, bitmask, tokenizer, bias)
            if out is None:
                outcomes["unfinished"] += 1
                continue
            try:
                jsonschema.validate(json.loads(out), schema)
                outcomes["valid"] += 1
            except (ValueError, jsonschema.ValidationError):
                outcomes["invalid"] += 1
                row.setdefault("bad_walk", out[:160])
        row["walks"] = outcomes
        result["cases"][name] = row
    for name, text in INVALID_SCHEMAS.items():
        result["invalid_schemas"][name] = lib.check_schema(text) or "(accepted)"
    result["unsupported_probes"] = {name: lib.check_schema(json.dumps(schema)) or "(accepted)"
                                    for name, schema in UNSUPPORTED_PROBES.items()}
    mask_us = sorted(t * 1e6 for t in mask_times)
    result["mask_us"] = {"n": len(mask_us), "mean": statistics.fmean(mask_us),
                         "p50": mask_us[len(mask_us) // 2],
                         "p99": mask_us[int(len(mask_us) * 0.99)], "max": mask_us[-1]}
    return result


def report(results: dict[str, dict]) -> None:
    names = list(results)
    print(f"{'':32}" + "".join(f"{n:>26}" for n in names))
    print(f"{'setup (tokenizer/vocab) s':32}"
          + "".join(f"{results[n]['setup_s']:>26.2f}" for n in names))
    for key in ("mean", "p50", "p99", "max"):
        print(f"{'mask us ' + key:32}" + "".join(f"{results[n]['mask_us'][key]:>26.1f}"
                                                 for n in names))
    print("\nper schema: cold ms / cached ms | valid ok | invalid rejected | walks v/i/unfinished")
    for case in CASES:
        cells = []
        for n in names:
            row = results[n]["cases"][case]
            if "error" in row:
                cells.append("ERROR " + row["error"][:60])
                continue
            w = row["walks"]
            cells.append(f"{row['cold_ms']:.1f}/{row['cached_ms']:.2f} | "
                         f"{row['valid_ok']}/{row['num_valid']} | "
                         f"{row['invalid_rejected']}/{row['num_invalid']} | "
                         f"{w['valid']}/{w['invalid']}/{w['unfinished']}")
        print(f"  {case}")
        for n, cell in zip(names, cells):
            print(f"    {n:14} {cell}")
            bad = results[n]["cases"][case].get("bad_walk")
            if bad:
                print(f"    {'':14} invalid walk: {bad!r}")
    print("\ninvalid schemas (checked without a vocabulary where possible)")
    for case in INVALID_SCHEMAS:
        print(f"  {case}")
        for n in names:
            print(f"    {n:14} {results[n]['invalid_schemas'][case][:110]}")
    print("\nkeywords outside the suite: rejected, or accepted (enforced or silently ignored?)")
    for case in UNSUPPORTED_PROBES:
        print(f"  {case}")
        for n in names:
            print(f"    {n:14} {results[n]['unsupported_probes'][case][:110]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--walks", type=int, default=5, help="random walks per schema")
    parser.add_argument("--libs", default="xgrammar,llguidance,outlines-core")
    parser.add_argument("--out", type=Path, default=None, help="write the result JSON here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    tokenizer = AutoTokenizer.from_pretrained(resolve_model("smollm2").path)
    libs = {cls.name: cls for cls in (XGrammar, LLGuidance, OutlinesCore)}
    bias = _closing_bias(tokenizer)
    results = {name: measure(libs[name], tokenizer, args.walks, bias)
               for name in args.libs.split(",")}
    report(results)
    if args.out:
        args.out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
