import sys, time, torch
from specdec import LLM, SamplingParams
def main():
    tp = int(sys.argv[1])
    with LLM(model="/tmp/tpbench/smollm2-1.7b-q4km.gguf", tensor_parallel_size=tp, max_model_len=512, tensor_parallel_reduce=(sys.argv[2] if len(sys.argv) > 2 else "exact")) as llm:
        p = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
        llm.generate([[1, 2, 3, 4, 5, 6, 7, 8]], p)
        for _ in range(3):
            t = time.perf_counter(); o = llm.generate([[1, 2, 3, 4, 5, 6, 7, 9]], p); d = time.perf_counter() - t
            b = llm.engine.totals.budget.get("plain"); print(b.per_step_ms() if b else None)
        print(f"tp{tp} threads {torch.get_num_threads()} {32/d:.2f} tok/s", flush=True)

if __name__ == '__main__':
    main()
