"""The step: what builds a step's parts, and what steps.

    build.py          model, tokenizer, prepared weights and kernels, drafter, controller, KV
                      split, tier (EngineParts)
    core.py           LLMEngine: requests in; step() = schedule -> draft -> forward -> verify ->
                      output -> commit -> feedback
    scheduler.py      continuous batching: which requests run, with how many tokens and slots
    drafting/         the drafting side: drafter_stage.py (the drafter's calls: state,
                      proposals, feedback, failures per request), controller_stage.py (the
                      controller's: budgets, keep_drafting, pruning, observe, release),
                      setup.py (both made from the registries, fitted to their contracts)
    batch.py          one packed target forward for every request's rows and tree nodes
    verify_stage.py   one verifier call for every request at its frontier
    output_stage.py   tokens appended, stop conditions (detokenizer.py: text, incrementally)
    commit_stage.py   accepted KV into place, full pages named for the prefix cache, finishing
    step.py           one record per request per step, and a stage's Failures; step_stats.py:
                      the step's figures
    llm.py            LLM: the user API on top; streaming.py: what a stream sends at each
                      step (LLM.stream and the server's engine loop)
"""

__all__ = ["LLMEngine", "StepResult"]


def __getattr__(name: str):
    # the engine pulls in torch and every stage: imported when asked for, so that importing
    # one module of this package (e.g. specdec.engine.streaming) does not import them all
    if name in __all__:
        from specdec.engine import core

        return getattr(core, name)
    raise AttributeError(f"module 'specdec.engine' has no attribute {name!r}")
