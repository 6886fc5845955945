"""sglang 0.5.23's session controller, run as an oracle of the history a session turn
continues from: the wheel's own `SessionReqNode` and `Session` classes, taken from its
`srt/session/session_controller.py` and run unmodified, with the names they use (a
request type, an abort marker; their annotations are never evaluated) given here, so
none of SGLang's server is imported.

`SGLangSession.turn` builds one request as SGLang's non-streaming session does and
returns its `origin_input_ids`; the caller then finishes it with its output, as SGLang's
scheduler would."""

from __future__ import annotations

import ast
import logging
import time
import uuid
from array import array
from types import SimpleNamespace

from custody.bench.sglang_reference import sglang_root

CONTROLLER = "srt/session/session_controller.py"


class OracleReq:
    """What the controller reads of a request it built: its ids, its output and whether
    it finished."""

    def __init__(self, **fields: object) -> None:
        self.rid = fields["rid"]
        self.origin_input_ids = list(fields["origin_input_ids"])
        self.origin_input_ids_unpadded = list(fields["origin_input_ids_unpadded"])
        self.sampling_params = fields["sampling_params"]
        self.output_ids: list[int] = []
        self.finished_reason: object = None
        self.to_finish: object = None
        self.abort_message: str | None = None
        self.multimodal_inputs: object = None

    def finished(self) -> bool:
        return self.finished_reason is not None

    def set_finish_with_abort(self, message: str) -> None:
        self.abort_message = message
        self.finished_reason = "abort"

    def inherit_mm_token_counts(self, other: OracleReq) -> None:
        pass


class Params(SimpleNamespace):
    """A tokenized request's fields: those a test names, None for every other."""

    def __getattr__(self, name: str) -> None:
        return None


def _controller_classes() -> dict:
    source = sglang_root() / CONTROLLER
    tree = ast.parse(source.read_text())
    picked = [  # its future import, and every class but the controller of many sessions
        n
        for n in tree.body
        if (isinstance(n, ast.ImportFrom) and n.module == "__future__")
        or (isinstance(n, ast.ClassDef) and n.name != "SessionController")
    ]
    names: dict = {
        "__name__": "sglang_session_oracle",
        "logging": logging,
        "logger": logging.getLogger("sglang_session_oracle"),
        "time": time,
        "uuid": uuid,
        "array": array,
        "Req": OracleReq,
        "FINISH_ABORT": lambda: "abort",
    }
    exec(compile(ast.Module(body=picked, type_ignores=[]), str(source), "exec"), names)
    return names


class SGLangSession:
    """One non-streaming SGLang session."""

    def __init__(self) -> None:
        self._session = _controller_classes()["Session"](1000, "oracle", streaming=False)

    def turn(
        self, rid: str, input_ids: list[int], session_params: dict, max_new_tokens: int
    ) -> OracleReq:
        params = Params(
            rid=session_params.get("rid"),
            offset=session_params.get("offset"),
            replace=session_params.get("replace"),
            drop_previous_output=session_params.get("drop_previous_output"),
        )
        req = Params(
            rid=rid,
            input_ids=list(input_ids),
            session_params=params,
            sampling_params=SimpleNamespace(max_new_tokens=max_new_tokens),
        )
        return self._session.create_req(req, None, 256, req_factory=OracleReq)

    @staticmethod
    def finish(req: OracleReq, output: list[int]) -> None:
        req.output_ids = list(output)
        req.finished_reason = "length"
