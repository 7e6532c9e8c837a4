"""The drafting side of a step, in two stages with one job each; neither holds the other (the
engine wires them: specdec.engine.core):

    drafter_stage.py     DrafterStage: the drafter's calls — per-request state (init_state,
                         restore, release), propose (trees checked per request, cut to the
                         request's constraint), on_verified; a failing call fails only the
                         requests it concerns (calls.py)
    controller_stage.py  ControllerStage: the controller's calls — budgets (checked, clipped),
                         keep_drafting (a partial prefix restore, requests kept idle), prune,
                         observe, release
    setup.py             the drafter and controller made from the registries, fitted to the
                         declared contracts (Drafter, Controller), checked

A drafting-policy change goes into controller_stage.py (or a controller); how the engine talks to
drafters, into drafter_stage.py. A request's drafting bookkeeping lives on the request
(``Sequence.drafting``: ``specdec.engine.sequence.RequestDrafting``).
"""
