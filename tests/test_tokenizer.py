"""Tokenizer loading, encode/decode and chat templates, checked against transformers and sentencepiece."""

from __future__ import annotations

import io
import json
import os
import random
import shutil
from pathlib import Path

import pytest
import sentencepiece as spm
from tokenizers import pre_tokenizers

from clover_lite.errors import TokenizerError
from clover_lite.tokenizer.byte_tokenizer import (
    DEFAULT_CHAT_TEMPLATE,
    DEFAULT_SPECIALS,
    byte_symbols,
    write_byte_tokenizer,
)
from clover_lite.tokenizer.tokenizer import Tokenizer

from .seed import SEED


@pytest.fixture
def rng() -> random.Random:
    return random.Random(SEED)


def random_text(rng: random.Random, max_len: int = 40, specials: list[str] | None = None) -> str:
    """Random unicode: ascii, whitespace and newlines, accents, CJK, emoji (with ZWJ), astral planes."""
    pools = [
        lambda: rng.choice("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"),
        lambda: rng.choice(" .,;:!?'\"()[]{}<>|/\\-_=+*&^%$#@~`"),
        lambda: rng.choice([" ", "  ", "\n", "\n\n", "\t", "\r\n", "\u00a0", "\u3000", "\u2028"]),
        lambda: chr(rng.randint(0x00C0, 0x024F)),  # latin accents
        lambda: chr(rng.randint(0x0300, 0x036F)),  # combining marks
        lambda: chr(rng.randint(0x4E00, 0x9FFF)),  # CJK
        lambda: chr(rng.randint(0x3040, 0x30FF)),  # kana
        lambda: chr(rng.randint(0x1F300, 0x1FAFF)),  # emoji
        lambda: "\U0001f468\u200d\U0001f469\u200d\U0001f467",  # ZWJ family
        lambda: chr(rng.choice([rng.randint(0x20, 0xD7FF), rng.randint(0xE000, 0x10FFFF)])),
    ]
    if specials:
        pools.append(lambda: rng.choice(specials))
    return "".join(rng.choice(pools)() for _ in range(rng.randint(0, max_len)))


def random_conversation(rng: random.Random, system: bool | None = None) -> list[dict]:
    messages = []
    if system if system is not None else rng.random() < 0.5:
        messages.append({"role": "system", "content": random_text(rng, 20)})
    for turn in range(rng.randint(1, 6)):
        messages.append({"role": "user" if turn % 2 == 0 else "assistant", "content": random_text(rng, 30)})
    return messages


@pytest.fixture(scope="module")
def byte_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("byte_tok")
    assert write_byte_tokenizer(out) == 256 + len(DEFAULT_SPECIALS)
    return out


@pytest.fixture(scope="module")
def byte_tok(byte_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(byte_dir)


@pytest.fixture(scope="module")
def hf_byte_tok(byte_dir: Path):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(byte_dir))


