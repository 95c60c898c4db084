"""The service behind the endpoints, cut by operation family (as vLLM's entrypoints are):

    ServiceCore         start-up and readiness, the batcher, the profile store, the metrics,
                        the decision log, and the steps every request shares (its gate, its
                        queries prepared within the budget, shared rows, the log)
    JudgeServing        POST /judge, POST /judge/batch          (service.serving_judge)
    SystemOneServing    POST /v1/systemone                      (service.serving_systemone)
    ProfileServing      /profiles: list, store, fit             (service.serving_profiles)
    FeedbackServing     /judgments, /labels, profile health     (service.serving_feedback)

``Service`` is the core with one of each family; the routes (``service.routes``) call the
family of their operation.
"""

from __future__ import annotations

from service.config import ServiceConfig
from service.serving_core import ServiceCore, Ticket
from service.serving_feedback import FeedbackServing
from service.serving_judge import JudgeServing
from service.serving_profiles import ProfileServing
from service.serving_systemone import SystemOneServing

__all__ = ["Service", "Ticket"]


class Service(ServiceCore):
    """The app's one service: the shared core and its operation families."""

    def __init__(self, config: ServiceConfig) -> None:
        super().__init__(config)
        self.judging = JudgeServing(self)
        self.systemone = SystemOneServing(self)
        self.profiles = ProfileServing(self)
        self.feedback = FeedbackServing(self)
