"""CUDA graphs without CUDA, for CPU tests: a stand-in for ``CudaCapture`` with a graph's
semantics, and a way to graph every runner of an engine with it. With the flashinfer API model
(the ``flashinfer_api_model`` fixture) the whole graphed engine runs on a CPU: everything but
the kernels and the capture itself, which tests/gpu checks on a GPU."""

from __future__ import annotations

from specdec.engine.cuda_graphs import CudaGraphRunner


class RerunCapture:
    """Stands in for CudaCapture: replay() reruns the captured function over the same input
    buffers and writes into the output memory the capture returned, as a graph replay does."""

    def __init__(self) -> None:
        self.graphs: list[_Replay] = []

    def __call__(self, fn):
        out = fn()
        self.graphs.append(_Replay(fn, out))
        return self.graphs[-1], out


class _Replay:
    def __init__(self, fn, out) -> None:
        self.fn, self.out, self.replays = fn, out, 0

    def replay(self) -> None:
        new = self.fn()
        self.out.hidden.copy_(new.hidden)
        for i, h in self.out.layer_hidden.items():
            h.copy_(new.layer_hidden[i])
        self.replays += 1


def graph_everything(engine) -> RerunCapture:
    """Every runner of the engine graphed, through one RerunCapture (returned)."""

    capture = RerunCapture()
    for runner in [engine.parts.runner, *engine.parts.drafter_runners]:
        runner.graphs = CudaGraphRunner(runner, engine.config.max_num_seqs,
                                        engine.config.max_num_batched_tokens,
                                        engine.parts.max_model_len, capture=capture)
    return capture
