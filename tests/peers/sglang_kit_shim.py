"""What SGLang's streaming-session kit imports from SGLang besides itself, for running it
against `custody up`, unmodified, from the installed wheel.

The kit (`sglang/test/kits/streaming_session_kit.py`) and its fixture
(`sglang/test/server_fixtures/streaming_session_fixture.py`) import four things that
would pull in SGLang's whole server (torch kernels, FlashInfer, a GPU): the `sglang`
package's own `__init__`, `sglang.srt.utils`' `__init__`, `get_tokenizer` and
`sglang.test.test_utils`. They are replaced here, before the kit is imported; every
other import (`sglang.srt.environ`, the fixture, the kit) is the wheel's file as
shipped, and `tests/peers/test_sglang_session_kit.py` checks both files against the
wheel's RECORD.

The replacements do what SGLang's do, for custody: `popen_launch_server` starts the real
`custody up` (its process handle is the kit's `self.process`) with SGLang's launch flags
as the kit gives them (custody up takes SGLang's names, shared/sglang_flags.py);
`get_tokenizer` loads the built-in model's tokenizer as
`custody tokenizer export` writes it, with transformers' AutoTokenizer, as any client
with `--tokenizer DIR` would.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
import types
import unittest
import urllib.error
import urllib.request
from pathlib import Path
from urllib.parse import urlparse

from custody.bench.sglang_reference import package, sglang_root
from shared.redis_server import free_port

BUILTIN = "custody-builtin"  # the kit's `model`: custody's built-in model


def popen_launch_server(
    model: str, base_url: str, timeout: float, other_args: list[str] | None = None, **_: object
) -> subprocess.Popen:
    """`custody up` on `base_url`'s port (its own private Redis, free side ports), ready
    when /health says 200; a process that exits first, or a timeout, fails the launch."""
    port = urlparse(base_url).port
    command = [str(Path(sys.executable).parent / "custody"), "up", "--port", str(port)]
    command += ["--store-port", str(free_port()), "--executor-metrics-port", str(free_port())]
    if model != BUILTIN:
        command += ["--model-path", model]
    command += [str(arg) for arg in other_args or []]
    process = subprocess.Popen(command, start_new_session=True)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"custody up exited with {process.returncode}: {command}")
        try:
            with urllib.request.urlopen(base_url + "/health", timeout=5) as reply:
                if reply.status == 200:
                    return process
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.5)
    terminate_and_kill_process_tree(process)
    raise TimeoutError(f"custody up was not ready within {timeout} s")


def terminate_and_kill_process_tree(
    process: subprocess.Popen, wait_timeout: float = 60, **_: object
) -> None:
    """SIGTERM to `custody up`'s process group (it stops its services and Redis), then
    SIGKILL what is left after `wait_timeout`."""
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(wait_timeout)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()


def get_tokenizer(model: str, **_: object):
    """The tokenizer a client of `custody up` loads: the built-in model's, exported."""
    from transformers import AutoTokenizer

    from services.scheduler.text.tokenizer_files import export_byte_tokenizer

    if model != BUILTIN:
        return AutoTokenizer.from_pretrained(model)
    directory = Path(tempfile.mkdtemp(prefix="custody-tokenizer-"))
    export_byte_tokenizer(directory, context_len=131072)
    return AutoTokenizer.from_pretrained(str(directory))


def install() -> None:
    """Put the four replacements in `sys.modules` (where absent)."""
    root = sglang_root()
    package("sglang", root)
    package("sglang.srt.utils", root / "srt" / "utils")
    test_utils = types.ModuleType("sglang.test.test_utils")
    test_utils.__dict__.update(
        DEFAULT_SMALL_MODEL_NAME_FOR_TEST=BUILTIN,
        DEFAULT_TIMEOUT_FOR_SERVER_LAUNCH=600,
        DEFAULT_URL_FOR_TEST=f"http://127.0.0.1:{free_port()}",
        CustomTestCase=unittest.TestCase,
        popen_launch_server=popen_launch_server,
        terminate_and_kill_process_tree=terminate_and_kill_process_tree,
    )
    tokenizers = types.ModuleType("sglang.srt.utils.hf_transformers_utils")
    tokenizers.get_tokenizer = get_tokenizer
    for module in (tokenizers, test_utils):
        sys.modules.setdefault(module.__name__, module)