def copy_dir(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def edit_config(path: Path, **changes) -> None:
    config_path = path / "tokenizer_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    config_path.write_text(json.dumps(config, ensure_ascii=False), encoding="utf-8")


# ---------------------------------------------------------------- byte tokenizer


def test_byte_symbols_are_the_bytelevel_alphabet() -> None:
    reference = pytest.importorskip("transformers.convert_slow_tokenizer").bytes_to_unicode()
    assert byte_symbols() == [reference[b] for b in range(256)]
    assert set(byte_symbols()) == set(pre_tokenizers.ByteLevel.alphabet())


def test_byte_tokenizer_round_trips_random_unicode(byte_tok: Tokenizer, rng: random.Random) -> None:
    for _ in range(300):
        text = random_text(rng, 60)
        ids = byte_tok.encode(text)
        # No merges: the ids are exactly the UTF-8 bytes.
        assert ids == list(text.encode("utf-8"))
        assert byte_tok.decode(ids) == text
        assert byte_tok.decode(ids, skip_special_tokens=True) == text


def test_byte_tokenizer_special_tokens(byte_dir: Path, byte_tok: Tokenizer, rng: random.Random) -> None:
    ids = {t: 256 + i for i, t in enumerate(DEFAULT_SPECIALS)}
    assert byte_tok.vocab_size == 256 + len(DEFAULT_SPECIALS)
    for token, i in ids.items():
        assert byte_tok.encode(token) == [i]
        assert byte_tok.token_to_id(token) == i
        assert byte_tok.decode([i]) == token
        assert byte_tok.decode([i], skip_special_tokens=True) == ""
    assert byte_tok.eos_token_ids == [ids["<|im_end|>"]]
    assert byte_tok.mask_token_id == ids["<|mask|>"]
    assert byte_tok.pad_token_id == ids["<|endoftext|>"]
    assert byte_tok.bos_token_id is None
    assert byte_tok.special_token_ids == set(ids.values())
    assert byte_tok.token_to_id("<|not_a_token|>") is None
    assert byte_tok.has_chat_template

    # Specials inside random text split out as single ids; skipping them leaves the plain text.
    for _ in range(100):
        parts = [random_text(rng, 10) for _ in range(4)]
        specials = [rng.choice(DEFAULT_SPECIALS) for _ in range(3)]
        text = parts[0] + specials[0] + parts[1] + specials[1] + parts[2] + specials[2] + parts[3]
        expected = list(parts[0].encode())
        for special, part in zip(specials, parts[1:], strict=True):
            expected += [ids[special], *part.encode()]
        assert byte_tok.encode(text) == expected
        assert byte_tok.decode(expected) == text
        assert byte_tok.decode(expected, skip_special_tokens=True) == "".join(parts)


def test_byte_tokenizer_is_deterministic(tmp_path: Path, byte_dir: Path) -> None:
    write_byte_tokenizer(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / name).read_bytes() == (byte_dir / name).read_bytes()


def test_byte_tokenizer_custom_specials(tmp_path: Path) -> None:
    specials = ["<eos>", "[MASK]", "<|im_start|>", "<|im_end|>"]
    size = write_byte_tokenizer(tmp_path, special_tokens=specials, eos_token="<eos>", mask_token="[MASK]")
    tok = Tokenizer.from_dir(tmp_path)
    assert size == tok.vocab_size == 260
    assert tok.eos_token_ids == [256] and tok.mask_token_id == 257
    assert tok.pad_token_id is None  # "<|endoftext|>" is not among the specials


def test_write_byte_tokenizer_rejects_bad_specials(tmp_path: Path) -> None:
    with pytest.raises(TokenizerError, match="eos_token '<eos>' is not one of the special tokens"):
        write_byte_tokenizer(tmp_path, eos_token="<eos>")
    with pytest.raises(TokenizerError, match="mask_token"):
        write_byte_tokenizer(tmp_path, special_tokens=["<|im_end|>"])
    with pytest.raises(TokenizerError, match="duplicates"):
        write_byte_tokenizer(tmp_path, special_tokens=["<|im_end|>", "<|mask|>", "<|im_end|>"])
    with pytest.raises(TokenizerError, match="byte symbols"):
        write_byte_tokenizer(tmp_path, special_tokens=["<|im_end|>", "<|mask|>", "!"])
    with pytest.raises(TokenizerError, match="non-empty strings"):
        write_byte_tokenizer(tmp_path, special_tokens=["<|im_end|>", "<|mask|>", ""])


# ---------------------------------------------------------------- parity with transformers


def test_encode_decode_match_transformers(byte_tok: Tokenizer, hf_byte_tok, rng: random.Random) -> None:
    for _ in range(200):
        text = random_text(rng, 50, specials=DEFAULT_SPECIALS)
        for add_special in (False, True):
            ids = byte_tok.encode(text, add_special_tokens=add_special)
            assert ids == hf_byte_tok.encode(text, add_special_tokens=add_special)
        for skip in (False, True):
            assert byte_tok.decode(ids, skip_special_tokens=skip) == hf_byte_tok.decode(
                ids, skip_special_tokens=skip
            )
    # Ids the tokenizer would never emit in that order still decode the same (e.g. split UTF-8 sequences).
    for _ in range(50):
        ids = [rng.randrange(byte_tok.vocab_size) for _ in range(rng.randint(0, 30))]
        assert byte_tok.decode(ids) == hf_byte_tok.decode(ids)


def test_default_chat_template_matches_transformers(
    byte_tok: Tokenizer, hf_byte_tok, rng: random.Random
) -> None:
    for _ in range(60):
        messages = random_conversation(rng)
        for gen in (True, False):
            ours = byte_tok.apply_chat_template(messages, add_generation_prompt=gen)
            theirs = hf_byte_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
            assert ours == theirs
            # The tokenized prompt matches too (transformers tokenizes without adding special tokens).
            assert byte_tok.encode(ours) == hf_byte_tok.apply_chat_template(
                messages, tokenize=True, add_generation_prompt=gen, return_dict=False
            )
    messages = [{"role": "user", "content": "hi"}]
    assert byte_tok.apply_chat_template(messages) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


COMPLEX_TEMPLATE = """
{%- if messages[0]['role'] == 'system' -%}
    {%- set system_message = messages[0]['content'] -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set system_message = 'You are a helpful assistant.' -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{{- bos_token if bos_token is defined else '' -}}
<|im_start|>system
{{ system_message }}
{%- if tools %}

# Tools
{% for tool in tools %}
{{ tool | tojson(indent=2) }}
{% endfor %}
{%- endif %}
<|im_end|>
{% set ns = namespace(turns=0, last_user='', skipped=0) %}
{% for message in loop_messages %}
    {% if message['role'] == 'system' %}
        {{- raise_exception('System message must be first, found one at position ' ~ loop.index0) }}
    {% endif %}
    {% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
    {% endif %}
    {% if message['content'] | trim == '' %}
        {% set ns.skipped = ns.skipped + 1 %}
        {% continue %}
    {% endif %}
    {% set ns.turns = ns.turns + 1 %}
    {% if message['role'] == 'user' %}{% set ns.last_user = message['content'] %}{% endif %}
<|im_start|>{{ message['role'] }}
{{ message['content'] | trim }}
{%- if message.metadata is defined %} {{ message.metadata | tojson }}{% endif %}
{%- if message.reasoning_content is defined %} [r:{{ message.reasoning_content }}]{% endif %}

<|im_end|>
    {% if ns.turns >= max_turns | default(100) %}{% break %}{% endif %}
{% endfor %}
{% if add_generation_prompt %}
<|im_start|>assistant
{% if enable_thinking is defined and not enable_thinking %}
<think>

</think>

{% endif %}
{% endif %}
turns={{ ns.turns }} skipped={{ ns.skipped }} last={{ ns.last_user | length }}
date_len={{ strftime_now("%Y-%m-%d") | length }}{{ eos_token }}
"""


@pytest.fixture(scope="module")
def complex_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("complex_tok")
    write_byte_tokenizer(out, chat_template=COMPLEX_TEMPLATE)
    return out


def test_complex_template_matches_transformers(complex_dir: Path, rng: random.Random) -> None:
    transformers = pytest.importorskip("transformers")
    ours = Tokenizer.from_dir(complex_dir)
    theirs = transformers.AutoTokenizer.from_pretrained(str(complex_dir))
    for _ in range(60):
        messages = random_conversation(rng)
        for message in messages:
            r = rng.random()
            if r < 0.2:
                message["content"] = rng.choice(["", "   ", "\n"])
            elif r < 0.35:
                message["metadata"] = {"note": random_text(rng, 8), "n": rng.randint(0, 9), "html": "<b>&'"}
            elif r < 0.45 and message["role"] == "assistant":
                # Older names reach the template as reasoning_content too (transformers is given that name).
                field = rng.choice(["reasoning_content", "thinking", "reasoning"])
                message[field] = random_text(rng, 8)
            elif r < 0.5:
                message["tool_calls"] = None  # dropped like transformers does
        tools = None
        if rng.random() < 0.5:
            tools = [
                {
                    "type": "function",
                    "function": {
                        "name": f"tool_{k}",
                        "description": random_text(rng, 15) + " <b>&'",
                        "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}},
                    },
                }
                for k in range(rng.randint(1, 3))
            ]
        kwargs = {}
        if rng.random() < 0.6:
            kwargs["enable_thinking"] = rng.random() < 0.5
        if rng.random() < 0.4:
            kwargs["max_turns"] = rng.randint(1, 4)
        given = [  # what transformers needs to render the same: the reasoning under the template's name
            {**m, "reasoning_content": next(m[f] for f in ("reasoning_content", "thinking", "reasoning") if f in m)}
            if {"reasoning_content", "thinking", "reasoning"} & set(m) else m
            for m in messages
        ]
        for gen in (True, False):
            expected = theirs.apply_chat_template(
                given, tools=tools, tokenize=False, add_generation_prompt=gen, **kwargs
            )
            assert (
                ours.apply_chat_template(messages, add_generation_prompt=gen, tools=tools, **kwargs)
                == expected
            )
    assert "<think>" in ours.apply_chat_template([{"role": "user", "content": "x"}], enable_thinking=False)


def test_template_raise_exception_is_tokenizer_error(complex_dir: Path) -> None:
    jinja2 = pytest.importorskip("jinja2")
    transformers = pytest.importorskip("transformers")
    ours = Tokenizer.from_dir(complex_dir)
    theirs = transformers.AutoTokenizer.from_pretrained(str(complex_dir))
    cases = [
        ([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}], "roles must alternate"),
        (
            [
                {"role": "user", "content": "a"},
                {"role": "assistant", "content": "b"},
                {"role": "system", "content": "c"},
            ],
            "System message must be first, found one at position 2",
        ),
    ]
    for messages, message in cases:
        with pytest.raises(jinja2.TemplateError, match=message):
            theirs.apply_chat_template(messages, tokenize=False)
        with pytest.raises(TokenizerError, match=message) as info:
            ours.apply_chat_template(messages)
        assert "tokenizer_config.json" in str(info.value)


