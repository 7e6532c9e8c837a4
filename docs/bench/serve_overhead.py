"""The server's cost on TPOT at batch 1, both sides: LLM.generate's TPOT, then the same request
six times through specdec serve's stack in this process (the engine loop in the main thread,
uvicorn and an async streaming client in others), TPOT as the engine measured it and as the
client saw it. Run from the repository root: .venv/bin/python docs/bench/serve_overhead.py
"""

from __future__ import annotations

import asyncio
import statistics
import threading

from specdec import LLM, SamplingParams
from specdec.bench.serve import run_load
from specdec.serving.engine_loop import EngineLoop
from specdec.serving.server import ServerThread, create_app

CHAT = [{"role": "user", "content": "Write a short story about a robot who learns to paint."}]


def main() -> None:
    llm = LLM()
    ids = llm.tokenizer.apply_chat_template(CHAT, add_generation_prompt=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    params = SamplingParams(temperature=0, max_tokens=64)
    generate = [llm.generate([ids], params)[0].metrics.tpot for _ in range(6)]
    loop = EngineLoop(llm.engine)
    server = ServerThread(create_app(loop, "m"))
    engine_side: list[float] = []
    loop.on_finish.append(lambda ev: engine_side.append(ev.metrics.tpot))
    client_side: list[float] = []

    def client() -> None:
        try:
            results, _ = asyncio.run(run_load(server.url, "m", [CHAT] * 6, 1000.0, 1, 64,
                                              poisson=False))
            client_side.extend(r.tpot for r in results)
        finally:
            loop.shutdown()

    thread = threading.Thread(target=client)
    thread.start()
    loop.run()
    thread.join()
    server.stop()

    def ms(xs: list[float]) -> float:
        return round(statistics.median(xs) * 1e3, 2)

    print(f"TPOT P50 ms: LLM.generate {ms(generate)}, through the server: engine-side "
          f"{ms(engine_side)}, client-side {ms(client_side)} "
          f"(+{ms(client_side) / ms(generate) - 1:.1%})")


if __name__ == "__main__":
    main()
