"""Every script in docs/bench runs to its end in its quick form: a tiny model (one tiny GGUF and
one tiny chat model, made once for the module), tiny data sets in place of ../shared/data, a few
tokens, one round; each in a subprocess (the suite's ``SPECDEC_CACHE``, no network) with
``SPECDEC_BENCH_QUICK=1``, under a timeout. A script without an entry in ``QUICK`` fails
``test_every_script_has_a_quick_form``: a new script comes with its quick form, and none rots
unrun. What a quick form cannot have here (llama-bench, a GPU, a compiler, the real SmolLM2
GGUF) it skips by name: the script prints ``skipped: <what>`` or the test skips, naming it.
"""

from __future__ import annotations

import gzip
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from cli_helpers import CHAT_TEMPLATE, MT_BENCH, make_tokenizer_model
from gguf_helpers import ascii_tokenizer, write_tiny_gguf

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "docs" / "bench"
PY = sys.executable
TIMEOUT = 120  # seconds per script; each takes a few


@dataclass(frozen=True)
class Quick:
    """A script's quick invocation: its arguments (``{gguf}``, ``{chat}``, ``{eval}``,
    ``{train}``, ``{recipe}``, ``{out}`` filled in), extra environment, and the text its output
    must contain (its report); ``needs``: the test skips, naming it, where it is missing."""

    args: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    expect: tuple[str, ...] = ()
    needs: str | None = None


GGUF = ("--model", "{gguf}")
QUICK = {
    "avx2_float_kernels.py": Quick(("--no-e2e",), needs="gcc",
                                   expect=("skipped (quick form)", "cycles per 8 weights")),
    "cold_start.py": Quick((*GGUF, "--max-model-len", "256", "--keep-page-cache",
                            "--json", "{out}/cold_start.json"), expect=("cold: ready", "warm: ready")),
    "forward_rows.py": Quick((*GGUF, "--rows", "1,2", "--repeats", "1", "--rounds", "1",
                              "--configs", "float32:invariant:native:q8,float32:invariant:native",
                              "--json", "{out}/forward_rows.json"), expect=("T(n) ms",)),
    "holdout_acceptance.py": Quick((*GGUF, "--dataset", "{eval}/mt_bench.jsonl", "--num-prompts",
                                    "2", "--drafter", "ngram", "--budgets", "1,2", "--max-tokens",
                                    "4", "--json", "{out}/holdout.json", "--steps-json",
                                    "{out}/steps.json"), expect=("ngram@static2",)),
    "host_overhead.py": Quick(("--steps", "3", "--vocab", "1024"),
                              expect=("spec_over_plain_b1", "ops_per_layer")),
    "near_duplicates.py": Quick(("--train", "{train}", "--eval", "{eval}", "--recipe", "{recipe}",
                                 "--json", "{out}/near_duplicates.json"), expect=("contamination",)),
    "oracle_speedup.py": Quick((*GGUF, "--dataset", "{eval}/mt_bench.jsonl", "--taus", "2",
                                "--depth", "2", "--num-prompts", "2", "--max-new-tokens", "4",
                                "--repeats", "1", "--max-model-len", "256"),
                               expect=("outputs equal plain: True",)),
    "q8_rows_streamed.py": Quick(("--kinds", "Q4_K", "--rows", "8", "--shapes", "256x256",
                                  "--copies", "2", "--repeats", "1"), expect=("Q4_K 256x256 r8",)),
    "readme_table.sh": Quick(env={"MODEL": "{gguf}", "DATA": "{eval}", "N": "2", "TOK": "4",
                                  "DRAFTERS": "ngram", "OUT": "{out}/readme_table"},
                             expect=("| plain decoding |", "| `ngram` |")),
    "repack_load.py": Quick(("{gguf}", "--repeats", "1"), expect=("repack  median",)),
    "repeated_work.py": Quick((*GGUF, "--eval", "{eval}", "--requests", "2", "--warm", "1",
                               "--max-tokens", "4", "--activations", "q8"),
                              expect=('"mismatches_vs_plain": 0',)),
    "results_dir.sh": Quick(("quick",), expect=("docs/bench/results/",)),
    "shape_gguf.py": Quick(("--source", "{gguf}", "--out", "{out}/shape.gguf", "--layers", "2",
                            "--hidden", "64", "--intermediate", "128", "--heads", "4",
                            "--kv-heads", "2"), expect=("wrote",)),
    "stream_matrices.py": Quick((*GGUF, "--rows", "1", "--repeats", "1"),
                                expect=("of the bandwidth",)),
    "suffix_draft_time.py": Quick(("--tokenizer", "{chat}", "--train", "{train}", "--requests", "6",
                                   "--budget", "4"), expect=("ratio_python_over_native",)),
    "tg128.py": Quick((*GGUF, "--tokens", "4", "--rounds", "1", "--json", "{out}/tg128.json"),
                      expect=("q8:", "float:", "GB of weights a token")),
}