def test_template_runtime_error_names_source(tmp_path: Path) -> None:
    write_byte_tokenizer(tmp_path, chat_template="{{ messages[0]['content'] + 1 }}")
    with pytest.raises(TokenizerError, match="Rendering the chat template from .*tokenizer_config.json"):
        Tokenizer.from_dir(tmp_path).apply_chat_template([{"role": "user", "content": "x"}])


def test_template_sandbox_blocks_internals(tmp_path: Path) -> None:
    write_byte_tokenizer(tmp_path, chat_template="{% set ns = namespace() %}{% set ns._x = 1 %}{{ ns._x }}")
    with pytest.raises(TokenizerError, match="_x"):
        Tokenizer.from_dir(tmp_path).apply_chat_template([{"role": "user", "content": "x"}])
    write_byte_tokenizer(tmp_path, chat_template="{{ messages.__class__.__mro__ }}")
    with pytest.raises(TokenizerError):
        Tokenizer.from_dir(tmp_path).apply_chat_template([{"role": "user", "content": "x"}])


def test_chat_template_jinja_file_takes_precedence(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    write_byte_tokenizer(tmp_path)
    (tmp_path / "chat_template.jinja").write_text(
        "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}"
        "{% if add_generation_prompt %}>{% endif %}",
        encoding="utf-8",
    )
    messages = [{"role": "user", "content": "héllo 🎉"}, {"role": "assistant", "content": "ok"}]
    ours = Tokenizer.from_dir(tmp_path).apply_chat_template(messages)
    assert ours == "[user]héllo 🎉[assistant]ok>"
    theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    assert ours == theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def test_list_form_chat_template(tmp_path: Path) -> None:
    write_byte_tokenizer(tmp_path)
    messages = [{"role": "user", "content": "q"}]
    edit_config(
        tmp_path,
        chat_template=[
            {"name": "tool_use", "template": "TOOLS{{ messages[0].content }}"},
            {"name": "default", "template": "DEFAULT{{ messages[0].content }}"},
        ],
    )
    assert Tokenizer.from_dir(tmp_path).apply_chat_template(messages) == "DEFAULTq"
    edit_config(tmp_path, chat_template=[{"name": "rag", "template": "RAG{{ messages[0].content }}"}])
    assert Tokenizer.from_dir(tmp_path).apply_chat_template(messages) == "RAGq"
    edit_config(tmp_path, chat_template=[{"name": "rag"}])
    with pytest.raises(TokenizerError, match="chat_template"):
        Tokenizer.from_dir(tmp_path)


# ---------------------------------------------------------------- special token ids from the configs


def test_eos_ids_merge_generation_config(byte_dir: Path, tmp_path: Path) -> None:
    d = copy_dir(byte_dir, tmp_path / "tok")
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [257, 258, 257, 256]}))
    edit_config(d, eos_token={"content": "<|endoftext|>", "__type": "AddedToken"})
    assert Tokenizer.from_dir(d).eos_token_ids == [256, 257, 258]
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": 258}))
    assert Tokenizer.from_dir(d).eos_token_ids == [256, 258]
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": "<|im_end|>"}))
    with pytest.raises(TokenizerError, match="generation_config.json: eos_token_id"):
        Tokenizer.from_dir(d)


