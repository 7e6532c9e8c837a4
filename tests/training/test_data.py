"""Training data: each format loads, errors name the file, the loss mask covers exactly the
assistant's tokens (tiny word-level tokenizer with a chat template; the real SmolLM2 in a slow
test)."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from specdec.training.data import (
    Conversation,
    has_answers,
    load_conversations,
    load_file,
    prompts_of,
    shorten_turns,
    tokenize,
    tokenize_all,
)

WORDS = "hi hello there more ok sure be brief what is two plus four six long".split()
SPECIALS = ["<unk>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>",
            "<|nl|>", "<think>", "</think>"]
# <|end|> closes every turn; <|nl|> after it plays ChatML's "\n": part of the template, not of
# what the assistant generates, so it must stay outside the loss mask.
TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} <|end|> "
            "<|nl|> {% endfor %}{% if add_generation_prompt %}<|assistant|> {% endif %}")
# Like Qwen3: only the final assistant turn gets an (empty) think block, so rendering a prefix
# of the conversation is not a prefix of rendering all of it.
THINK_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|> {% if m['role'] == 'assistant' "
                  "and loop.last %}<think> </think> {% endif %}{{ m['content'] }} <|end|> "
                  "{% endfor %}{% if add_generation_prompt %}<|assistant|> {% endif %}")

CHAT = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello there"},
        {"role": "user", "content": "more"}, {"role": "assistant", "content": "ok sure"}]


def make_tokenizer(template: str = TEMPLATE):
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(SPECIALS + WORDS)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.add_special_tokens([AddedToken(t, special=True) for t in SPECIALS[:8]])
    backend.add_tokens(SPECIALS[8:])  # like Qwen3's <think>: added, not special
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>",
                                  eos_token="</s>")
    tok.chat_template = template
    return tok


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer()


@pytest.fixture(autouse=True)
def datasets_cache(tmp_path, monkeypatch):
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf_cache"))


def write(path, records, jsonl=False):
    path.write_text("".join(json.dumps(r) + "\n" for r in records) if jsonl
                    else json.dumps(records))
    return path


def conv(messages, plain=False):
    return Conversation([dict(m) for m in messages], "mem.json", 7, plain=plain)


FORMAT_CASES = {
    "sharegpt": ({"id": "a", "conversations": [{"from": "system", "value": "be brief"},
                                               {"from": "human", "value": "hi"},
                                               {"from": "gpt", "value": "hello"}]},
                 [("system", "be brief"), ("user", "hi"), ("assistant", "hello")]),
    "messages": ({"messages": [{"role": "user", "content": "hi"},
                               {"role": "assistant", "content": "hello"}]},
                 [("user", "hi"), ("assistant", "hello")]),
    "turns": ({"question_id": 1, "category": "writing", "turns": ["hi", "more"]},
              [("user", "hi"), ("user", "more")]),
    "alpaca": ({"instruction": "what is two plus four", "input": "", "output": "six"},
               [("user", "what is two plus four"), ("assistant", "six")]),
    "code_alpaca": ({"instruction": "what is", "input": "two plus four", "response": "six"},
                    [("user", "what is\n\ntwo plus four"), ("assistant", "six")]),
    "gsm8k": ({"question": "two plus four", "answer": "six\n#### 6"},
              [("user", "two plus four"), ("assistant", "six\n#### 6")]),
    "text": ({"text": "a long text"}, [("assistant", "a long text")]),
}


@pytest.mark.parametrize("jsonl", [False, True])
@pytest.mark.parametrize("name", sorted(FORMAT_CASES))
def test_each_format_loads(tmp_path, name, jsonl):
    record, expected = FORMAT_CASES[name]
    path = write(tmp_path / ("d.jsonl" if jsonl else "d.json"), [record, record], jsonl)
    convs = load_conversations([path])
    assert len(convs) == 2 and [c.index for c in convs] == [0, 1]
    assert [(m["role"], m["content"]) for m in convs[0].messages] == expected
    assert convs[0].source == str(path) and convs[0].plain == (name == "text")


def test_unknown_format_names_file_and_fields(tmp_path):
    path = write(tmp_path / "odd.jsonl", [{"prompt": "x", "task_id": 1}], jsonl=True)
    with pytest.raises(ValueError, match=r"odd\.jsonl.*\['prompt', 'task_id'\].*sharegpt"):
        load_conversations([path])


def test_blank_turns_skipped_and_counted(tmp_path, caplog):
    records = [{"conversations": [{"from": "human", "value": "hi"}]},
               {"conversations": [{"from": "human", "value": "  "}]},
               {"conversations": [{"from": "gpt", "value": "bot speaks first, alone"}]},
               {"conversations": []},
               {"conversations": [{"from": "gpt", "value": "x"}, {"from": "human", "value": "ok"}]}]
    path = write(tmp_path / "s.json", records)
    loaded = load_file(path)
    assert loaded.format == "sharegpt" and loaded.skipped == 3
    assert [c.index for c in loaded.conversations] == [0, 4]
    assert loaded.conversations[1].messages == [{"role": "user", "content": "ok"}]
    with caplog.at_level(logging.WARNING):
        load_conversations([path])
    assert "skipped 3 of 5" in caplog.text and "s.json" in caplog.text


def test_all_blank_or_empty_files_error(tmp_path):
    blank = write(tmp_path / "blank.json", [{"instruction": "hi", "input": "", "output": " "}])
    with pytest.raises(ValueError, match=r"blank\.json.*all 1 records"):
        load_conversations([blank])
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(ValueError, match=r"empty\.jsonl.*empty"):
        load_conversations([empty])
    with pytest.raises(ValueError, match=r"none\.json.*no records"):
        load_conversations([write(tmp_path / "none.json", [])])
    with pytest.raises(FileNotFoundError, match="missing.json"):
        load_conversations([tmp_path / "missing.json"])


def test_unknown_speaker_names_file_and_record(tmp_path):
    path = write(tmp_path / "s.json", [{"conversations": [{"from": "human", "value": "hi"}]},
                                       {"conversations": [{"from": "robot", "value": "hi"}]}])
    with pytest.raises(ValueError, match=r"s\.json: record 1.*'robot'.*allowed"):
        load_conversations([path])


def test_limit_is_a_seeded_subset_in_file_order(tmp_path):
    path = write(tmp_path / "g.jsonl", [{"question": f"q{i}", "answer": "a"} for i in range(20)],
                 jsonl=True)
    a = [c.index for c in load_conversations([path], limit=5, seed=1)]
    assert a == sorted(a) and len(a) == 5
    assert a == [c.index for c in load_conversations([path], limit=5, seed=1)]
    assert a != [c.index for c in load_conversations([path], limit=5, seed=2)]


def test_prompts_of_and_has_answers():
    c = conv(CHAT + [{"role": "assistant", "content": "six"}])
    assert prompts_of(c) == CHAT[:3] and has_answers(c)
    turns = conv([{"role": "user", "content": "hi"}, {"role": "user", "content": "more"}])
    assert prompts_of(turns) == turns.messages and not has_answers(turns)
    assert prompts_of(conv([{"role": "assistant", "content": "text"}], plain=True)) == []


def masked_runs(ex, tok) -> list[str]:
    """The decoded runs of consecutive masked tokens."""
    runs, cur = [], []
    for i, m in zip(ex.input_ids.tolist(), ex.loss_mask.tolist()):
        if m:
            cur.append(i)
        elif cur:
            runs, cur = runs + [cur], []
    runs += [cur] if cur else []
    return [tok.decode(r) for r in runs]


def test_loss_mask_exactly_on_assistant_tokens(tok):
    c = conv([{"role": "system", "content": "be brief"}] + CHAT)
    ex = tokenize(c, tok, max_length=100)
    assert ex.input_ids.dtype == torch.int64 and ex.loss_mask.dtype == torch.bool
    full = tok.apply_chat_template(c.messages, tokenize=False)
    assert ex.input_ids.tolist() == tok(full, add_special_tokens=False)["input_ids"]
    assert masked_runs(ex, tok) == ["hello there <|end|>", "ok sure <|end|>"]
    unmasked = tok.decode(ex.input_ids[~ex.loss_mask])
    assert unmasked == ("<s> <|system|> be brief <|end|> <|nl|> <|user|> hi <|end|> <|nl|> "
                        "<|assistant|> <|nl|> <|user|> more <|end|> <|nl|> <|assistant|> <|nl|>")


def test_loss_mask_when_history_renders_differently():
    tok = make_tokenizer(THINK_TEMPLATE)
    ex = tokenize(conv(CHAT), tok, max_length=100)
    assert masked_runs(ex, tok) == ["hello there <|end|>", "<think> </think> ok sure <|end|>"]


def test_trailing_user_turn_dropped_and_truncation(tok):
    ex = tokenize(conv(CHAT + [{"role": "user", "content": "more"}]), tok, max_length=100)
    assert tok.decode(ex.input_ids[-2:]) == "<|end|> <|nl|>"
    short = tokenize(conv(CHAT), tok, max_length=6)
    assert short.input_ids.tolist() == ex.input_ids[:6].tolist()
    assert short.loss_mask.tolist() == ex.loss_mask[:6].tolist()
    with pytest.raises(ValueError, match="max_length"):
        tokenize(conv(CHAT), tok, max_length=0)


def test_plain_text_has_loss_everywhere_and_no_template(tok):
    ex = tokenize(conv([{"role": "assistant", "content": "hello there ok"}], plain=True), tok, 2)
    assert tok.decode(ex.input_ids) == "hello there" and ex.loss_mask.all()


def test_conversation_without_answers_errors(tok):
    with pytest.raises(ValueError, match=r"mem\.json: record 7 .*no assistant.*--regenerate"):
        tokenize(conv(CHAT[:1]), tok, max_length=100)


def test_tokenize_all_drops_examples_without_loss(tok, caplog):
    long_prompt = [{"role": "user", "content": "hi " * 20}, {"role": "assistant", "content": "ok"}]
    with caplog.at_level(logging.WARNING):
        ds = tokenize_all([conv(CHAT), conv(long_prompt)], tok, max_length=12)
    assert ds.column_names == ["input_ids", "loss_mask"] and len(ds) == 1
    assert "dropped 1 of 2" in caplog.text
    assert ds[0]["input_ids"] == tokenize(conv(CHAT), tok, 12).input_ids.tolist()
    with pytest.raises(ValueError, match="max_length=12"):
        tokenize_all([conv(long_prompt)], tok, max_length=12)


def test_shorten_turns_keeps_answers_and_the_prompt_ends(tok):
    words = " ".join(f"w{i}" for i in range(30))
    long_prompt = [{"role": "user", "content": words}, {"role": "assistant", "content": words}]
    ds = tokenize_all([conv(long_prompt)], tok, max_length=200, max_turn_tokens=6)
    short = shorten_turns(conv(long_prompt), tok, 6)
    assert short.messages[1] == long_prompt[1], "assistant turns are never shortened"
    user = short.messages[0]["content"]
    assert user.startswith(tok.decode(tok(words, add_special_tokens=False)["input_ids"][:3]))
    assert "\n...\n" in user and len(tok(user)["input_ids"]) < 12
    assert ds[0]["input_ids"] == tokenize(short, tok, 200).input_ids.tolist()
    assert shorten_turns(conv(CHAT), tok, 6).messages == CHAT, "short turns are left alone"


@pytest.mark.slow
def test_loss_mask_on_smollm2_chat_template(smollm2_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    c = conv([{"role": "user", "content": "Hi!"},
              {"role": "assistant", "content": "Hello, how can I help?"},
              {"role": "user", "content": "Say 2+2."},
              {"role": "assistant", "content": " 4\n\n(four)"}])
    ex = tokenize(c, tok, max_length=512)
    full = tok.apply_chat_template(c.messages, tokenize=False)
    assert ex.input_ids.tolist() == tok(full, add_special_tokens=False)["input_ids"]
    assert masked_runs(ex, tok) == ["Hello, how can I help?<|im_end|>", " 4\n\n(four)<|im_end|>"]
    assert tok.decode(ex.input_ids[-1]) == "\n" and not ex.loss_mask[-1]
    assert "<|im_start|>assistant\n" not in "".join(masked_runs(ex, tok))
