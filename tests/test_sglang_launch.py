"""`custody up` started by the command line SGLang's test kits build for `sglang serve`
(`popen_launch_server` for the streaming-session fixture: `--model-path DIR
--enable-streaming-session --device cpu --host 127.0.0.1 --port P`), unchanged, and the
/server_info fields SGLang's own clients read (bench_one_batch_server: the model's and
tokenizer's paths, the context, the request rows, the KV pool's token capacity, the last
generation throughput, the accepted draft length). The parser's forms: SGLang's names
beside custody's, bare booleans, refusals by name.

What it cannot see: SGLang flags neither mapped nor refused here are refused by
argparse as unknown, which says less than a refusal by name (shared/sglang_flags.py
lists the ones mapped or refused).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.error
from pathlib import Path

import pytest

from custody.cli import build_parser, main
from shared.config import Settings
from shared.model_config import builtin_config
from shared.redis_server import free_port
from shared.sglang_flags import apply_sglang_flags
from tests.services_harness import call


def parse(*argv: str):
    return build_parser().parse_args(["up", *argv])


def test_sglang_names_bare_booleans_and_values_parse_to_the_same_settings():
    ours = parse(
        "--model", "/m", "--context-len", "512", "--chunk-size", "64", "--compile", "false"
    )
    theirs = parse("--model-path", "/m", "--context-length", "512", "--chunked-prefill-size", "64")
    for name in ("model", "context_len", "chunk_size"):
        assert getattr(ours, name) == getattr(theirs, name)
    assert ours.compile is False
    bare = parse("--incremental-streaming-output", "--port", "9")
    assert bare.incremental_streaming_output is True and bare.port == 9
    assert parse("--incremental-streaming-output", "off").incremental_streaming_output is False
    args = parse("--enable-streaming-session", "--skip-server-warmup", "--tp-size", "1")
    apply_sglang_flags(args)
    assert Settings.resolve(args, environ={}) == Settings()
    spelled = parse("--reasoning-parser", "nemotron_3", "--dtype", "half", "--disable-cuda-graph")
    apply_sglang_flags(spelled)
    settings = Settings.resolve(spelled, environ={})
    assert (settings.reasoning_parser, settings.dtype) == ("nemotron_v3", "float16")
    assert settings.compile is False
    spec = parse(
        "--speculative-algorithm", "ngram", "--speculative-num-steps", "2",
        "--speculative-num-draft-tokens", "3", "--speculative-eagle-topk", "1",
    )  # fmt: skip
    settings = Settings.resolve(spec, environ={})
    assert (settings.spec_drafts, settings.speculative_algorithm) == (2, "ngram")
    assert Settings().spec_drafts == 0
    for algorithm in ("NEXTN", "eagle"):  # the built-in model has no head to draft with
        with pytest.raises(ValueError, match=f"--speculative-algorithm {algorithm}: the chec"):
            Settings(speculative_algorithm=algorithm).check_speculation(builtin_config())


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--mem-fraction-static", "0.7"], "--mem-fraction-static"),
        (["--quantization", "fp8"], "--quantization"),
        (["--tp-size", "2"], "--tp-size 2"),
        (["--model-path", "/a", "--tokenizer-path", "/b"], "--tokenizer-path"),
        (["--speculative-algorithm", "medusa"], "speculative_algorithm must be"),
        (["--speculative-eagle-topk", "4"], "speculative_eagle_topk must be 1"),
        (
            ["--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", "5"],
            "speculative_num_draft_tokens 5",
        ),
    ],
)
def test_an_sglang_flag_custody_cannot_honour_is_refused_by_name(argv, named, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["up", *argv])  # refused before anything starts
    assert exit_.value.code == 2
    assert named in capsys.readouterr().err


def test_help_shows_both_names():
    text = build_parser()._subparsers._group_actions[0].choices["up"].format_help()
    assert "--context-len CONTEXT_LEN, --context-length CONTEXT_LEN" in text
    assert "--model MODEL, --model-path MODEL" in text
    assert "--enable-streaming-session" in text and "refused:" in text


def test_custody_up_starts_from_sglang_s_launch_line_and_reports_server_info(
    redis_url: str, module_redis_client, chat_checkpoint: Path
):
    port = free_port()
    argv = ["--model-path", str(chat_checkpoint), "--enable-streaming-session"]
    argv += ["--device", "cpu", "--host", "127.0.0.1", "--port", str(port)]
    # what SGLang's line does not say: this test's Redis and side ports, no compile warm-up
    env = os.environ | {
        "REDIS_URL": redis_url,
        "CUSTODY_STORE_PORT": str(free_port()),
        "CUSTODY_EXECUTOR_METRICS_PORT": str(free_port()),
        "CUSTODY_COMPILE": "false",
    }
    up = subprocess.Popen(
        [sys.executable, "-m", "custody.cli", "up", *argv], env=env, start_new_session=True
    )
    try:
        deadline = time.monotonic() + 120
        while True:
            assert up.poll() is None, f"custody up exited with {up.returncode}"
            try:
                call(port, "/health")
                break
            except (urllib.error.URLError, OSError):
                assert time.monotonic() < deadline, "custody up was not ready in 120 s"
                time.sleep(0.5)
        body = {"text": "Grüße", "sampling_params": {"max_new_tokens": 8, "ignore_eos": True}}
        for _ in range(2):
            call(port, "/generate", body)
        info = call(port, "/server_info")
        assert info["model_path"] == str(chat_checkpoint)
        assert Path(info["tokenizer_path"], "tokenizer.json").exists()
        assert info["context_length"] == Settings.context_len and info["device"] == "cpu"
        state = info["internal_states"][0]
        assert state["effective_max_running_requests_per_dp"] == Settings.max_running_requests
        assert state["memory_usage"]["token_capacity"] == Settings.kv_pages * Settings.page_size
        assert state["last_gen_throughput"] > 0 and state["avg_spec_accept_length"] == 1.0
        assert call(port, "/get_server_info")["internal_states"][0].keys() == state.keys()
    finally:
        os.killpg(up.pid, signal.SIGTERM)
        up.wait(60)