def test_mask_token_fallback(tmp_path: Path) -> None:
    write_byte_tokenizer(
        tmp_path, special_tokens=["<eos>", "<mask>", "[MASK]"], eos_token="<eos>", mask_token="<mask>"
    )
    assert Tokenizer.from_dir(tmp_path).mask_token_id == 257
    edit_config(tmp_path, mask_token=None)
    # "[MASK]" comes before "<mask>" in the candidate list.
    assert Tokenizer.from_dir(tmp_path).mask_token_id == 258
    (tmp_path / "tokenizer_config.json").unlink()
    tok = Tokenizer.from_dir(tmp_path)
    assert tok.mask_token_id == 258 and tok.eos_token_ids == [] and not tok.has_chat_template


# ---------------------------------------------------------------- sentencepiece


@pytest.fixture(scope="module")
def sp_model(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    gen = random.Random(1234)
    words = [
        "".join(gen.choice("abcdefghijklmnopqrstuvwxyzäöü") for _ in range(gen.randint(1, 8)))
        for _ in range(300)
    ]
    lines = [" ".join(gen.choice(words) for _ in range(gen.randint(3, 15))) for _ in range(2000)]
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines),
        model_writer=model,
        vocab_size=200,
        model_type="unigram",
        character_coverage=1.0,
        minloglevel=2,
    )
    return model.getvalue()


