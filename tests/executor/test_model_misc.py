"""The built-in model, pool sizes, and tokenizers."""

import dataclasses
import json

import pytest
import torch

from services.executor.model.pools import DevicePools, PoolSizes
from services.executor.runner import ModelRunner
from services.executor.weights import builtin_model, load_model
from shared.config import Settings
from shared.deferred_ops import DeferredOps
from shared.messages.forward import StepRow
from shared.model_config import ModelConfig, UnsupportedModel, builtin_config
from shared.tokenizer import BYTE_EOS, ByteTokenizer, load_tokenizer


def test_builtin_model_is_seeded_and_serves_a_context_beyond_8192():
    model = builtin_model()
    again = builtin_model()
    assert all(
        torch.equal(a, b)
        for a, b in zip(model.state_dict().values(), again.state_dict().values(), strict=True)
    )
    n = 8200
    pools = DevicePools(
        model.cfg, PoolSizes(kv_pages=n // 16 + 2, page_size=16, mamba_slots=2), torch.device("cpu")
    )
    runner = ModelRunner(model, pools)
    tokens = torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(0))
    kv = torch.arange(16, 16 + n)
    one_shot = runner.execute(
        [StepRow.of(tokens, 0, kv, 1)], DeferredOps(clears=[1]), keep_logits=True
    )
    pools.reset()
    for lo, hi in ((0, 4000), (4000, 8199)):
        runner.execute([StepRow.of(tokens[lo:hi], lo, kv[:hi], 1)], DeferredOps())
    last = runner.execute([StepRow.of(tokens[8199:], 8199, kv, 1)], DeferredOps(), keep_logits=True)
    assert (one_shot.logits - last.logits).abs().max() <= 1e-4
    assert builtin_config().max_position_embeddings >= 8192


def test_pool_sizes_are_reported():
    cfg = builtin_config()
    pools = DevicePools(
        cfg, PoolSizes(kv_pages=10, page_size=4, mamba_slots=3), torch.device("cpu")
    )
    kv_per_token = 2 * len(cfg.attention_layers) * cfg.num_key_value_heads * cfg.head_dim * 4
    assert pools.bytes_per_kv_token() == kv_per_token
    conv = cfg.conv_dim * (cfg.conv_kernel - 1)
    ssm = cfg.mamba_num_heads * cfg.mamba_head_dim * cfg.ssm_state_size
    assert pools.bytes_per_mamba_slot() == len(cfg.mamba_layers) * (conv + ssm) * 4
    assert pools.k.shape[1] == 11 * 4 and pools.conv.shape[1] == 4


def test_the_hybrid_pattern_names_every_mixer():
    raw = builtin_config().to_dict() | {"hybrid_override_pattern": "M*-E"}
    del raw["layers_block_type"]
    assert ModelConfig.from_dict(raw).layers_block_type == [
        "linear_attention",
        "full_attention",
        "mlp",
        "moe",
    ]


def test_byte_tokenizer_round_trips_text_and_skips_specials():
    tok = ByteTokenizer()
    ids = tok.encode("héllo ✓", True)
    assert all(0 <= i < 256 for i in ids)
    assert tok.decode([*ids, BYTE_EOS]) == "héllo ✓"


def test_tokenizer_json_beside_the_weights_is_used(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"hello": 0, "world": 1, "[UNK]": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    loaded = load_tokenizer(tmp_path)
    assert loaded.encode("hello world hello", True) == [0, 1, 0]
    assert load_tokenizer(None).encode("a", True) == [97]


def test_config_values_the_executor_does_not_implement_are_refused_by_name():
    """An activation, a bias, a sliding window or tied embeddings the executor does not
    implement would be served wrong; the config is refused naming the key."""
    raw = builtin_config().to_dict()
    assert ModelConfig.from_dict(raw | {"sliding_window": None, "attention_bias": False})
    for key, value in [
        ("mlp_hidden_act", "silu"),
        ("mamba_hidden_act", "gelu"),
        ("attention_bias", True),
        ("mamba_proj_bias", True),
        ("sliding_window", 4096),
        ("tie_word_embeddings", True),
    ]:
        try:
            ModelConfig.from_dict(raw | {key: value})
        except UnsupportedModel as err:
            assert key in str(err)
        else:
            raise AssertionError(f"{key}={value!r} was accepted")


def test_multi_token_prediction_weights_are_skipped_as_transformers_skips_them(tmp_path):
    """A checkpoint may ship `mtp.*` layers for speculative decoding; custody does not
    speculate, so they are not loaded, and the model loads in the asked dtype directly."""
    from safetensors.torch import save_file

    from tests.executor.oracle import build_reference

    build_reference(tmp_path)
    save_file({"mtp.layers.0.norm.weight": torch.ones(4)}, str(tmp_path / "mtp.safetensors"))
    model = load_model(tmp_path, torch.device("cpu"), "bfloat16")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert all(p.device.type == "cpu" for p in model.parameters())


def test_load_format_dummy_draws_a_checkpoints_config_and_auto_needs_its_weights(tmp_path):
    """`--load-format dummy`: a directory holding only `config.json` (a published shape
    whose weights are not at hand) gets the built-in model's seeded weights for that
    config; `auto` still refuses a directory without weights."""
    cfg = dataclasses.replace(builtin_config(), hidden_size=64, intermediate_size=96)
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_dict()))
    drawn = load_model(tmp_path, torch.device("cpu"), "bfloat16", "dummy")
    assert drawn.cfg.hidden_size == 64 and drawn.lm_head.weight.dtype == torch.bfloat16
    expected = builtin_model(cfg).to(torch.bfloat16).state_dict()
    assert all(torch.equal(v, expected[k]) for k, v in drawn.state_dict().items())
    with pytest.raises(FileNotFoundError, match="safetensors"):
        load_model(tmp_path, torch.device("cpu"), "float32", "auto")
    with pytest.raises(ValueError, match="load_format must be one of"):
        Settings(load_format="safetensors").check()
