"""A tiny random Llama with a byte-level BPE tokenizer (what llguidance needs for grammars) and a
chat template, its LM head scaled up so that its greedy choices are definite."""

from __future__ import annotations

from pathlib import Path

CORPUS = [
    '{"name": "Bob", "age": 12}', '{"city": "Paris", "size": 3}', "yes no maybe",
    '[1, 2, 3, 4, 5]', "the cat sat on the mat", '{"a": [true, false, null]}',
    "hello world, hello there", "0123456789 -+.eE", '{"ok": true}',
]
SPECIALS = ["<unk>", "<s>", "</s>"]


def byte_tokenizer_model(folder: Path) -> Path:
    from cli_helpers import CHAT_TEMPLATE
    from conftest import make_tiny_model
    from safetensors.torch import load_file, save_file
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE(unk_token=None))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(CORPUS * 4, trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>",
                                  unk_token="<unk>")
    tok.chat_template = CHAT_TEMPLATE
    vocab = backend.get_vocab_size()
    make_tiny_model(folder, seed=3, vocab_size=vocab, eos_token_id=2, bos_token_id=1)
    tok.save_pretrained(folder)
    weights = load_file(folder / "model.safetensors")
    weights["lm_head.weight"] = weights["lm_head.weight"] * 4.0
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def byte_model_fixture():
    """A session fixture (import it into a test module): the model's folder."""
    import pytest

    @pytest.fixture(scope="session")
    def byte_model(tmp_path_factory) -> str:
        return str(byte_tokenizer_model(tmp_path_factory.mktemp("byte_model")))

    return byte_model
