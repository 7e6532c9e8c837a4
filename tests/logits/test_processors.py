"""RequestLogits: a tree node's row is processed exactly (bitwise) as plain decoding processes the
row of that position once the node's path was emitted; each option does what its docstring says."""

from __future__ import annotations

import copy

import pytest
import torch

from specdec.logits.processors import RequestLogits
from specdec.sampling_params import SamplingParams

V = 40
PROMPT = [3, 4, 5, 3]
OUTPUT = [7, 7, 9, 11, 12]
# a tree: 0 -> 1 -> 2, 0 -> 3, root -> 4 (tokens repeat the output and each other)
TOKENS, PARENTS = [7, 9, 7, 13, 14], [-1, 0, 1, 0, -1]


def _paths() -> list[list[int]]:
    paths = [[]]
    for t, p in zip(TOKENS, PARENTS):
        paths.append(paths[p + 1] + [t])
    return paths


OPTIONS = {
    "bias": dict(logit_bias={7: -3.5, 13: 2.25, 39: 100.0}),
    "frequency": dict(frequency_penalty=0.7),
    "presence": dict(presence_penalty=-1.3),
    "repetition": dict(repetition_penalty=1.7),
    "all": dict(logit_bias={9: 1.5}, frequency_penalty=0.4, presence_penalty=0.9,
                repetition_penalty=0.8, min_tokens=7, bad_words=["x"]),
    "min_tokens": dict(min_tokens=7, stop_token_ids=[5]),
    "bad_words": dict(bad_words=["x"]),
}
BAD = [[9, 7], [14], [12, 13, 20]]  # 9 then 7; 14 anywhere; 12, 13 then 20


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("name", list(OPTIONS))
def test_each_node_row_is_plain_decodings_row_after_its_path(name, dtype):
    params = SamplingParams(temperature=0, **OPTIONS[name])
    bad = BAD if params.bad_words else []
    torch.manual_seed(0)
    rows = torch.randn(1 + len(TOKENS), V, dtype=dtype) * 4
    req = RequestLogits(params, PROMPT, (2,), bad, None)
    req.commit(OUTPUT)
    spec = rows.clone()
    req.process(spec, TOKENS, PARENTS)
    for i, path in enumerate(_paths()):
        plain = copy.deepcopy(req)
        plain.commit(path)  # plain decoding: the path was emitted, one row after it
        row = rows[i:i + 1].clone()
        plain.process(row, [], [])
        assert torch.equal(row[0], spec[i]), (name, i, path)
    assert not torch.equal(spec, rows)  # something was processed


def test_what_each_option_does():
    torch.manual_seed(1)
    base = torch.randn(1, V)

    def run(**kw):
        req = RequestLogits(SamplingParams(temperature=0, **kw), PROMPT, (2,), [], None)
        req.commit(OUTPUT)
        row = base.clone()
        req.process(row, [], [])
        return row[0]
    row = run(frequency_penalty=0.5, presence_penalty=0.25)
    assert row[7] == base[0, 7] - torch.tensor(0.5 * 2 + 0.25)  # 7 emitted twice
    assert row[9] == base[0, 9] - torch.tensor(0.75) and row[3] == base[0, 3]  # prompt only
    row = run(repetition_penalty=2.0)
    for t in (3, 4, 5, 7, 9, 11, 12):  # prompt and output
        x = base[0, t]
        assert row[t] == (x / 2 if x > 0 else x * 2)
    assert row[20] == base[0, 20]
    row = run(logit_bias={20: -100.0})
    assert row[20] == base[0, 20] - 100
    row = run(min_tokens=6, stop_token_ids=[8])  # 5 out: EOS (2) and stop ids banned
    assert row[2] == row[8] == float("-inf") and row[3] == base[0, 3]
    assert torch.equal(run(min_tokens=5), base[0])  # 5 out already: nothing banned


def test_bad_words_ban_the_last_token_after_the_others():
    req = RequestLogits(SamplingParams(temperature=0, bad_words=["x"]), PROMPT, (2,),
                        [[11, 30], [31], [12, 5, 6]], None)
    req.commit(OUTPUT)  # ends with 11, 12
    rows = torch.zeros(3, V)
    req.process(rows, [5, 11], [-1, -1])  # paths [], [5], [11]
    banned = [set(torch.nonzero(r == float("-inf")).flatten().tolist()) for r in rows]
    assert banned == [{31}, {31, 6}, {31, 30}]


def test_sampling_params_check_the_new_options():
    for bad in (dict(presence_penalty=2.5), dict(frequency_penalty=float("nan")),
                dict(repetition_penalty=0), dict(logit_bias={1: 101}), dict(logit_bias={-1: 0}),
                dict(logit_bias={True: 1}), dict(min_tokens=-1), dict(min_tokens=300),
                dict(bad_words=[" "]), dict(logprobs=21), dict(prompt_logprobs=-1),
                dict(logprobs=True), dict(structured_outputs={"json": {}})):
        with pytest.raises(ValueError):
            SamplingParams(**bad)
    assert not SamplingParams().processes_logits
    assert SamplingParams(logit_bias={1: 0.5}).processes_logits
    assert not SamplingParams(logprobs=5).processes_logits  # logprobs read, never change


def test_logprobs_of_rows_at_once_equal_one_row_at_a_time():
    """token_logprobs reduces several rows in one log_softmax: bitwise what one row alone
    gives (what keeps logprobs the same with and without drafts)."""
    from specdec.logits.logprobs import token_logprobs

    torch.manual_seed(2)
    for dtype in (torch.float32, torch.float64):
        rows = torch.randn(9, 4099, dtype=dtype) * 6
        tokens = [int(t) for t in torch.randint(4099, (9,))]
        together = token_logprobs(rows, tokens, 3)
        alone = [token_logprobs(rows[i:i + 1], tokens[i:i + 1], 3)[0] for i in range(9)]
        assert together == alone
        ref = torch.log_softmax(rows.double(), -1)
        for lp, row, t in zip(together, ref, tokens):
            assert lp.rank == int((row > row[t]).sum()) + 1
            assert [i for i, _ in lp.top] == torch.topk(row, 3).indices.tolist()
