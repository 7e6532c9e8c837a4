"""Tensor parallelism from the command line (issue #54's tests): the real SmolLM2-135M GGUF at
TP 3 (speculation equal to plain decoding; TP 2 refused naming its 9 heads, before any process
starts), ``specdec serve --tensor-parallel-size 2`` answering the official openai client, and two
torchrun "nodes" on this machine printing what the same command prints at TP 2 without
torchrun. Every test ends its processes."""

from __future__ import annotations

import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from specdec.cli import main

sys.path.insert(0, str(Path(__file__).parents[1]))
from cli_helpers import make_tokenizer_model  # noqa: E402

pytestmark = pytest.mark.xdist_group("distributed_spawn")

CHAT = [{"role": "user", "content": "write a short poem about the sea"}]


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory) -> Path:
    """A tiny Llama with a word-level tokenizer and a chat template: 4 heads over 2 KV heads,
    an MLP of 64 (TP 2 splits both)."""
    return make_tokenizer_model(tmp_path_factory.mktemp("tp_chat_model"))


def cli(capsys, *argv: str) -> tuple[int, str, str]:
    """``specdec ARGV`` in this process: (exit code, stdout, stderr); no process left."""
    capsys.readouterr()
    threads = torch.get_num_threads()
    code = main(list(argv))
    out, err = capsys.readouterr()
    assert not multiprocessing.active_children()
    assert torch.get_num_threads() == threads  # rank 0's share of the cores given back
    return code, out, err


@pytest.mark.slow
def test_smollm2_gguf_at_tp3_speculation_equals_plain_and_tp2_is_refused(smollm2_dir,
                                                                          capsys):
    """9 heads over 3 KV heads, Q4_1 layers (o and down cut at their 32-weight blocks)."""
    common = ["generate", "The capital of France is Paris. The capital of Germany is",
              "--model", str(smollm2_dir), "--no-chat", "--max-tokens", "16",
              "--controller", "static", "--budget", "4"]  # (goodput profiles its costs first)
    code, plain, _ = cli(capsys, *common, "--tensor-parallel-size", "3", "--drafter", "none")
    assert code == 0 and len(plain.strip()) > 10
    code, spec, err = cli(capsys, *common, "--tensor-parallel-size", "3", "--drafter", "ngram")
    assert code == 0 and spec == plain
    assert "acceptance" in err  # speculation ran
    start = time.monotonic()
    code, out, err = cli(capsys, *common, "--tensor-parallel-size", "2")
    assert code == 1 and out == ""
    assert "tensor_parallel_size=2 does not divide num_heads=9" in err
    assert "sizes that work: 1, 3" in err
    assert time.monotonic() - start < 10  # refused from the config, before any process


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def descendants(pid: int) -> list:
    import psutil

    return psutil.Process(pid).children(recursive=True)


def assert_gone(processes, timeout: float = 10.0) -> None:
    import psutil

    gone, alive = psutil.wait_procs(processes, timeout=timeout)
    for p in alive:
        p.kill()
    assert not alive, f"left behind: {alive}"


def test_serve_at_tp2_answers_the_openai_client_streamed_and_not(chat_model):
    from openai import OpenAI

    proc = subprocess.Popen([sys.executable, "-m", "specdec", "serve", "--model",
                             str(chat_model), "--port", "0", "--dtype", "float64",
                             "--tensor-parallel-size", "2", "--drafter", "ngram",
                             "--controller", "static", "--budget", "4",
                             "--served-model-name", "tiny"],
                            stderr=subprocess.PIPE, text=True, env=os.environ.copy())
    children = []
    try:
        url, deadline = None, time.time() + 120
        while url is None and time.time() < deadline:
            line = proc.stderr.readline()
            if "specdec serve: http://" in line:
                url = line.split("serve: ")[1].split("/v1")[0]
            assert line or proc.poll() is None, "specdec serve exited at start"
        assert url is not None
        children = descendants(proc.pid)  # rank 1 among them
        assert any("spawn_main" in " ".join(c.cmdline()) for c in children)
        client = OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
        got = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=12,
                                             temperature=0)
        text = got.choices[0].message.content
        assert got.usage.completion_tokens == 12 and text
        parts = [c.choices[0].delta.content or "" for c in client.chat.completions.create(
            model="tiny", messages=CHAT, max_tokens=12, temperature=0, stream=True)
            if c.choices]
        assert "".join(parts) == text
        comp = client.completions.create(model="tiny", prompt="write a poem", max_tokens=6,
                                         temperature=0)
        streamed = client.completions.create(model="tiny", prompt="write a poem",
                                             max_tokens=6, temperature=0, stream=True)
        assert "".join(c.choices[0].text for c in streamed if c.choices) == \
            comp.choices[0].text
        proc.send_signal(signal.SIGTERM)  # drains (nothing running) and stops
        assert proc.wait(60) == 0
        assert_gone(children)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        assert_gone(children)


def test_two_torchrun_nodes_print_what_one_machine_prints(chat_model, capsys):
    """``torchrun --nnodes 2 --node-rank {0,1}`` on localhost (static rendezvous at
    --master-addr/--master-port): rank 0 runs ``generate``, rank 1 serves its engine."""
    args = ["generate", "write a short poem about the sea", "--model", str(chat_model),
            "--tensor-parallel-size", "2", "--drafter", "ngram", "--controller", "static",
            "--budget", "4", "--no-chat", "--max-tokens", "12"]
    code, want, _ = cli(capsys, *args)
    assert code == 0 and want.strip()
    torchrun = Path(sys.executable).with_name("torchrun")
    port = free_port()
    procs = [subprocess.Popen(
        [str(torchrun), "--nnodes", "2", "--nproc-per-node", "1", "--node-rank", str(rank),
         "--master-addr", "127.0.0.1", "--master-port", str(port), "-m", "specdec", *args],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=os.environ.copy(),
        start_new_session=True) for rank in (0, 1)]
    try:
        outs = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:  # on a timeout: the whole session (torchrun's agent and its worker)
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(10)
    assert [p.returncode for p in procs] == [0, 0], [o[1][-2000:] for o in outs]
    assert outs[0][0] == want  # rank 0 printed the text
    assert outs[1][0] == ""  # rank 1 only served
    for p in procs:  # no process of either session left (the agents reaped their workers)
        assert subprocess.run(["pgrep", "-s", str(p.pid)], capture_output=True).stdout == b""
