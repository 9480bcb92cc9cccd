"""Encode and decode with one model's Hugging Face tokenizer (output text is made at
the gateway: shared/detokenizer.py).

Plain synchronous code: ``service.py`` wraps it for the bus, tests drive it directly.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jinja2
import msgspec

from services.tokenizer.images import ImagePrompts, decode_image, is_vision_language
from services.tokenizer.qwen_images import QWEN2_5_VL, QwenImagePrompts
from shared.errors import InvalidRequest, check_token_ids
from shared.messages import ChatMessage, DecodeRequest, EncodeRequest, ImageInput, TokenizerInfo
from shared.models import read_eos_token_ids, read_generation_defaults
from shared.tokenizer_loading import DEFAULT_CACHE_DIR, load_tokenizer

# config.json keys that hold the context length, most common first.
_DOCUMENT_SEPARATOR = "<|endoftext|>"
_CONTEXT_LENGTH_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length")


class TextCodec:
    """One model's tokenizer: chat templates, encode, decode."""

    def __init__(self, model_dir: str | Path, max_model_len: int = 0,
                 max_image_pixels: int = 4096 * 4096,
                 cache_dir: str | Path = DEFAULT_CACHE_DIR) -> None:
        if max_model_len < 0:
            raise ValueError(f"max_model_len must be >= 0, got {max_model_len}")
        self.model_dir = Path(model_dir)
        self.tokenizer = load_tokenizer(self.model_dir, cache_dir)  # (tokenizer_loading.py)
        model_config = _read_json(self.model_dir / "config.json")
        self.max_model_len = max_model_len or _context_length(model_config)
        self.vocab_size = len(self.tokenizer)  # includes added (special) tokens
        self.eos_token_ids = read_eos_token_ids(self.model_dir, self.tokenizer.eos_token_id)
        self.generation_defaults = read_generation_defaults(self.model_dir)
        # a vision-language model's processor (images.py); None: the model reads text only
        self.images = (image_prompts(self.model_dir, self.tokenizer, model_config)
                       if is_vision_language(model_config) else None)
        self.max_image_pixels = max_image_pixels

    @property
    def has_chat_template(self) -> bool:
        return bool(self.tokenizer.chat_template)

    def encode(self, req: EncodeRequest) -> list[int]:
        """Token ids for a chat conversation, a text prompt or a token-id prompt."""
        if (req.prompt is None) == (req.messages is None):
            raise InvalidRequest("give exactly one of 'prompt' or 'messages'",
                                 param="messages" if req.messages is not None else "prompt")
        if req.images:
            raise InvalidRequest("a prompt with images is encoded by encode_with_images",
                                 param="messages")
        if req.messages is not None:
            token_ids = self._encode_chat(req.messages, req.add_generation_prompt, req.tools)
        elif isinstance(req.prompt, str):
            token_ids = self.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)
        else:
            token_ids = self._checked_ids(req.prompt, "prompt")
        if not token_ids:
            raise InvalidRequest("the prompt is empty: it encodes to no tokens",
                                 param="messages" if req.messages is not None else "prompt")
        return token_ids

    def encode_with_images(self, req: EncodeRequest) -> tuple[list[int], list[ImageInput]]:
        """A chat with images -> (token ids, placeholders expanded; the images, preprocessed
        for the worker). A 400 for a text-only model, an image that does not decode, is of
        another format or has too many pixels. CPU-heavy: the service runs it off its loop."""
        if self.images is None:
            raise InvalidRequest("this model reads text only: it takes no image parts",
                                 param="messages", code="images_not_supported")
        if req.messages is None:
            raise InvalidRequest("images come in chat messages", param="messages")
        pictures = [decode_image(data, self.max_image_pixels, index)
                    for index, data in enumerate(req.images)]
        text = self.render_chat(req.messages, req.add_generation_prompt, req.tools)
        return self.images.encode(text, pictures)

    def decode(self, req: DecodeRequest) -> str:
        token_ids = self._checked_ids(req.token_ids, "token_ids")
        return self.tokenizer.decode(token_ids, skip_special_tokens=req.skip_special_tokens)

    def info(self, model_name: str) -> TokenizerInfo:
        return TokenizerInfo(
            model_name=model_name,
            max_model_len=self.max_model_len,
            vocab_size=self.vocab_size,
            eos_token_ids=list(self.eos_token_ids),
            has_chat_template=self.has_chat_template,
            generation_defaults=self.generation_defaults,
            document_start_token_id=self.document_start_token_id,
            accepts_images=self.images is not None,
        )

    @property
    def document_start_token_id(self) -> int | None:
        """What a completion with no prompt starts from: ``<|endoftext|>`` (OpenAI's
        document separator, which SmolLM2 and Qwen share) when it is one token, else BOS,
        else the first EOS."""
        separator = self.tokenizer.get_vocab().get(_DOCUMENT_SEPARATOR)
        if separator is not None:
            return separator
        if self.tokenizer.bos_token_id is not None:
            return self.tokenizer.bos_token_id
        return self.eos_token_ids[0] if self.eos_token_ids else None

    @property
    def template_uses_tools(self) -> bool:
        """Whether the chat template renders ``tools`` itself (Qwen2.5/3, Llama 3.1, ...)."""
        template = self.tokenizer.chat_template
        sources = template.values() if isinstance(template, dict) else [template or ""]
        return any("tools" in source for source in sources)

    def render_chat(self, messages: list[ChatMessage], add_generation_prompt: bool = True,
                    tools: list[dict[str, Any]] | None = None) -> str:
        """The chat template's text for ``messages`` (what ``encode`` tokenizes).

        A template that knows ``tools`` gets them, and the tool turns, as Hugging Face
        templates expect; any other gets them rewritten as plain text (``_fallback``).
        """
        if not self.has_chat_template:
            raise InvalidRequest("this model has no chat template: send a 'prompt' to "
                                 "/v1/completions instead", param="messages")
        if not messages:
            raise InvalidRequest("'messages' must not be empty", param="messages")
        if self.template_uses_tools:
            conversation = [_template_message(message) for message in messages]
            extra = {"tools": tools} if tools else {}
        else:
            conversation, extra = _fallback_conversation(messages, tools), {}
        try:
            return self.tokenizer.apply_chat_template(
                conversation, add_generation_prompt=add_generation_prompt, tokenize=False,
                **extra)
        except (jinja2.TemplateError, TypeError, ValueError, KeyError) as exc:
            raise InvalidRequest(f"the chat template rejected the messages: {exc}",
                                 param="messages") from exc

    def _encode_chat(self, messages: list[ChatMessage], add_generation_prompt: bool,
                     tools: list[dict[str, Any]] | None = None) -> list[int]:
        # The rendered text already holds the template's special tokens; adding them
        # again (a second BOS) is what apply_chat_template avoids too.
        text = self.render_chat(messages, add_generation_prompt, tools)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def _checked_ids(self, token_ids: list[int], param: str) -> list[int]:
        if not token_ids:
            return []  # the caller says what an empty list means
        return check_token_ids(token_ids, self.vocab_size, param)


