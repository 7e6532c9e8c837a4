"""Built-in drafters, verifiers and controllers, registered through the public hooks."""

from __future__ import annotations

from specdec.hookspecs import hookimpl


@hookimpl
def specdec_drafters() -> dict:
    from specdec.drafters.block_diffusion import BlockDiffusionDrafter
    from specdec.drafters.draft_model import DraftModelDrafter
    from specdec.drafters.eagle3 import Eagle3Drafter
    from specdec.drafters.mtp import MTPDrafter
    from specdec.drafters.ngram import NgramDrafter
    from specdec.drafters.suffix import SuffixDrafter

    return {"ngram": NgramDrafter, "draft_model": DraftModelDrafter, "eagle3": Eagle3Drafter,
            "mtp": MTPDrafter, "block_diffusion": BlockDiffusionDrafter, "suffix": SuffixDrafter}


@hookimpl
def specdec_verifiers() -> dict:
    from specdec.verifiers.greedy import GreedyVerifier
    from specdec.verifiers.gumbel import GumbelVerifier
    from specdec.verifiers.rejection import RejectionVerifier

    return {"greedy": GreedyVerifier, "gumbel": GumbelVerifier, "rejection": RejectionVerifier}


@hookimpl
def specdec_controllers() -> dict:
    from specdec.controllers.adaptive import AdaptiveController
    from specdec.controllers.goodput import GoodputController
    from specdec.controllers.static import StaticController

    return {"static": StaticController, "goodput": GoodputController,
            "adaptive": AdaptiveController}
