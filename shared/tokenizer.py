"""Tokenizer, chat template and incremental detokenizer, built from the model's own files."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import jinja2
import msgspec
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

_CONTROL_TOKEN = 3  # GGUF token_type for special tokens (<|im_start|>, ...)


def tokenizer_files_from_gguf(reader, directory: Path) -> None:
    """Write tokenizer.json and tokenizer_config.json from GGUF metadata (byte-level BPE)."""
    from shared.model_files import gguf_field

    kind = gguf_field(reader, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"GGUF tokenizer model {kind!r} is not supported (only byte-level BPE)")
    tokens: list[str] = gguf_field(reader, "tokenizer.ggml.tokens")
    token_types = gguf_field(reader, "tokenizer.ggml.token_type")
    merges = [tuple(m.split(" ", 1)) for m in gguf_field(reader, "tokenizer.ggml.merges")]
    bpe = models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges)
    tokenizer = HFTokenizer(bpe)
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if gguf_field(reader, "tokenizer.ggml.pre") == "smollm":  # SmolLM splits digits one by one
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level])
    else:
        tokenizer.pre_tokenizer = byte_level
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([
        AddedToken(t, special=True, normalized=False)
        for t, kind in zip(tokens, token_types) if kind == _CONTROL_TOKEN
    ])
    tokenizer.save(str(directory / "tokenizer.json"))

    def token(key: str) -> str | None:
        index = gguf_field(reader, key)
        return None if index is None else tokens[index]

    (directory / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": gguf_field(reader, "tokenizer.chat_template"),
        "bos_token": token("tokenizer.ggml.bos_token_id"),
        "eos_token": token("tokenizer.ggml.eos_token_id"),
        "add_bos_token": bool(gguf_field(reader, "tokenizer.ggml.add_bos_token", False)),
    }, indent=2))


class Tokenizer:
    """Encode, decode and chat-format text for one model."""

    def __init__(self, directory: Path):
        self._tok = HFTokenizer.from_file(str(directory / "tokenizer.json"))
        config_file = directory / "tokenizer_config.json"
        config = json.loads(config_file.read_text()) if config_file.exists() else {}
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        # No token stands for more characters than its vocabulary string has (a byte-level
        # token's string has a character per byte), so a text of n characters is at least
        # n / max_token_chars tokens: the bound that refuses a huge prompt without encoding it.
        self.max_token_chars = max(map(len, self._tok.get_vocab(with_added_tokens=True)))
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        self.bos_token_id = self._tok.token_to_id(self.bos_token) if self.bos_token else None
        self.eos_token_id = self._tok.token_to_id(self.eos_token) if self.eos_token else None
        self.add_bos = bool(config.get("add_bos_token", False)) and self.bos_token_id is not None
        template = config.get("chat_template")
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        # Templates refuse messages they cannot render (roles that do not alternate, a system
        # message where none may be) by calling raise_exception, as transformers defines it.
        env.globals["raise_exception"] = _raise_template_error
        self._chat_template = env.from_string(template) if template else None

    @functools.cached_property
    def max_token_json_bytes(self) -> int:
        """The most bytes one generated token can add to a JSON output: its text as a JSON
        string's contents (escapes included) and its id with a separator."""
        encode = msgspec.json.encode
        longest = max(len(encode(self.decode([i]))) - 2 for i in range(self.vocab_size))
        return longest + len(str(self.vocab_size)) + 1

    def encode(self, text: str) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        return [self.bos_token_id, *ids] if self.add_bos else ids

    def decode(self, token_ids: list[int]) -> str:
        # Ids past the tokenizer's vocabulary come only from dummy models with a larger one.
        ids = [t for t in token_ids if t < self.vocab_size]
        return self._tok.decode(ids, skip_special_tokens=True)

    def apply_chat_template(self, messages: list[dict[str, str]]) -> str:
        if self._chat_template is None:
            raise ValueError("this model has no chat template; send `prompt` instead of `messages`")
        try:
            return self._chat_template.render(messages=messages, add_generation_prompt=True,
                                              bos_token=self.bos_token or "",
                                              eos_token=self.eos_token or "")
        except jinja2.TemplateError as exc:  # the client's messages, not the server, at fault
            raise ValueError(f"the model's chat template refused them: {exc}") from None


def _raise_template_error(message: str):
    raise jinja2.TemplateError(message)


def _token_text(value) -> str | None:
    if isinstance(value, dict):  # HF writes added tokens as objects
        return value.get("content")
    return value


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text, never splitting a UTF-8 character.

    Decodes a short window: the tokens since `prefix_offset` with and without the newest ones; the
    difference is the new text. While the newest bytes are an incomplete character (the decoder
    yields U+FFFD), nothing is emitted; the text comes out once the character completes.
    """

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.token_ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0

    def add(self, new_token_ids: list[int]) -> str:
        self.token_ids.extend(new_token_ids)
        decode = self.tokenizer.decode
        prefix_text = decode(self.token_ids[self.prefix_offset:self.read_offset])
        full_text = decode(self.token_ids[self.prefix_offset:])
        if len(full_text) > len(prefix_text) and not full_text.endswith("\ufffd"):
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.token_ids)
            return full_text[len(prefix_text):]
        return ""
