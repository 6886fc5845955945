"""The `--dtype` setting: the one dtype of the model's weights, the KV pool and the conv
state (device, host tier and disk blobs alike). The SSM state is not its: it is stored
in the checkpoint's `mamba_ssm_cache_dtype` (ModelConfig; float32 unless the config
names a 16-bit one), and always computed in float32. Pure data: no torch here, so the
scheduler sizes the tiers from the same names the executor allocates with.
"""

from __future__ import annotations

from shared.model_config import ModelConfig

AUTO = "auto"
ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}  # bytes per element
CHOICES = (AUTO, *ITEMSIZE)


def check_dtype(setting: str) -> None:
    if setting not in CHOICES:
        raise ValueError(f"dtype must be one of {', '.join(CHOICES)}, not {setting!r}")


def resolve_dtype(setting: str, model: ModelConfig, gpu: bool) -> str:
    """The executor's dtype. `auto`: the checkpoint's saved dtype on a GPU (what it was
    trained for), float32 on a CPU (where 16-bit matmuls are slow and gain nothing)."""
    check_dtype(setting)
    if setting != AUTO:
        return setting
    saved = model.torch_dtype
    return saved if gpu and saved in ITEMSIZE else "float32"


def sizing_dtype(setting: str) -> str:
    """The dtype the tiers are sized for, computed alike by every service whatever its
    device (the scheduler sees none). `auto` sizes for float32, the largest state an
    executor may resolve it to, so a tier never holds more than its byte budget; an
    executor that resolves it to 16 bits fills the budget only part way."""
    check_dtype(setting)
    return "float32" if setting == AUTO else setting