# ---------------------------------------------------------------------------------------------
# fixtures: one tiny GGUF, one tiny chat model, tiny data sets (written once for the module)

TRAIN_ROWS = [{"question": f"How many apples does Tom have if he buys {n} apples and eats "
                           f"{n % 3} of them on day {d}?",
               "answer": f"He has {n - n % 3} apples.\n#### {n - n % 3}"}
              for n, d in zip(range(5, 29), [1, 1, 2, 2] * 6)]
EVAL_GSM8K = [{"question": "How many pears does Ann have if she buys 7 pears?",
               "answer": "7\n#### 7"},
              {"question": "What is two plus two?", "answer": "4\n#### 4"}]
HUMANEVAL = [{"task_id": "HumanEval/0", "prompt": "def add(a, b):\n    \"\"\"Sum.\"\"\"\n",
              "entry_point": "add", "canonical_solution": "    return a + b\n", "test": ""},
             {"task_id": "HumanEval/1", "prompt": "def twice(x):\n",
              "entry_point": "twice", "canonical_solution": "    return 2 * x\n", "test": ""}]


def _tokenizer(writer) -> None:
    """The tiny GGUF's byte-level ASCII tokenizer with a chat template (bench formats prompts as
    chats), and the size label shape_gguf.py rewrites."""
    ascii_tokenizer(writer)
    writer.add_chat_template(CHAT_TEMPLATE)
    writer.add_size_label("1M")


@pytest.fixture(scope="module")
def ctx(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("bench_scripts")
    gguf = write_tiny_gguf(root / "tiny.gguf", kind="Q8_0", tokenizer=_tokenizer,
                           metadata={"llama.rope.dimension_count": 16})  # (shape_gguf's source)
    chat = make_tokenizer_model(root / "chat")
    ev, train = root / "eval", root / "train"
    ev.mkdir()
    train.mkdir()
    (ev / "mt_bench.jsonl").write_text("".join(json.dumps(r) + "\n" for r in MT_BENCH))
    (ev / "gsm8k_test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in EVAL_GSM8K))
    with gzip.open(ev / "humaneval.jsonl.gz", "wt") as f:
        f.write("".join(json.dumps(r) + "\n" for r in HUMANEVAL))
    (train / "gsm8k_train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in TRAIN_ROWS))
    recipe = root / "recipe.yaml"
    recipe.write_text(f"kind: eagle3\ntarget: {gguf}\ndata:\n  - {train / 'gsm8k_train.jsonl'}\n"
                      "holdout: 4\nseed: 0\n")
    return {"gguf": str(gguf), "chat": str(chat), "eval": str(ev), "train": str(train),
            "recipe": str(recipe), "root": str(root)}


def scripts() -> list[str]:
    return sorted(p.name for p in BENCH.iterdir() if p.suffix in (".py", ".sh"))


def test_every_script_has_a_quick_form():
    assert scripts() == sorted(QUICK), "docs/bench and QUICK differ: give each script a quick form"


@pytest.mark.parametrize("name", sorted(QUICK))
def test_script_runs_in_its_quick_form(name, ctx, tmp_path):
    quick = QUICK[name]
    if quick.needs and shutil.which(quick.needs) is None:
        pytest.skip(f"{name}: needs {quick.needs}, not on PATH")
    fill = {**ctx, "out": str(tmp_path)}
    args = [a.format(**fill) for a in quick.args]
    cmd = ["bash" if name.endswith(".sh") else PY, str(BENCH / name), *args]
    env = {**os.environ, "SPECDEC_BENCH_QUICK": "1", "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
           **{k: v.format(**fill) for k, v in quick.env.items()}}
    assert env["SPECDEC_CACHE"] == os.environ["SPECDEC_CACHE"]  # the suite's own
    run = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=TIMEOUT)
    out = run.stdout + run.stderr
    assert run.returncode == 0, f"{name} exited {run.returncode}:\n{out[-3000:]}"
    for text in quick.expect:
        assert text in out, f"{name}: no {text!r} in its output:\n{out[-3000:]}"
