"""The prompt a profile was fitted on, with the item left out: what makes a profile a task.

A certificate holds for the prompts it was fitted on. A profile fitted on a task
(``judge calibrate --task``) keeps that task's prompt as a ``PromptTemplate``: the text before
the item (the instruction), the text after it (the allowed-answers line) and the system prompt.
A request to the profile then sends only the item; the template renders the very prompt the
certificate covers and marks the item's characters by construction (``Query.item_span``), so no
caller rebuilds a prompt or counts characters by hand.

A full prompt may still be sent to such a profile, but it must mark its item (the probe's means
and the template's own item both need it), and its decision says it was made outside the fitted
template (``outside_template``): the certificate was not measured on prompts like it.
"""

from __future__ import annotations

import msgspec

__all__ = ["PromptTemplate"]


class PromptTemplate(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """``before`` + item + ``after`` is the prompt; ``system`` the system prompt (None: the
    model's own). The response prefix and suffix are the profile's fingerprint's."""

    before: str
    after: str
    system: str | None = None

    def render(self, item: str) -> tuple[str, tuple[int, int] | None]:
        """The prompt for ``item`` and the item's [start, end) characters in it (None for an
        empty item, which has no characters to mark)."""
        start = len(self.before)
        span = (start, start + len(item)) if item else None
        return f"{self.before}{item}{self.after}", span

    def fits(self, prompt: str, item_span: tuple[int, int] | None) -> bool:
        """Whether ``prompt`` is this template rendered around the item ``item_span`` marks."""
        if item_span is None:
            return False
        start, end = item_span
        return prompt == f"{self.before}{prompt[start:end]}{self.after}" and start == len(
            self.before
        )