def image_prompts(model_dir: Path, tokenizer, model_config: dict[str, Any]
                  ) -> ImagePrompts | QwenImagePrompts:
    """The vision-language model's processor: Qwen2.5-VL's or Idefics3's."""
    if (model_config.get("architectures") or [None])[0] == QWEN2_5_VL:
        return QwenImagePrompts(model_dir, tokenizer)
    return ImagePrompts(model_dir, tokenizer)


def _with_parts(entry: dict[str, Any], message: ChatMessage) -> dict[str, Any]:
    """A message with images goes to the template as content parts (``{"type": "image"}``
    where each image goes), as Hugging Face vision templates take them."""
    entry.pop("parts", None)
    if message.parts is not None:
        entry["content"] = [{"type": "image"} if part.type == "image" else
                            {"type": "text", "text": part.text} for part in message.parts]
    return entry


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


def _context_length(model_config: dict[str, Any]) -> int:
    for config in (model_config, model_config.get("text_config") or {}):
        for key in _CONTEXT_LENGTH_KEYS:
            if isinstance(config.get(key), int) and config[key] > 0:
                return config[key]
    raise ValueError("config.json gives no context length (max_position_embeddings): "
                     "set max_model_len")


# ----------------------------------------------------------------- tool calling
# The fallback for templates that do not render tools: the Hermes format Qwen2.5 uses,
# which services/gateway/tool_calls.py parses back out of the output.
TOOLS_PROMPT = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within \
<tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""


def _arguments(text: str) -> Any:
    """A call's arguments as the object HF templates expect (``| tojson``); text that is
    not a JSON object stays text."""
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return value if isinstance(value, dict) else text


def _template_message(message: ChatMessage) -> dict[str, Any]:
    # omit_defaults drops unset fields (name, content=None), as OpenAI clients do.
    entry = _with_parts(msgspec.to_builtins(message), message)
    if message.tool_calls:
        entry["tool_calls"] = [
            {"id": call.id, "type": call.type,
             "function": {"name": call.function.name,
                          "arguments": _arguments(call.function.arguments)}}
            for call in message.tool_calls]
    return entry


def tool_call_text(name: str, arguments: str) -> str:
    """One call in the fallback format (what the model is asked to write)."""
    call = json.dumps({"name": name, "arguments": _arguments(arguments)}, ensure_ascii=False)
    return f"<tool_call>\n{call}\n</tool_call>"


def _fallback_conversation(messages: list[ChatMessage],
                           tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """Tool turns as text any template renders: assistant calls as ``<tool_call>`` blocks,
    each run of tool results as one user turn of ``<tool_response>`` blocks, and the
    tools listed in the system message (appended to the client's own, if any)."""
    conversation: list[dict[str, Any]] = []
    in_tool_run = False
    for message in messages:
        if message.role == "tool":
            block = f"<tool_response>\n{message.content or ''}\n</tool_response>"
            if in_tool_run:
                conversation[-1]["content"] += "\n" + block
            else:
                conversation.append({"role": "user", "content": block})
            in_tool_run = True
            continue
        in_tool_run = False
        entry = _with_parts(msgspec.to_builtins(message), message)
        if message.tool_calls:
            entry.pop("tool_calls")
            calls = [tool_call_text(c.function.name, c.function.arguments)
                     for c in message.tool_calls]
            entry["content"] = "\n".join(([message.content] if message.content else []) + calls)
        conversation.append(entry)
    if tools:
        listing = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
        prompt = TOOLS_PROMPT.format(tools=listing)
        first = conversation[0]
        if first["role"] == "system" and isinstance(first.get("content"), str):
            first["content"] = f"{first['content']}\n\n{prompt}"
        else:
            conversation.insert(0, {"role": "system", "content": prompt})
    return conversation
