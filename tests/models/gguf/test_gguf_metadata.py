"""transformers' GGUF readers answered from our header (specdec/models/gguf/metadata.py): each
answer is what transformers reads from the same file (values and their types), and the folder
aliases.write_metadata_files makes (config.json, the tokenizer's files) is the one it made with
transformers reading the file itself, without gguf-py's reader ever built, for tiny llama /
qwen2 / qwen3 files, a sentencepiece one and the real SmolLM2 (slow); a file transformers
special-cases is read by transformers, saying why.
"""

from __future__ import annotations

import json
import logging
import string
from contextlib import nullcontext
from pathlib import Path

import pytest
from gguf_helpers import TinyShape, ascii_tokenizer, write_tiny_gguf

from specdec.models import aliases
from specdec.models.gguf import metadata as gguf_metadata
from specdec.models.gguf.file import open_gguf
from specdec.models.gguf.metadata import checkpoint_metadata, reader_metadata, reading_from_header

TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}</s>\n"
            "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
TEXTS = ["hello world", "<s>hi</s> <|im_start|>user <think>x", "Hello 123\nabc  de"]
STRING_ARRAYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges")


def sentencepiece(w) -> None:
    """A llama.cpp sentencepiece tokenizer with merges, control / user-defined tokens, a chat
    template, flags, and one-element arrays (transformers' GGUFReader unwraps them)."""
    specials = ["<unk>", "<s>", "</s>", "<|im_start|>", "<think>"]
    pieces = ["\u2581", *string.ascii_lowercase, *("\u2581" + c for c in string.ascii_lowercase),
              *string.digits, *string.ascii_uppercase, "he", "ll"]
    tokens = specials + pieces
    assert len(tokens) == TinyShape().vocab
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([2, 3, 3, 3, 4] + [1] * len(pieces))
    w.add_token_scores([-float(i) for i in range(len(tokens))])
    w.add_token_merges(["\u2581 " + c for c in string.ascii_lowercase] + ["h e", "l l"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_pad_token_id(2)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    w.add_add_space_prefix(True)
    w.add_chat_template(TEMPLATE)
    w.add_array("general.languages", ["en"])
    w.add_array("tiny.one_number", [7])


FILES = {
    "llama": dict(arch="llama"),
    "qwen2": dict(arch="qwen2", tied=False),
    "qwen3": dict(arch="qwen3", shape=TinyShape(hidden=256, heads=2, kv_heads=1,
                                                intermediate=256)),
    "llama-sentencepiece": dict(arch="llama", tokenizer=sentencepiece),
}


def one_merge(w) -> None:
    """A list of one element in a mapped key: transformers' GGUFReader makes it the element."""
    ascii_tokenizer(w)
    w.add_token_merges(["a b"])


def _file(tmp_path: Path, **kw) -> Path:
    """A tiny model alone in its folder (no tokenizer file beside it for transformers to read)."""
    path = tmp_path / "in" / "model.gguf"
    path.parent.mkdir(parents=True, exist_ok=True)
    return write_tiny_gguf(path, kind="Q8_0", quantize=False, **kw)


def typed(value):
    """``value`` with the type of every element beside it (1 == 1.0 == True otherwise)."""
    if isinstance(value, dict):
        return {k: typed(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value).__name__, [typed(v) for v in value]
    return type(value).__name__, value


# ---- each answer is transformers' --------------------------------------------------------


@pytest.mark.parametrize("name", FILES)
@pytest.mark.parametrize("arrays", [(), STRING_ARRAYS])
def test_reader_metadata_is_read_gguf_metadata(name, arrays, tmp_path):
    from transformers.integrations.gguf import read_gguf_metadata

    path = _file(tmp_path, **FILES[name])
    ours, theirs = reader_metadata(open_gguf(path), arrays), read_gguf_metadata(str(path), arrays)
    assert typed(ours) == typed(theirs)
    assert list(ours[0]) == list(theirs[0])  # the file's order


MORE = {"one-merge": dict(tokenizer=one_merge), **{a: dict(arch=a) for a in
                                                    ("phi3", "starcoder2", "gpt2", "mamba")}}


@pytest.mark.parametrize("name", [*FILES, *MORE])
def test_checkpoint_metadata_is_load_gguf_checkpoint(name, tmp_path):
    """Generic over transformers' mapping: architectures specdec does not run map the same."""
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    path = _file(tmp_path, **{**FILES, **MORE}[name])
    ours = checkpoint_metadata(open_gguf(path))
    assert ours is not None
    assert typed(ours) == typed(load_gguf_checkpoint(str(path), return_tensors=False))
    if name == "one-merge":
        assert ours["tokenizer"]["merges"] == "a b"


def test_transformers_defaults_of_an_architecture_are_kept(tmp_path, monkeypatch):
    from transformers.integrations import GGUF_CONFIG_DEFAULTS_MAPPING
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    monkeypatch.setitem(GGUF_CONFIG_DEFAULTS_MAPPING, "llama",
                        {"norm_topk_prob": True, "rms_norm_eps": 0.5})  # the file's wins
    path = _file(tmp_path)
    ours = checkpoint_metadata(open_gguf(path))
    assert typed(ours) == typed(load_gguf_checkpoint(str(path), return_tensors=False))
    assert ours["config"]["norm_topk_prob"] is True and ours["config"]["rms_norm_eps"] != 0.5


@pytest.mark.parametrize("kw, why", [
    (dict(arch="stablelm"), "special-cases 'stablelm'"),
    (dict(arch="qwen2moe"), "special-cases 'qwen2moe'"),
    (dict(arch="falcon"), "special-cases 'falcon'"),
    (dict(arch="llama", name="mistral"), "named 'mistral'"),
    (dict(arch="bert"), "maps no GGUF architecture 'bert'"),
])
def test_a_file_transformers_special_cases_is_left_to_it(kw, why, tmp_path, caplog):
    path = _file(tmp_path, **kw)
    with caplog.at_level(logging.INFO, logger="specdec"):
        assert checkpoint_metadata(open_gguf(path)) is None
    assert why in caplog.text and str(path) in caplog.text


def test_a_string_decoded_with_replacements_is_left_to_transformers(tmp_path, caplog,
                                                                   monkeypatch):
    def replaced(w):
        sentencepiece(w)
        w.add_string("tiny.note", "bad \ufffd byte")

    path = _file(tmp_path, tokenizer=replaced)
    f = open_gguf(path)
    assert gguf_metadata.unreadable(f) == "metadata 'tiny.note' is not plain UTF-8"
    with caplog.at_level(logging.INFO, logger="specdec"):
        assert checkpoint_metadata(f) is None
    assert "tiny.note" in caplog.text
    expected = _transformers_folder(path, tmp_path / "theirs", monkeypatch)
    with caplog.at_level(logging.INFO, logger="specdec"):
        aliases.write_metadata_files(path, tmp_path / "ours")
    assert "metadata read by transformers' readers: metadata 'tiny.note'" in caplog.text
    assert _folder(tmp_path / "ours") == expected


def test_the_readers_answer_for_this_file_only_and_are_put_back(tmp_path):
    import transformers.integrations.gguf as tf_gguf
    import transformers.integrations.gguf.reader as tf_reader
    import transformers.modeling_gguf_pytorch_utils as tf_checkpoint

    ours = open_gguf(_file(tmp_path))
    other = write_tiny_gguf(tmp_path / "other.gguf", arch="qwen2", kind="Q8_0", quantize=False)
    before = (tf_gguf.read_gguf_metadata, tf_reader.read_gguf_metadata,
              tf_checkpoint.load_gguf_checkpoint)
    expected = before[0](str(other))
    with pytest.raises(RuntimeError, match="inside"), reading_from_header(ours):
        assert tf_gguf.read_gguf_metadata is not before[0]
        assert typed(tf_gguf.read_gguf_metadata(str(other))) == typed(expected)
        assert tf_checkpoint.load_gguf_checkpoint(str(other))["config"]["model_type"] == "qwen2"
        raise RuntimeError("inside")
    assert (tf_gguf.read_gguf_metadata, tf_reader.read_gguf_metadata,
            tf_checkpoint.load_gguf_checkpoint) == before


def test_each_answer_is_a_new_dict(tmp_path):
    import transformers.modeling_gguf_pytorch_utils as tf_checkpoint

    path = _file(tmp_path)
    with reading_from_header(open_gguf(path)):
        first = tf_checkpoint.load_gguf_checkpoint(str(path))
        first["config"]["model_type"] = "changed"
        assert tf_checkpoint.load_gguf_checkpoint(str(path))["config"]["model_type"] == "llama"


# ---- the folder is transformers' ---------------------------------------------------------


def _folder(out: Path) -> dict:
    return {p.name: json.loads(p.read_text()) if p.suffix == ".json" else p.read_text()
            for p in sorted(out.iterdir())}


def _transformers_folder(path: Path, out: Path, monkeypatch) -> dict:
    """The folder as write_metadata_files made it before: transformers reading the file."""
    with monkeypatch.context() as m:
        m.setattr(gguf_metadata, "reading_from_header", lambda f: nullcontext())
        aliases.write_metadata_files(path, out)
    return _folder(out)


def _no_file_reader(monkeypatch) -> None:
    """gguf-py's GGUFReader and transformers' own header reader fail if used."""
    import gguf
    import transformers.integrations.gguf.reader as tf_reader

    def refuse(*a, **k):
        raise AssertionError("the file was read by transformers or gguf-py")

    monkeypatch.setattr(gguf, "GGUFReader", refuse)
    monkeypatch.setattr(tf_reader, "_mapped", refuse)


def _same_tokenizers(a: Path, b: Path, texts: list[str]) -> None:
    from transformers import AutoTokenizer

    ta, tb = AutoTokenizer.from_pretrained(a), AutoTokenizer.from_pretrained(b)
    assert ta.get_vocab() == tb.get_vocab() and len(ta) == len(tb)
    assert ta.all_special_tokens == tb.all_special_tokens
    assert ta.added_tokens_decoder == tb.added_tokens_decoder
    assert ta.chat_template == tb.chat_template
    for text in texts:
        assert ta(text)["input_ids"] == tb(text)["input_ids"]
    if ta.chat_template:
        chat = [{"role": "user", "content": "hi <think>"}, {"role": "assistant", "content": "ok"}]
        assert (ta.apply_chat_template(chat, add_generation_prompt=True)
                == tb.apply_chat_template(chat, add_generation_prompt=True))


@pytest.mark.parametrize("name", FILES)
def test_the_folder_is_transformers_without_reading_the_file_again(name, tmp_path, monkeypatch):
    path = _file(tmp_path, **FILES[name])
    expected = _transformers_folder(path, tmp_path / "theirs", monkeypatch)
    assert {"config.json", "tokenizer.json", "tokenizer_config.json"} <= set(expected)
    _no_file_reader(monkeypatch)
    aliases.write_metadata_files(path, tmp_path / "ours")
    assert _folder(tmp_path / "ours") == expected
    monkeypatch.undo()
    _same_tokenizers(tmp_path / "ours", tmp_path / "theirs", TEXTS)


def test_a_file_left_to_transformers_makes_its_folder(tmp_path, monkeypatch, caplog):
    path = _file(tmp_path, name="mistral")  # transformers reads it as mistral
    expected = _transformers_folder(path, tmp_path / "theirs", monkeypatch)
    with caplog.at_level(logging.INFO, logger="specdec"):
        aliases.write_metadata_files(path, tmp_path / "ours")
    assert "named 'mistral'" in caplog.text
    assert _folder(tmp_path / "ours") == expected
    assert expected["config.json"]["model_type"] == "mistral"


@pytest.mark.slow
def test_smollm2_folder_is_transformers(smollm2_dir, tmp_path, monkeypatch):
    from transformers.integrations.gguf import read_gguf_metadata
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    path = tmp_path / "in" / "model.gguf"  # alone: the cache's tokenizer.json is not read
    path.parent.mkdir()
    path.symlink_to((smollm2_dir / aliases.GGUF_NAME).resolve())
    f = open_gguf(path)
    assert typed(reader_metadata(f, STRING_ARRAYS)) == typed(read_gguf_metadata(str(path),
                                                                                 STRING_ARRAYS))
    # transformers reads the file three times below (checkpoint, config, tokenizer): gguf-py
    # parses it once for the three (its 49k-token vocabulary field by field in Python, ~4 s
    # each; a read-only memory map: the same values)
    with aliases._gguf_parsed_once():
        assert typed(checkpoint_metadata(f)) == typed(load_gguf_checkpoint(str(path)))
        expected = _transformers_folder(path, tmp_path / "theirs", monkeypatch)
    _no_file_reader(monkeypatch)
    aliases.write_metadata_files(path, tmp_path / "ours")
    assert _folder(tmp_path / "ours") == expected
    monkeypatch.undo()
    chat_texts = ["<|im_start|>user\nWhat is 2+2?<|im_end|>\n", "Hello, world!  \t 12345 café"]
    _same_tokenizers(tmp_path / "ours", tmp_path / "theirs", TEXTS + chat_texts)


@pytest.mark.parametrize("loose", [("tokenizer.json",),
                                   ("tokenizer.json", "tokenizer_config.json", "config.json")])
def test_a_gguf_in_an_hf_folder_keeps_its_own_tokenizer(loose, tmp_path, monkeypatch):
    """llama.cpp's converter writes the .gguf into the HF folder it converted: the files there
    (another tokenizer here: no chat template, no <s> / </s>; another config) are not the
    file's, and the GGUF is the source of its config and tokenizer (issue 46)."""
    from specdec.models.loader import load_hf_config, resolve_model_path
    from specdec.models.tokenizer import load_tokenizer

    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    other = tmp_path / "other"
    aliases.write_metadata_files(_file(tmp_path / "o", arch="qwen2"), other)  # ASCII, no template
    hf = tmp_path / "hf"
    hf.mkdir()
    for name in loose:
        (hf / name).write_bytes((other / name).read_bytes())
    path = write_tiny_gguf(hf / "model-q8_0.gguf", kind="Q8_0", quantize=False,
                           tokenizer=sentencepiece)
    folder = resolve_model_path(str(path))
    tok = load_tokenizer(folder)
    assert tok.chat_template == TEMPLATE
    assert (tok.bos_token, tok.eos_token, tok.bos_token_id, tok.eos_token_id) == (
        "<s>", "</s>", 1, 2)
    assert tok.convert_ids_to_tokens([3, 4]) == ["<|im_start|>", "<think>"]
    assert load_hf_config(folder).model_type == "llama"
    alone = tmp_path / "alone"  # the same file in a folder of its own: the same files
    alone.mkdir()
    (alone / "model.gguf").symlink_to(path)
    aliases.write_metadata_files(alone / "model.gguf", tmp_path / "expected")
    expected, got = _folder(tmp_path / "expected"), _folder_files(folder)
    for config in (expected["config.json"], got["config.json"]):
        config.pop("_name_or_path")  # the file's folder
    assert {name: got[name] for name in expected} == expected


def _folder_files(folder: Path) -> dict:
    """``_folder`` of a GGUF's folder, but for its model.gguf."""
    return {p.name: json.loads(p.read_text()) if p.suffix == ".json" else p.read_text()
            for p in sorted(folder.iterdir()) if p.name != aliases.GGUF_NAME}


def test_a_folder_made_from_the_loose_tokenizer_is_made_again(tmp_path, monkeypatch):
    """What an earlier version made of such a file (its folder named by the path, size and
    mtime alone, holding the loose tokenizer) is replaced by the file's own, and removed."""
    import hashlib

    from specdec.models.loader import resolve_model_path
    from specdec.models.tokenizer import load_tokenizer

    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    other = tmp_path / "other"
    aliases.write_metadata_files(_file(tmp_path / "o", arch="qwen2"), other)
    path = write_tiny_gguf(tmp_path / "m.gguf", kind="Q8_0", quantize=False,
                           tokenizer=sentencepiece)
    st = path.stat()
    source = f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}"
    old = tmp_path / "cache" / "gguf" / hashlib.blake2b(source.encode(), digest_size=8).hexdigest()
    old.mkdir(parents=True)
    (old / aliases.GGUF_NAME).symlink_to(path)
    aliases.write_metadata_files(path, old)
    (old / "tokenizer_config.json").unlink()
    (old / "tokenizer.json").write_bytes((other / "tokenizer.json").read_bytes())
    (old / ".complete").write_text(f"{aliases.LAYOUT} {source}\n")
    folder = resolve_model_path(str(path))
    assert folder != old and not old.exists()
    assert load_tokenizer(folder).chat_template == TEMPLATE
