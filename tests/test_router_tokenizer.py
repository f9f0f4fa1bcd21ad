"""The router's tokenizer (tokenizers + jinja2, no transformers) gives transformers' results; the streaming
detokenizer gives the full decoding's text and never raises."""

from __future__ import annotations

import json
import logging
import os
import random
import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from router_fakes import CORPUS, make_tokenizer_dir
from tokenizers import Tokenizer as RustTokenizer
from tokenizers import decoders, models, normalizers, pre_tokenizers, trainers
from transformers import AutoTokenizer

from pdcluster.engine.testing import make_tiny_model
from pdcluster.router import detokenizer as detokenizer_module
from pdcluster.router.detokenizer import IncrementalDetokenizer, build_byte_table
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


# -- detokenizer: per-token byte table + incremental UTF-8 decoding (DecodeStream for other decoders)

SMOLLM2 = os.path.expanduser("~/.cache/pdcluster/models/smollm2-135m-instruct-bfloat16")
UNICODE_CORPUS = ["日本語 é ü 🦊 wörld", "héllo ünïcödé", "emoji 🦊🦊 fox"]


def save_tokenizer(tok: RustTokenizer, path: str) -> str:
    os.makedirs(path, exist_ok=True)
    tok.save(os.path.join(path, "tokenizer.json"))
    return path


