"""One sequence of a request as the client sees it: its text, token count, finish reason,
logprobs and (chat) tool calls, built up delta by delta.

``ChatChoice`` and ``CompletionChoice`` give the same three things in their endpoint's
shapes: ``on_delta`` (streaming choice entries for one delta), ``final`` (the choice of a
full response) and the totals the response needs. Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Callable

from services.gateway.streams import Delta, TokenLogprob, TokenText
from services.gateway.tool_calls import ToolCallParser, ToolPlan, finish_reason as tool_finish


class _Choice:
    def __init__(self, index: int, num_logprobs: int | None) -> None:
        self.index = index
        self.num_logprobs = num_logprobs  # None: the client did not ask
        self.text_parts: list[str] = []
        self.logprobs: list[TokenLogprob] = []
        self.num_tokens = 0
        self.engine_finish_reason: str | None = None

    def record(self, delta: Delta) -> None:
        self.text_parts.append(delta.text)
        self.logprobs.extend(delta.logprobs)
        self.num_tokens += delta.num_new_tokens
        if delta.finish_reason is not None:
            self.engine_finish_reason = delta.finish_reason

    @property
    def text(self) -> str:
        return "".join(self.text_parts)

    @property
    def cumulative_logprob(self) -> float:
        return sum(entry.chosen.logprob for entry in self.logprobs)


def _token_entry(token: TokenText) -> dict:
    return {"token": token.token, "logprob": token.logprob, "bytes": list(token.token_bytes)}


def chat_logprobs(entries: list[TokenLogprob] | tuple[TokenLogprob, ...]) -> dict:
    return {"content": [{**_token_entry(e.chosen), "top_logprobs": [_token_entry(t) for t in e.top]}
                        for e in entries], "refusal": None}


class ChatChoice(_Choice):
    def __init__(self, index: int, num_logprobs: int | None, tool_plan: ToolPlan | None,
                 make_call_id: Callable[[], str]) -> None:
        super().__init__(index, num_logprobs)
        self.tool_plan = tool_plan
        self.parser = ToolCallParser(tool_plan, make_call_id) \
            if tool_plan is not None and tool_plan.mode != "none" else None

    def first_entry(self) -> dict:
        return {"index": self.index, "delta": {"role": "assistant", "content": ""},
                "logprobs": None, "finish_reason": None}

    def on_delta(self, delta: Delta) -> list[dict]:
        self.record(delta)
        # a step's tokens make a chunk even when their text is empty (held back, or ids
        # that decode to nothing): clients time chunks as tokens (docs/openai-api.md)
        fragments = self.parser.feed(delta.text) if self.parser else \
            ([{"content": delta.text}] if delta.text or delta.num_new_tokens else [])
        if delta.finish_reason is not None and self.parser:
            fragments += self.parser.finish()
        logprobs = chat_logprobs(delta.logprobs) \
            if self.num_logprobs is not None and delta.logprobs else None
        if logprobs is not None and not fragments:
            fragments = [{}]
        entries = [{"index": self.index, "delta": fragment, "logprobs": None, "finish_reason": None}
                   for fragment in fragments]
        if entries:
            entries[0]["logprobs"] = logprobs
        if delta.finish_reason is not None:
            entries.append({"index": self.index, "delta": {}, "logprobs": None,
                            "finish_reason": self.finish_reason})
        return entries

    @property
    def finish_reason(self) -> str | None:
        if self.parser is None or self.engine_finish_reason is None:
            return self.engine_finish_reason
        return tool_finish(self.tool_plan, self.parser, self.engine_finish_reason)

    def final(self) -> dict:
        message: dict = {"role": "assistant", "content": self.text}
        if self.parser is not None:
            self.parser.feed(self.text)
            self.parser.finish()
            message["content"] = self.parser.content
            if self.parser.has_tool_calls:
                message["tool_calls"] = self.parser.tool_calls
        return {"index": self.index, "message": message,
                "logprobs": chat_logprobs(self.logprobs) if self.num_logprobs is not None else None,
                "finish_reason": self.finish_reason}


class CompletionChoice(_Choice):
    """``echo_text``/``echo_logprobs``: the prompt, shown before the completion when echo is on."""

    def __init__(self, index: int, num_logprobs: int | None, echo_text: str | None = None) -> None:
        super().__init__(index, num_logprobs)
        self.echo_text = echo_text
        self._offset = 0  # characters before the next token, for text_offset
        self._first_prompt_token = ""

    def _set_prompt_logprobs(self, prompt_logprobs: list[TokenLogprob | None]) -> None:
        """The first prompt token's text is what the others leave of the prompt."""
        rest = "".join(e.chosen.token for e in prompt_logprobs if e is not None)
        prompt = self.echo_text or ""
        self._first_prompt_token = prompt[:len(prompt) - len(rest)] if prompt.endswith(rest) else ""

    def first_entry(self, prompt_logprobs: list[TokenLogprob | None] | None) -> dict | None:
        """The echoed prompt as the first streamed entry (None without echo)."""
        if self.echo_text is None:
            return None
        self._set_prompt_logprobs(prompt_logprobs or [])
        return self._entry(self.echo_text, list(prompt_logprobs or []), None)

    def on_delta(self, delta: Delta) -> list[dict]:
        self.record(delta)
        if not delta.text and not delta.num_new_tokens and delta.finish_reason is None \
                and not delta.logprobs:
            return []  # (a step's tokens make a chunk even when their text is empty)
        return [self._entry(delta.text, list(delta.logprobs), delta.finish_reason)]

    @property
    def finish_reason(self) -> str | None:
        return self.engine_finish_reason

    def final(self, prompt_logprobs: list[TokenLogprob | None] | None) -> dict:
        self._offset = 0
        prefix = self.echo_text or ""
        entries: list[TokenLogprob | None] = list(prompt_logprobs or []) if self.echo_text else []
        self._set_prompt_logprobs(entries)
        return {"index": self.index, "text": prefix + self.text,
                "logprobs": self._logprobs(entries + self.logprobs)
                if self.num_logprobs is not None else None,
                "finish_reason": self.finish_reason}

    def _entry(self, text: str, logprobs: list[TokenLogprob | None],
               finish_reason: str | None) -> dict:
        return {"index": self.index, "text": text,
                "logprobs": self._logprobs(logprobs) if self.num_logprobs is not None else None,
                "finish_reason": finish_reason}

    def _logprobs(self, entries: list[TokenLogprob | None]) -> dict:
        """The legacy shape; a prompt's first token has no logprob (None)."""
        tokens, token_logprobs, top_logprobs, text_offset = [], [], [], []
        for entry in entries:
            if entry is None:  # the prompt's first token: no logprob
                tokens.append(self._first_prompt_token)
                token_logprobs.append(None)
                top_logprobs.append(None)
                text_offset.append(self._offset)
                self._offset += len(tokens[-1])
                continue
            tokens.append(entry.chosen.token)
            token_logprobs.append(entry.chosen.logprob)
            top_logprobs.append({t.token: t.logprob for t in entry.top})
            text_offset.append(self._offset)
            self._offset += len(entry.chosen.token)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
                "text_offset": text_offset}
