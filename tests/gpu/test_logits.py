"""custody's NemotronH against transformers' NemotronHForCausalLM on the same weights, on
CUDA: the built-in model (its transformers twin as `custody bench executor` builds it),
the dense oracle checkpoint and a mixture-of-experts oracle checkpoint (the configs of
tests/executor/test_moe_oracle.py). A prefill, then decode steps one token at a time
through custody's pools, compared at every position with transformers' one-shot forward
over the whole sequence: in float32 within 1e-4 (TF32 off), and in bfloat16 within a
bound relative to transformers' own bfloat16 error (see the bf16 test).

Each case's figures go to the JUnit XML (`record_property`): max_logit_diff_fp32_<case>,
max_logit_diff_bf16_<case>, hf_bf16_error_<case> (and bf16_positions_compared_<case>).

What this cannot catch: a computation transformers itself gets wrong (it is the oracle),
errors that only show at sizes far from these tiny models (long contexts, wide layers),
the compiled decode path (test_compiled_decode.py compares it with eager), and speed.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from custody.bench.executor import _transformers_twin
from services.executor.model.nemotron_h import NemotronH
from services.executor.model.pools import DevicePools, PoolSizes
from services.executor.weights import load_model, model_dtype
from tests.executor.oracle import TOKENS, all_logits, build_reference, row, scattered_kv
from tests.executor.test_moe_oracle import CONFIGS, build_moe_reference

FP32_TOLERANCE = 1e-4
PROMPT, DECODE_STEPS = 40, 12
PAGE = 4
# top-2 of 8 experts in 2 groups, 1 group kept, normalised weights, no shared expert
MOE_CASE = "*MEM"
CASES = ["builtin", "dense", "moe"]
# the tokens' seed: for the MoE case one whose every routing decision (group and expert) is
# at least 0.01 from a tie in float32 (measured on CPU; bf16 moves its router's scores by
# under 0.008 there), so bf16 rounding is unlikely to flip one (see the bf16 test)
SEEDS = {"builtin": 17, "dense": 17, "moe": 101}
MIN_COMPARED = 16  # positions before a routing flip, at the least, for a bf16 comparison
ROUTERS = ("TopkRouter", "NemotronHTopkRouter")  # custody's and transformers' MoE gates


@dataclass
class Case:
    name: str
    reference: torch.nn.Module  # transformers, float32, on the device
    ours: Callable[[str], NemotronH]  # custody's model in a `--dtype`, on the device


def build_case(name: str, directory: Path, device: torch.device) -> Case:
    """A case's transformers model and how custody loads the same weights."""
    if name == "builtin":
        twin = _transformers_twin(load_model(None, device, "float32"))
        return Case(name, twin.to(device), lambda dtype: load_model(None, device, dtype))
    if name == "dense":
        ref = build_reference(directory)
    else:
        ref = build_moe_reference(directory, *CONFIGS[MOE_CASE])
    return Case(name, ref.to(device), lambda dtype: load_model(directory, device, dtype))


def sequence(case: Case, model: NemotronH) -> list[int]:
    g = torch.Generator().manual_seed(SEEDS[case.name])
    vocab = model.cfg.vocab_size
    return torch.randint(0, vocab, (PROMPT + DECODE_STEPS,), generator=g).tolist()


@pytest.fixture(scope="module")
def cases(tmp_path_factory: pytest.TempPathFactory, cuda: torch.device) -> Iterator[Callable]:
    """Each case built once, when first asked for."""
    built: dict[str, Case] = {}

    def get(name: str) -> Case:
        if name not in built:
            built[name] = build_case(name, tmp_path_factory.mktemp(name), cuda)
        return built[name]

    yield get
    built.clear()
    torch.cuda.empty_cache()


@pytest.fixture
def exact_fp32() -> Iterator[None]:
    """float32 matmuls and convolutions in float32, not TF32 (10 bits of mantissa)."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def transformers_logits(
    ref: torch.nn.Module, tokens: list[int], device: torch.device
) -> torch.Tensor:
    """transformers' logits at every position, one forward over the whole sequence, as
    float32 on the host."""
    with torch.no_grad():
        return ref(torch.tensor([tokens], device=device)).logits[0].float().cpu()


def custody_logits(model: NemotronH, tokens: list[int], device: torch.device) -> torch.Tensor:
    """custody's logits at every position, as float32 on the host: a prefill of PROMPT
    tokens into slot 1, then one decode step per token, on scattered KV pages of pools
    in the model's dtype (as the executor sizes them)."""
    sizes = PoolSizes(TOKENS // PAGE, PAGE, 4)
    pools = DevicePools(model.cfg, sizes, device, model_dtype(model))
    (kv,) = scattered_kv([len(tokens)], PAGE, seed=9)
    with torch.inference_mode():
        logits = all_logits(model, pools, [row(tokens[:PROMPT], 0, kv, 1)], device)
        for t in range(PROMPT, len(tokens)):
            logits += all_logits(model, pools, [row(tokens[t : t + 1], t, kv, 1)], device)
    return torch.cat(logits).float().cpu()


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max())


