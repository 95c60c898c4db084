"""The service behind the endpoints, cut by operation family (as vLLM's entrypoints are):

    ServiceCore         start-up and readiness, the batcher, the profile store, the metrics,
                        the decision log, and the steps every request shares (its gate, its
                        queries prepared within the budget, shared rows, the log)
    JudgeServing        POST /judge, POST /judge/batch          (service.web.serving_judge)
    CascadeServing      the later stages of every route that decides, with --cascade
                                                                (service.web.serving_cascade)
    SystemOneServing    POST /v1/systemone                      (service.web.serving_systemone)
    ProfileServing      /profiles: list, store, fit             (service.web.serving_profiles)
    FeedbackServing     /judgments, /labels, profile health     (service.web.serving_feedback)

``Service`` is the core with one of each family; the routes (``service.web.routes``) call the
family of their operation.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import anyio.to_thread

from judge import Engine
from service.config import ServiceConfig
from service.web.serving_core import ServiceCore, Ticket
from service.web.serving_feedback import FeedbackServing
from service.web.serving_judge import JudgeServing
from service.web.serving_profiles import ProfileServing
from service.web.serving_systemone import SystemOneServing

if TYPE_CHECKING:
    from service.web.serving_cascade import CascadeServing

__all__ = ["Service", "Ticket"]


class Service(ServiceCore):
    """The app's one service: the shared core and its operation families."""

    def __init__(self, config: ServiceConfig) -> None:
        super().__init__(config)
        # A cascade's machinery (its stages, remote ones' client) is imported only with one:
        # a request without a cascade neither imports nor calls it (tests/test_structure.py).
        self.cascade: CascadeServing | None = None
        if config.cascade:
            from service.web.serving_cascade import CascadeServing

            self.cascade = CascadeServing(self)
        self.judging = JudgeServing(self, self.cascade)
        self.systemone = SystemOneServing(self, self.cascade)
        self.profiles = ProfileServing(self)
        self.feedback = FeedbackServing(self)

    async def load_more(self, engine: Engine) -> None:
        """The cascade's local stages, in this server's dtype, off the event loop."""
        if self.cascade is not None:
            await anyio.to_thread.run_sync(self.cascade.load, engine.dtype)