def make_byte_level_dir(path: str) -> str:
    """GPT-2 style: ByteLevel pre-tokenizer and decoder; merges inside multi-byte characters, so tokens
    hold partial UTF-8; a special token, and non-special added tokens written as text (" spaced" has a
    character outside the byte map, "Ġhi" is in it and decodes to " hi", as ByteLevel does)."""
    tok = RustTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS + UNICODE_CORPUS * 20, trainers.BpeTrainer(
        vocab_size=420, special_tokens=["<|end|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    tok.add_tokens(["<tool>", " spaced", "Ġhi"])
    return save_tokenizer(tok, path)


def make_metaspace_dir(path: str, prepend_scheme: str = "first") -> str:
    """The Metaspace decoder: "▁" -> " ", and every "▁" of the text's first token dropped."""
    vocab = ["<unk>", "<s>", "▁Hello", "▁world", "▁▁", "a▁b", "▁", "x", "<0xE6>", "é", "日本", "▁🦊"]
    tok = RustTokenizer(models.WordLevel({t: i for i, t in enumerate(vocab)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme=prepend_scheme)
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme=prepend_scheme)
    tok.add_special_tokens(["<s>"])
    tok.add_tokens(["<tool>"])
    return save_tokenizer(tok, path)


def make_sentencepiece_variant_dir(path: str, strip_start: int) -> str:
    """make_tokenizer_dir's byte-fallback tokenizer with Strip(" ", strip_start, 0): 2 is not modelled."""
    make_tokenizer_dir(path)
    tok = RustTokenizer.from_file(os.path.join(path, "tokenizer.json"))
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", strip_start, 0)])
    return save_tokenizer(tok, path)


def make_wordpiece_dir(path: str) -> str:
    tok = RustTokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer()
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    tok.train_from_iterator(CORPUS + UNICODE_CORPUS, trainers.WordPieceTrainer(
        vocab_size=200, special_tokens=["[UNK]", "[CLS]", "[SEP]"], show_progress=False))
    return save_tokenizer(tok, path)


@pytest.fixture(scope="module")
def sp_tokenizer(tmp_path_factory) -> Tokenizer:
    return Tokenizer(make_tokenizer_dir(str(tmp_path_factory.mktemp("sp"))))


@pytest.mark.parametrize("text", ["héllo 日本語 wörld!", "The quick brown fox", "emoji 🦊 fox", "ünïcödé"])
def test_incremental_detokenizer_one_token_at_a_time(sp_tokenizer: Tokenizer, text: str) -> None:
    prompt = sp_tokenizer.encode("Hello world")
    ids = sp_tokenizer.encode(text, add_special_tokens=False)
    det = IncrementalDetokenizer(sp_tokenizer, prompt)
    deltas = [det.add([i]) for i in ids]
    deltas.append(det.flush())
    assert all("\ufffd" not in d for d in deltas)  # a split character is never emitted half-way
    assert "".join(deltas) == " " + text
    # multi-byte characters really were split across byte tokens in this tokenizer
    if any(ord(c) > 127 for c in text):
        assert any(sp_tokenizer.tk.id_to_token(i).startswith("<0x") for i in ids)
        assert "" in deltas[:-1]


def test_incremental_detokenizer_uneven_chunks_and_special_tokens(sp_tokenizer: Tokenizer) -> None:
    text = "日本 quick 🦊"
    ids = sp_tokenizer.encode(text, add_special_tokens=False) + [sp_tokenizer.eos_token_id]
    det = IncrementalDetokenizer(sp_tokenizer, [1])
    out = "".join(det.add(ids[i:i + 3]) for i in range(0, len(ids), 3)) + det.flush()
    assert out == text  # no prompt text before it: no leading space; EOS skipped


def test_detokenizer_flush_releases_a_dangling_byte(sp_tokenizer: Tokenizer) -> None:
    ids = sp_tokenizer.encode("日", add_special_tokens=False)
    det = IncrementalDetokenizer(sp_tokenizer, [1])
    assert det.add(ids[:2]) == ""
    assert det.flush() == "\ufffd"  # an invalid sequence at the very end still comes out


def test_token_text_and_bytes(sp_tokenizer: Tokenizer) -> None:
    ids = sp_tokenizer.encode("The é", add_special_tokens=False)
    assert sp_tokenizer.token_text(ids[0]) == " The"
    byte_ids = [i for i in ids if sp_tokenizer.tk.id_to_token(i).startswith("<0x")]
    assert [sp_tokenizer.token_bytes(i) for i in byte_ids] == [[0xC3], [0xA9]]
    assert sp_tokenizer.token_bytes(ids[0]) == list(b" The")


@pytest.fixture(scope="module", params=["sentencepiece", "byte_level", "metaspace"])
def table_tokenizer(request, tmp_path_factory) -> Tokenizer:
    path = str(tmp_path_factory.mktemp(request.param))
    make = {"sentencepiece": make_tokenizer_dir, "byte_level": make_byte_level_dir,
            "metaspace": make_metaspace_dir}[request.param]
    tok = Tokenizer(make(path))
    assert tok.byte_table is not None, "the decoder is one the table models"
    return tok


def sentencepiece_bytes(tok: Tokenizer, ids: list[int], skip: bool) -> bytes:
    """The output's bytes as the ByteFallback decoder reads tokens (an oracle independent of the table)."""
    specials = {i for i, t in tok.tk.get_added_tokens_decoder().items() if t.special}
    out = b""
    for i in ids:
        s = tok.tk.id_to_token(i)
        if s is None or (skip and i in specials):
            continue
        m = re.fullmatch(r"<0x([0-9A-F]{2})>", s)
        out += bytes([int(m.group(1), 16)]) if m else s.replace("▁", " ").encode()
    return out


def expected_text(tok: Tokenizer, prompt: list[int], out: list[int], skip: bool) -> tuple[str, bool]:
    """(the text the detokenizer must give for `out` after `prompt`, whether the bytes are valid UTF-8)."""
    prompt_text, out_text = tok.decode(prompt, skip), tok.decode(out, skip)
    full_delta = tok.decode(prompt + out, skip)[len(prompt_text):]
    kind = json.loads(tok.tk.decoder.__getstate__())["type"]
    if kind == "ByteLevel":  # tokenizers decodes the joined bytes lossily, as Python does
        if "\ufffd" not in prompt_text:
            assert out_text == full_delta
        return out_text, "\ufffd" not in out_text
    if kind == "Metaspace":  # tokens are text: always valid
        return full_delta, True
    valid = "\ufffd" not in prompt_text + out_text
    if valid:
        return full_delta, True
    data = sentencepiece_bytes(tok, out, skip)
    if not sentencepiece_bytes(tok, prompt, skip) and data[:1] == b" ":
        data = data[1:]  # Strip(" ", 1, 0): the text's first space
    return data.decode("utf-8", "replace"), False


@st.composite
def id_streams(draw, tok: Tokenizer) -> tuple[list[int], list[list[int]], bool]:
    """(prompt tail, output ids in chunks, skip_special_tokens): random ids (byte tokens, specials, ids
    past the vocabulary) mixed with encoded unicode text (characters split across byte tokens)."""
    any_id = st.integers(0, tok.vocab_size + 2).map(lambda i: [i])
    text_ids = st.text(max_size=6).map(lambda t: tok.encode(t, add_special_tokens=False))
    pieces = st.lists(st.one_of(any_id, text_ids), max_size=12)
    prompt = [i for p in draw(pieces) for i in p][-6:]
    out = [i for p in draw(pieces) for i in p]
    sizes = draw(st.lists(st.integers(1, 4), min_size=1, max_size=4))
    chunks, k = [], 0
    while k < len(out):
        n = sizes[len(chunks) % len(sizes)]
        chunks.append(out[k:k + n])
        k += n
    return prompt, chunks, draw(st.booleans())


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_detokenizer_matches_full_decoding(table_tokenizer: Tokenizer, data) -> None:
    tok = table_tokenizer
    prompt, chunks, skip = data.draw(id_streams(tok))
    det = IncrementalDetokenizer(tok, prompt, skip)
    so_far, out, text = [], [], ""
    for chunk in chunks:
        text += det.add(chunk)
        out += chunk
        so_far.append((text, expected_text(tok, prompt, out, skip)))
    text += det.flush()
    want, _ = expected_text(tok, prompt, out, skip)
    assert text == want
    for partial, (want_partial, valid) in so_far:
        assert text.startswith(partial)  # nothing released is taken back: no half character came out
        if valid:
            assert partial == want_partial  # and complete characters are not held back


def test_metaspace_first_token_and_prepend_never(tmp_path) -> None:
    tok = Tokenizer(make_metaspace_dir(str(tmp_path / "first")))
    ids = {t: tok.tk.token_to_id(t) for t in ["<s>", "▁▁", "a▁b", "▁Hello", "▁world"]}
    det = IncrementalDetokenizer(tok, [ids["<s>"]])
    assert det.add([ids["▁▁"], ids["a▁b"]]) + det.add([ids["▁Hello"]]) + det.flush() == "a b Hello"
    det = IncrementalDetokenizer(tok, [ids["<s>"]], skip_special_tokens=False)
    assert det.add([ids["▁▁"], ids["a▁b"]]) == "  a b"  # "<s>" is the text's first token
    never = Tokenizer(make_metaspace_dir(str(tmp_path / "never"), prepend_scheme="never"))
    assert never.byte_table is not None and never.byte_table.strip == ""
    det = IncrementalDetokenizer(never, [])
    assert det.add([ids["▁Hello"], ids["▁world"]]) == " Hello world"


def test_byte_level_token_text_and_bytes(tmp_path) -> None:
    tok = Tokenizer(make_byte_level_dir(str(tmp_path / "bl")))
    partial = next(i for i in range(tok.vocab_size) if "\ufffd" in tok.decode([i]))
    piece = tok.tk.id_to_token(partial)
    assert tok.token_text(partial) == piece  # bytes that are no character on their own: the raw piece
    assert bytes(tok.token_bytes(partial)).decode("utf-8", "replace") == tok.decode([partial])
    [quick] = tok.encode(" quick", add_special_tokens=False)
    assert tok.token_text(quick) == " quick" and tok.token_bytes(quick) == list(b" quick")
    added = tok.tk.token_to_id(" spaced")
    assert tok.token_text(added) == " spaced" and tok.token_text(tok.tk.token_to_id("Ġhi")) == " hi"
    end = tok.tk.token_to_id("<|end|>")
    det = IncrementalDetokenizer(tok, [], skip_special_tokens=True)
    assert det.add([quick, end, added]) + det.flush() == " quick spaced"


def test_unmodelled_decoders_use_decode_stream_and_never_raise(tmp_path, monkeypatch) -> None:
    """The former crash: random byte tokens made DecodeStream raise "Invalid prefix encountered" (most
    30-token sequences did); the stream path now restarts the stream instead."""
    restarts: list[Exception] = []
    monkeypatch.setattr(detokenizer_module, "_warn_stream_reset", restarts.append)
    rng = random.Random(0)
    for tok, byte_fallback in ((Tokenizer(make_sentencepiece_variant_dir(str(tmp_path / "sp2"), 2)), True),
                               (Tokenizer(make_wordpiece_dir(str(tmp_path / "wp"))), False)):
        assert tok.byte_table is None
        restarts.clear()
        for _ in range(300):
            prompt = [rng.randrange(tok.vocab_size) for _ in range(8)]
            det = IncrementalDetokenizer(tok, prompt)
            for _ in range(30):
                det.add([rng.randrange(tok.vocab_size + 2)])
            det.flush()
        assert any("Invalid prefix" in str(e) for e in restarts) == byte_fallback  # the crash did come
        # clean text still comes out as the full decoding does
        prompt, out = tok.encode("Hello world", add_special_tokens=False), tok.encode(
            " the quick brown fox", add_special_tokens=False)
        det = IncrementalDetokenizer(tok, prompt)
        text = "".join(det.add([i]) for i in out) + det.flush()
        assert text == tok.decode(prompt + out)[len(tok.decode(prompt)):]


class OneTokenDecodesDifferently:
    """A tokenizer whose decoder is not what its decoder's JSON says for one token."""

    def __init__(self, tk: RustTokenizer, token_id: int) -> None:
        self.tk, self.token_id = tk, token_id

    def __getattr__(self, name: str):
        return getattr(self.tk, name)

    def decode_batch(self, sequences: list[list[int]], skip_special_tokens: bool = True) -> list[str]:
        texts = self.tk.decode_batch(sequences, skip_special_tokens=skip_special_tokens)
        return [t + "!" if s == [self.token_id] else t for s, t in zip(sequences, texts, strict=True)]


def test_table_verification_rejects_a_disagreeing_tokenizer(sp_tokenizer: Tokenizer, caplog) -> None:
    assert build_byte_table(sp_tokenizer.tk) is not None
    with caplog.at_level(logging.WARNING, logger="pdcluster.router.tokenizer"):
        assert build_byte_table(OneTokenDecodesDifferently(sp_tokenizer.tk, 42)) is None
    assert "token 42" in caplog.text


@pytest.mark.skipif(not os.path.exists(os.path.join(SMOLLM2, "tokenizer.json")),
                    reason="SmolLM2 tokenizer not downloaded")
def test_smollm2_table_and_random_ids() -> None:
    tok = Tokenizer(SMOLLM2)
    assert tok.byte_table is not None and len(tok.byte_table.pieces) == tok.vocab_size
    rng = random.Random(0)
    for _ in range(100):
        prompt = [rng.randrange(tok.vocab_size) for _ in range(4)]
        out = [rng.randrange(tok.vocab_size + 64) for _ in range(30)]  # + ids of a padded embedding
        det = IncrementalDetokenizer(tok, prompt)
        text = "".join(det.add(out[k:k + 3]) for k in range(0, len(out), 3)) + det.flush()
        assert text == tok.decode(out)
