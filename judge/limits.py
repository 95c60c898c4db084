"""Limits that the engine enforces and the wire schemas state, in a module with no torch.

``service.schemas`` (and so the client) reads them without loading the engine, and the
command line's parser (``judge --help``) the dtypes a model loads in.
"""

from __future__ import annotations

from typing import Literal

__all__ = ["MAX_CHOICES", "DType"]

MAX_CHOICES = 1024  # choices per question; more is a TooManyChoicesError: split the question
DType = Literal["auto", "float32", "bfloat16", "float16"]  # what judge.loading loads a model in