def routed(
    model: torch.nn.Module, run: Callable[[], torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """`run()`'s logits [positions, vocab], and the experts every MoE layer of `model`
    chose at every position [positions, MoE layers * k], each layer's sorted ([positions,
    0] without MoE layers). Each router's calls are taken in order: custody calls it once
    for the prefill and once per decode step, transformers once for the whole sequence."""
    routers = [m for m in model.modules() if type(m).__name__ in ROUTERS]
    chosen: list[list[torch.Tensor]] = [[] for _ in routers]

    def keep(index: int) -> Callable:
        def hook(_module: torch.nn.Module, _args: tuple, out: tuple) -> None:
            chosen[index].append(out[-1].reshape(-1, out[-1].shape[-1]).sort(-1).values.cpu())

        return hook

    handles = [r.register_forward_hook(keep(i)) for i, r in enumerate(routers)]
    try:
        logits = run()
    finally:
        for handle in handles:
            handle.remove()
    layers = [torch.cat(calls) for calls in chosen]
    none = torch.zeros(len(logits), 0, dtype=torch.long)
    return logits, torch.cat(layers, dim=-1) if layers else none


def same_routing(exact: torch.Tensor, *others: torch.Tensor) -> int:
    """How many positions, from the first, every one of `others` routes every token as
    `exact` does: the positions before the first routing flip on any side."""
    flipped = torch.zeros(len(exact), dtype=torch.bool)
    for other in others:
        assert other.shape == exact.shape, (other.shape, exact.shape)
        flipped |= (other != exact).any(dim=-1)
    return int(flipped.nonzero()[0, 0]) if flipped.any() else len(exact)


@pytest.mark.parametrize("name", CASES)
def test_float32_logits_match_transformers(
    cases: Callable[[str], Case],
    name: str,
    cuda: torch.device,
    exact_fp32: None,
    record_property: Callable[[str, object], None],
):
    case = cases(name)
    model = case.ours("float32")
    assert model_dtype(model) == torch.float32
    tokens = sequence(case, model)
    expected = transformers_logits(case.reference, tokens, cuda)
    assert expected.abs().max() > 0.5  # the oracle is not comparing near-zero noise
    got = custody_logits(model, tokens, cuda)
    assert got.shape == expected.shape
    diff = max_diff(got, expected)
    record_property(f"max_logit_diff_fp32_{name}", diff)
    assert diff <= FP32_TOLERANCE, f"{name}: float32 logits differ by {diff:.3g}"


@pytest.mark.parametrize("name", CASES)
def test_bfloat16_logits_are_no_worse_than_twice_transformers_own_error(
    cases: Callable[[str], Case],
    name: str,
    cuda: torch.device,
    exact_fp32: None,
    record_property: Callable[[str, object], None],
):
    """Both sides in bfloat16, against transformers in float32 (the exact answer, as near
    as this gets). custody need not reproduce transformers' bf16 rounding: the two order
    and fuse their operations differently, and each rounds where the other does not. So
    the bound is on the error, not on the difference between the two: custody's largest
    error must be at most twice transformers' own, plus 0.02 (so a case where transformers'
    bf16 happens to be nearly exact does not demand the same luck of custody). What it
    catches: a step done in 16 bits that ought to be in 32 (the scan, the norms, the
    router), a state stored or read back in the wrong dtype, a wrong cast of the logits.

    A router's choice is discrete: where bf16 rounding makes either side pick other
    experts than float32 transformers does at some position, that position's logits and
    every later one's (through the Mamba state and the KV) jump by the flip, not by
    rounding (on CPU, by up to 4 when it happens). So the errors are taken over the
    positions before the first such flip on either side (all of them without MoE layers,
    or without a flip), at least MIN_COMPARED of them; the count is recorded too."""
    case = cases(name)
    model = case.ours("bfloat16")
    assert model_dtype(model) == torch.bfloat16
    tokens = sequence(case, model)
    ref16 = copy.deepcopy(case.reference).to(torch.bfloat16)
    exact, routes = routed(
        case.reference, lambda: transformers_logits(case.reference, tokens, cuda)
    )
    theirs, their_routes = routed(ref16, lambda: transformers_logits(ref16, tokens, cuda))
    ours, our_routes = routed(model, lambda: custody_logits(model, tokens, cuda))
    n = same_routing(routes, their_routes, our_routes)
    record_property(f"bf16_positions_compared_{name}", n)
    assert n >= MIN_COMPARED, f"{name}: a bf16 routing flip at position {n}: too few to compare"
    hf_error, our_error = max_diff(theirs[:n], exact[:n]), max_diff(ours[:n], exact[:n])
    record_property(f"hf_bf16_error_{name}", hf_error)
    record_property(f"max_logit_diff_bf16_{name}", our_error)
    bound = 2 * hf_error + 0.02
    assert our_error <= bound, (
        f"{name}: custody's bf16 error {our_error:.3g} > 2 x transformers' {hf_error:.3g} + 0.02"
    )
