"""SGLang's batch /generate body: `text` or `input_ids` as a list, one request per item.

msgspec cannot type one field as either a list of ids or a list of lists of ids, so a
body is first probed (its two input fields kept raw, nothing else decoded) and then
decoded with the single or the batch struct; the single form stays exactly what it was.
"""

# No `from __future__ import annotations`: the struct is defined inside `batch_schema`,
# and msgspec must see its annotations as objects.

from typing import Annotated

import msgspec
from msgspec import Meta, Struct

from services.scheduler.http import schema_types as st
from shared.http_limits import MAX_BATCH, MAX_RID

BatchOf = Meta(min_length=1, max_length=MAX_BATCH)
Rid = Annotated[str, Meta(min_length=1, max_length=MAX_RID)]


class _Inputs(Struct):
    text: msgspec.Raw = msgspec.Raw(b"")  # kept raw: a Raw field takes any JSON value
    input_ids: msgspec.Raw = msgspec.Raw(b"")


def is_batch(raw: bytes) -> bool:
    """Whether `raw` gives `text` as a list or `input_ids` as a list of lists; a body
    that is no JSON object is not (the single struct names what is wrong with it)."""
    try:
        probe = msgspec.json.decode(raw, type=_Inputs)
    except (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError, RecursionError):
        return False
    if bytes(probe.text).startswith(b"["):
        return True
    return bytes(probe.input_ids)[1:].lstrip().startswith(b"[")


def batch_schema(single: type, limits: st.Limits) -> type:
    """The batch form of `single` (the /generate struct): its fields, with the inputs and
    `rid` as lists."""

    class GenerateBatchRequest(single):
        """SGLang's batch /generate: a list of texts or of token id lists (1..64 items),
        one `sampling_params` for all, `rid` a list of one per item if given; refused
        with `session_params` (a batch cannot continue a session)."""

        text: Annotated[list[st.Text], BatchOf] | None = None
        input_ids: Annotated[list[limits.input_ids], BatchOf] | None = None
        rid: Annotated[list[Rid], BatchOf] | None = None
        # one start for every item, or one per item (SGLang's two forms)
        logprob_start_len: st.LogprobStart | Annotated[list[st.LogprobStart], BatchOf] | None = None

        def __post_init__(self) -> None:
            if (self.text is None) == (self.input_ids is None):
                raise ValueError("give exactly one of text and input_ids")
            if self.session_params is not None:
                raise ValueError("a batch cannot continue a session: drop session_params")
            if self.rid is not None and len(self.rid) != len(self.inputs()):
                raise ValueError("rid must be a list with one id per item")
            for i, ids in enumerate(self.input_ids or ()):
                limits.check_input(f"input_ids[{i}]", ids)
            starts = self.logprob_start_len
            if isinstance(starts, list) and len(starts) != len(self.inputs()):
                raise ValueError("logprob_start_len must be one number, or a list of one per item")

        def logprob_start(self, item: int = 0) -> int:
            starts = self.logprob_start_len
            if isinstance(starts, list):
                return starts[item] if self.return_logprob else -1
            return super().logprob_start(item)

        def inputs(self) -> list:
            return self.text if self.input_ids is None else self.input_ids

    return GenerateBatchRequest