def sp_text(rng: random.Random, unseen: bool = True) -> str:
    # Mostly the training alphabet, with some characters the model has never seen (they become <unk>).
    alphabet = "abcdefghijklmnopqrstuvwxyzäöü    " + ("XYZ世🎉" if unseen else "")
    return "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 40)))


def test_sentencepiece_matches_sentencepiece(tmp_path: Path, sp_model: bytes, rng: random.Random) -> None:
    (tmp_path / "tokenizer.model").write_bytes(sp_model)
    ref = spm.SentencePieceProcessor(model_proto=sp_model)
    tok = Tokenizer.from_dir(tmp_path)
    # Without tokenizer_config.json the ids come from the model itself.
    assert tok.vocab_size == ref.get_piece_size() == 200
    assert tok.bos_token_id == ref.bos_id() and tok.eos_token_ids == [ref.eos_id()]
    assert tok.pad_token_id is None and tok.mask_token_id is None and not tok.has_chat_template
    assert tok.special_token_ids == {ref.unk_id(), ref.bos_id(), ref.eos_id()}
    assert tok.token_to_id(ref.id_to_piece(50)) == 50 and tok.token_to_id("no such piece") is None
    for _ in range(200):
        text = sp_text(rng)
        ids = tok.encode(text)
        assert ids == ref.encode(text)
        assert tok.encode(text, add_special_tokens=True) == ids  # no add_bos_token in a config
        assert tok.decode(ids) == ref.decode(ids)
        random_ids = [rng.randrange(ref.get_piece_size()) for _ in range(rng.randint(0, 20))]
        assert tok.decode(random_ids) == ref.decode(random_ids)


