"""`--stream-interval` (SGLang's flag) in the one place every stream cuts its chunks
(`StreamCursor`): the first token goes at once, then a chunk waits for `interval`
unsent tokens or the end; chunks never overlap or leave a gap, and their text joined is
the final text. (The agent stack streams every 3 tokens: its tool-call and reasoning
streams are checked against one-shot answers there, tests/agent_apis/test_chat_tools_http.py.)"""

from __future__ import annotations

import numpy as np
import pytest

from services.scheduler.http.stream_cursor import StreamCursor
from services.scheduler.records.request import Request, Status
from services.scheduler.records.sampling import SamplingParams
from services.scheduler.text.output import OutputText
from shared.tokenizer import load_tokenizer

TEXT = "héllo, wörld: a stream cut into chunks"


@pytest.mark.parametrize("interval", [1, 3, 4, 100])
def test_chunks_wait_for_the_interval_and_join_to_the_final_text(interval):
    tokenizer = load_tokenizer(None)
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    req = Request("r", np.array([1]), SamplingParams())
    req.text = OutputText(tokenizer, (), trim=True)
    cursor, chunks = StreamCursor(interval), []
    for i, token in enumerate(ids):
        req.output.append(token)
        if i == len(ids) - 1:
            req.status = Status.FINISHED
        chunk = cursor.next(req)
        if chunk is not None:
            chunks.append((len(req.output), chunk))
    sent_at = [n for n, _ in chunks]
    expected = [1, *range(1 + interval, len(ids), interval)]
    if expected[-1] != len(ids):
        expected.append(len(ids))  # the end takes the rest
    assert sent_at == expected
    assert [c.start for _, c in chunks] == [0] + [c.end for _, c in chunks[:-1]]
    assert "".join(c.delta for _, c in chunks) == TEXT == chunks[-1][1].text
    assert cursor.next(req) is None  # the end was sent
