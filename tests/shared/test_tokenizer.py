import pytest

from shared.tokenizer import IncrementalDetokenizer, Tokenizer
from shared.model_files import converted_gguf_dir, default_gguf_path


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer(converted_gguf_dir(default_gguf_path(), None))


def test_roundtrip_and_special_tokens(tokenizer):
    text = "Hello, world! 12345 naïve café"
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text
    assert tokenizer.encode("<|im_start|>") == [1]  # a control token is one id
    assert tokenizer.encode("123") == [tokenizer.encode("1")[0], tokenizer.encode("2")[0],
                                       tokenizer.encode("3")[0]]  # digits split one by one
    assert tokenizer.eos_token_id == 2


def test_chat_template_adds_generation_prompt(tokenizer):
    text = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert text.startswith("<|im_start|>system\n")
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


def test_incremental_detokenization_never_splits_a_character(tokenizer):
    text = "Zürich → 東京 🎉🚀 naïve"
    ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer(tokenizer)
    pieces = [detok.add([t]) for t in ids]
    assert all("\ufffd" not in piece for piece in pieces)
    assert "".join(pieces) == text
    assert any(piece == "" for piece in pieces)  # some tokens held back mid-character


def test_model_tokenizer_names_another_directory(tmp_path):
    """`model.tokenizer` (vLLM's --tokenizer): a dummy model served with tokenizer files copied
    elsewhere, as a machine without the default model's GGUF runs one."""
    import shutil

    from shared.config import ModelSection
    from shared.preprocess import served_model

    source = converted_gguf_dir(default_gguf_path(), None, weights=False)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(source / name, tmp_path / name)
    served = served_model(ModelSection(name="dummy:tiny", tokenizer=str(tmp_path)))
    assert served.tokenizer.encode("<|im_start|>") == [1]
    with pytest.raises(FileNotFoundError, match="model.tokenizer .* no tokenizer.json"):
        served_model(ModelSection(name="dummy:tiny", tokenizer=str(tmp_path / "none")))


ALTERNATING = ("{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
               "{{ raise_exception('roles must alternate user/assistant/user/...') }}{% endif %}"
               "[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}")


@pytest.mark.parametrize("template, needle", [
    (ALTERNATING, "roles must alternate"),
    ("{{ messages[0]['content'].nope() }}", "has no attribute"),  # any template error
])
def test_messages_a_chat_template_refuses_are_the_clients_error(tmp_path, template, needle):
    """A template that raises (as many Llama-family ones do for roles out of order) is a
    ProtocolError naming `messages`: a 400 at the gateway, `invalid_request` from admission,
    not an internal error."""
    import json
    import shutil

    from shared.preprocess import prompt_token_ids
    from shared.protocol import ChatMessage, GenerateRequest, ProtocolError

    source = converted_gguf_dir(default_gguf_path(), None, weights=False)
    shutil.copy(source / "tokenizer.json", tmp_path / "tokenizer.json")
    config = json.loads((source / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config,
                                                                "chat_template": template}))
    tokenizer = Tokenizer(tmp_path)
    request = GenerateRequest(messages=[ChatMessage("user", "a"), ChatMessage("user", "b")])
    with pytest.raises(ProtocolError) as info:
        prompt_token_ids(tokenizer, request, tokenizer.vocab_size)
    assert info.value.code == "invalid_request"
    assert info.value.message.startswith("`messages`: the model's chat template refused them")
    assert needle in info.value.message
    if template == ALTERNATING:  # alternating roles render
        good = GenerateRequest(messages=[ChatMessage("user", "a"), ChatMessage("assistant", "b")])
        assert prompt_token_ids(tokenizer, good, tokenizer.vocab_size)