def test_sentencepiece_config_bos_and_added_tokens(
    tmp_path: Path, sp_model: bytes, rng: random.Random
) -> None:
    (tmp_path / "tokenizer.model").write_bytes(sp_model)
    ref = spm.SentencePieceProcessor(model_proto=sp_model)
    n = ref.get_piece_size()
    added = {
        "0": {"content": "<unk>", "special": True},
        "1": {"content": "<s>", "special": True},
        "2": {"content": "</s>", "special": True},
        str(n): {"content": "<|mask|>", "special": True},
        str(n + 1): {"content": "<|mask|>x", "special": False},
    }
    config = {
        "bos_token": "<s>",
        "eos_token": {"content": "</s>", "special": True},
        "add_bos_token": True,
        "add_eos_token": False,
        "added_tokens_decoder": added,
        "chat_template": "{% for m in messages %}{{ bos_token }}{{ m.content }}{{ eos_token }}{% endfor %}",
    }
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tok = Tokenizer.from_dir(tmp_path)
    assert tok.vocab_size == n + 2
    assert tok.bos_token_id == 1 and tok.eos_token_ids == [2]
    assert tok.mask_token_id == n  # found among the added tokens
    assert tok.special_token_ids == {0, 1, 2, n}
    assert tok.token_to_id("<|mask|>x") == n + 1
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == "<s>hi</s>"

    for _ in range(100):
        # Seen characters only: <unk> is an added token here, so it decodes as "<unk>", not " ⁇ ".
        a, b, c = sp_text(rng, unseen=False), sp_text(rng, unseen=False), sp_text(rng, unseen=False)
        b = b.lstrip("x")  # else "<|mask|>" + "x..." is rightly the longer added token "<|mask|>x"
        text = f"{a}<|mask|>{b}<|mask|>x{c}</s>"
        expected = [*ref.encode(a), n, *ref.encode(b), n + 1, *ref.encode(c), 2]
        assert tok.encode(text) == expected
        assert tok.encode(text, add_special_tokens=True) == [1, *expected]
        decoded = [ref.decode(ref.encode(part)) for part in (a, b, c)]
        assert tok.decode(expected) == f"{decoded[0]}<|mask|>{decoded[1]}<|mask|>x{decoded[2]}</s>"
        # Skipping drops <|mask|> and </s> but keeps the non-special added token.
        skipped = tok.decode([1, *expected], skip_special_tokens=True)
        # The pieces either side of a skipped token decode together, as one sentencepiece run.
        assert skipped == f"{ref.decode(ref.encode(a) + ref.encode(b))}<|mask|>x{decoded[2]}"

    unk_text = "ab世cd"
    assert ref.unk_id() in ref.encode(unk_text)
    assert tok.decode(ref.encode(unk_text)) == "ab<unk>cd"
    assert tok.decode(ref.encode(unk_text), skip_special_tokens=True) == "abcd"

    config["add_eos_token"] = True
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    assert Tokenizer.from_dir(tmp_path).encode("abc", add_special_tokens=True) == [1, *ref.encode("abc"), 2]


# ---------------------------------------------------------------- errors


def test_missing_dir_and_empty_dir(tmp_path: Path) -> None:
    with pytest.raises(TokenizerError, match="does not exist") as info:
        Tokenizer.from_dir(tmp_path / "nope")
    assert "nope" in str(info.value)
    with pytest.raises(TokenizerError) as info:
        Tokenizer.from_dir(tmp_path)
    message = str(info.value)
    assert "No tokenizer found" in message and str(tmp_path) in message
    assert "tokenizer.json" in message and "tokenizer.model" in message


@pytest.mark.parametrize("damage", ["garbage", "truncated", "lfs_pointer"])
def test_corrupt_tokenizer_json(byte_dir: Path, tmp_path: Path, damage: str) -> None:
    d = copy_dir(byte_dir, tmp_path / "tok")
    good = (byte_dir / "tokenizer.json").read_bytes()
    bad = {
        "garbage": b"\x00\xff\xfe" + os.urandom(200),
        "truncated": good[: len(good) // 2],
        "lfs_pointer": b"version https://git-lfs.github.com/spec/v1\noid sha256:abc\nsize 123\n",
    }[damage]
    (d / "tokenizer.json").write_bytes(bad)
    with pytest.raises(TokenizerError, match="Could not parse") as info:
        Tokenizer.from_dir(d)
    assert str(d / "tokenizer.json") in str(info.value) and "re-download" in str(info.value)


@pytest.mark.parametrize("damage", ["garbage", "truncated"])
def test_corrupt_tokenizer_model(tmp_path: Path, sp_model: bytes, damage: str) -> None:
    bad = b"not a sentencepiece model\x00\xff" * 8 if damage == "garbage" else sp_model[: len(sp_model) // 2]
    (tmp_path / "tokenizer.model").write_bytes(bad)
    with pytest.raises(TokenizerError, match="as a sentencepiece model") as info:
        Tokenizer.from_dir(tmp_path)
    assert str(tmp_path / "tokenizer.model") in str(info.value)


def test_corrupt_config_files(byte_dir: Path, tmp_path: Path) -> None:
    d = copy_dir(byte_dir, tmp_path / "tok")
    (d / "tokenizer_config.json").write_text('{"eos_token": "<|im_end|>", ')
    with pytest.raises(TokenizerError, match="Could not read .*tokenizer_config.json"):
        Tokenizer.from_dir(d)
    (d / "tokenizer_config.json").write_text("[1, 2]")
    with pytest.raises(TokenizerError, match="tokenizer_config.json must hold a JSON object"):
        Tokenizer.from_dir(d)
    (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": 5}))
    with pytest.raises(TokenizerError, match="eos_token must be a token string"):
        Tokenizer.from_dir(d)
    (d / "tokenizer_config.json").write_text("{}")
    (d / "generation_config.json").write_bytes(b"\xff\xfe")
    with pytest.raises(TokenizerError, match="generation_config.json"):
        Tokenizer.from_dir(d)


def test_bad_added_tokens_decoder(tmp_path: Path, sp_model: bytes) -> None:
    (tmp_path / "tokenizer.model").write_bytes(sp_model)
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"added_tokens_decoder": {"x": {"content": "a"}}})
    )
    with pytest.raises(TokenizerError, match="added_tokens_decoder entry 'x'"):
        Tokenizer.from_dir(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"add_bos_token": "yes"}))
    with pytest.raises(TokenizerError, match="add_bos_token must be true or false"):
        Tokenizer.from_dir(tmp_path)


