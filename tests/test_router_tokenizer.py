"""The router's tokenizer (tokenizers + jinja2, no transformers) gives transformers' results."""

from __future__ import annotations

import json
import os

import pytest
from transformers import AutoTokenizer

from pdcluster.engine.testing import make_tiny_model
from pdcluster.router.tokenizer import Tokenizer

TEXTS = ["Hello world", " leading space", "日本語 é ü\n\ttabs", "<s>x</s> special tokens in text", ""]
CHATS = [
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "be brief"}, {"role": "user", "content": "日本 and é"},
     {"role": "assistant", "content": "ok"}, {"role": "user", "content": "more"}],
]


def without_template_file(path: str) -> str:
    """Keep only tokenizer_config.json's template (transformers 5 may also save chat_template.jinja)."""
    jinja_file = os.path.join(path, "chat_template.jinja")
    if os.path.exists(jinja_file):
        os.remove(jinja_file)
    return path


@pytest.fixture(scope="module", params=["jinja_file", "config_entry"])
def model_dir(request, tmp_path_factory) -> str:
    """The template as transformers 5 saves it (chat_template.jinja) or as older checkpoints carry it."""
    path = make_tiny_model(str(tmp_path_factory.mktemp(request.param)), "llama", chat_template_file=True)
    if request.param == "config_entry":
        with open(os.path.join(path, "chat_template.jinja")) as f:
            template = f.read()
        without_template_file(path)
        edit_config(path, lambda config: config.update(chat_template=template))
    return path


def edit_config(path: str, change) -> None:
    config_file = os.path.join(path, "tokenizer_config.json")
    with open(config_file) as f:
        config = json.load(f)
    change(config)
    with open(config_file, "w") as f:
        json.dump(config, f)


def test_encode_decode_and_chat_template_match_transformers(model_dir):
    ours, hf = Tokenizer(model_dir), AutoTokenizer.from_pretrained(model_dir)
    assert ours.vocab_size == len(hf) and ours.eos_token_id == hf.eos_token_id
    for text in TEXTS:
        assert ours.encode(text) == hf.encode(text)
        assert ours.encode(text, add_special_tokens=False) == hf.encode(text, add_special_tokens=False)
        ids = hf.encode(text) + [hf.eos_token_id]
        for skip in (True, False):
            assert ours.decode(ids, skip) == hf.decode(ids, skip_special_tokens=skip,
                                                       clean_up_tokenization_spaces=False)
    for messages in CHATS:
        text = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert ours.apply_chat_template(messages) == hf.encode(text, add_special_tokens=False)


def test_template_features_transformers_provides(tmp_path):
    path = without_template_file(make_tiny_model(str(tmp_path / "m"), "llama"))
    edit_config(path, lambda config: config.update(chat_template=[
        {"name": "tool_use", "template": "unused"},
        {"name": "default", "template": (
            "{% for m in messages %}{% if m['role'] == 'bad' %}{{ raise_exception('bad role') }}{% endif %}"
            "{% generation %}{{ m | tojson }}{% endgeneration %}{% if loop.index > 1 %}{% break %}{% endif %}"
            "{% endfor %}{{ strftime_now('%Y') | length }}")},
    ]))
    tok = Tokenizer(path)
    text = tok.decode(tok.apply_chat_template([{"role": "user", "content": "é"}, {"role": "a", "content": "b"},
                                               {"role": "c", "content": "never"}]), skip_special_tokens=False)
    assert text == '{"role": "user", "content": "é"}{"role": "a", "content": "b"}4'
    with pytest.raises(Exception, match="bad role"):
        tok.apply_chat_template([{"role": "bad", "content": "x"}])


def test_model_without_chat_template_is_refused(tmp_path):
    path = without_template_file(make_tiny_model(str(tmp_path / "m"), "llama"))
    edit_config(path, lambda config: config.pop("chat_template", None))
    with pytest.raises(ValueError, match="no chat template"):
        Tokenizer(path).apply_chat_template([{"role": "user", "content": "hi"}])
