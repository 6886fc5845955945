"""Why a request ended: one typed value, built by the engine and sent to clients as it is
(`/generate`'s `meta_info.finish_reason`; /openapi.json documents the same struct)."""

from __future__ import annotations

from typing import Literal

from msgspec import Struct


class FinishReason(Struct, frozen=True, omit_defaults=True):
    type: Literal["stop", "length", "abort"]
    matched: int | str | None = None  # stop: the token id or the stop string
    length: int | None = None  # length: the limit reached
    message: str | None = None  # abort: why

    @property
    def matched_token(self) -> bool:
        """A stop token (not a stop string) ended the request."""
        return self.type == "stop" and isinstance(self.matched, int)
