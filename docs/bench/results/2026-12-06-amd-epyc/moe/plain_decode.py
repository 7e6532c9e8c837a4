"""Plain decode tok/s of specdec, batch 1, 64 new tokens (greedy, ignore_eos), default mode
(q8 activations on the file's blocks): decode tok/s = 63 tokens / (e2e - ttft) per prompt,
after one untimed warm-up; 2 prompts x 2 passes, median."""
import os, statistics, sys, time
from pathlib import Path
from specdec import LLM, SamplingParams
from specdec.bench.data import first_turn_items, load_questions
DATASET = Path(__file__).resolve().parents[5].parent / "shared" / "data" / "eval" / "mt_bench.jsonl"
for model in sys.argv[1:]:
    llm = LLM(model=model, activations="q8", max_model_len=1024)
    prompts = [it.prompt_ids for it in first_turn_items(load_questions(DATASET, 2), llm.tokenizer)]
    sp = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    llm.generate(prompts[:1], sp)
    la, tps = os.getloadavg(), []
    for _ in range(2):
        for q in prompts:
            t0 = time.perf_counter(); (o,) = llm.generate([q], sp); wall = time.perf_counter() - t0
            tps.append((len(o.token_ids) - 1) / (wall - o.metrics.ttft))
    print(f"{model}: plain decode batch 1, 64 tokens: {statistics.median(tps):.2f} tok/s "
          f"(runs {[round(x, 2) for x in tps]}), load {la[0]:.2f} -> {os.getloadavg()[0]:.2f}", flush=True)
    del llm