@pytest.mark.parametrize("where", ["config", "jinja_file"])
def test_template_syntax_error_names_file(tmp_path: Path, where: str) -> None:
    broken = "{% for m in messages %}{{ m.content }"
    if where == "config":
        write_byte_tokenizer(tmp_path, chat_template=broken)
        source = "tokenizer_config.json"
    else:
        write_byte_tokenizer(tmp_path)
        (tmp_path / "chat_template.jinja").write_text(broken)
        source = "chat_template.jinja"
    tok = Tokenizer.from_dir(tmp_path)  # loads: plain prompts still work
    assert tok.has_chat_template and tok.encode("ok") == [111, 107]
    with pytest.raises(TokenizerError, match="syntax error") as info:
        tok.apply_chat_template([{"role": "user", "content": "x"}])
    assert str(tmp_path / source) in str(info.value)


def test_no_chat_template(tmp_path: Path) -> None:
    write_byte_tokenizer(tmp_path, chat_template=None)
    tok = Tokenizer.from_dir(tmp_path)
    assert not tok.has_chat_template
    with pytest.raises(TokenizerError, match="no chat template") as info:
        tok.apply_chat_template([{"role": "user", "content": "x"}])
    assert "plain prompt string" in str(info.value)


@pytest.mark.parametrize(
    ("messages", "problem"),
    [
        ("hello", "messages must be a list"),
        ({"role": "user", "content": "x"}, "messages must be a list"),
        (["hello"], r"messages\[0\] must be a dict"),
        ([{"role": "user"}], r"messages\[0\] must be a dict with \"role\" and \"content\""),
        ([{"role": "user", "content": "a"}, {"content": "b"}], r"messages\[1\]"),
        ([{"role": None, "content": "a"}], r"messages\[0\]\[\"role\"\] must be a string"),
    ],
)
def test_bad_messages(byte_tok: Tokenizer, messages, problem: str) -> None:
    with pytest.raises(TokenizerError, match=problem):
        byte_tok.apply_chat_template(messages)


def test_bad_encode_decode_inputs(byte_tok: Tokenizer) -> None:
    with pytest.raises(TokenizerError, match="encode\\(\\) takes a str"):
        byte_tok.encode(b"bytes")  # type: ignore[arg-type]
    with pytest.raises(TokenizerError, match="outside the tokenizer's vocab"):
        byte_tok.decode([1, byte_tok.vocab_size])
    with pytest.raises(TokenizerError, match="outside the tokenizer's vocab"):
        byte_tok.decode([-1])
    with pytest.raises(TokenizerError, match="int token ids"):
        byte_tok.decode([1.5])  # type: ignore[list-item]
    with pytest.raises(TokenizerError, match="tools must be a list"):
        byte_tok.apply_chat_template([{"role": "user", "content": "x"}], tools="search")  # type: ignore[arg-type]


def test_default_template_constant_is_what_gets_written(byte_dir: Path) -> None:
    config = json.loads((byte_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    assert config["chat_template"] == DEFAULT_CHAT_TEMPLATE
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert (config["eos_token"], config["pad_token"], config["mask_token"]) == (
        "<|im_end|>",
        "<|endoftext|>",
        "<|mask|>",
    )
