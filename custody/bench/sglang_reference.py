"""Load SGLang 0.5.23's own code, unmodified, from the installed wheel: its allocator
classes (the benchmark reference) and its `bench_serving` (custody bench serving).

Importing `sglang` itself pulls in the whole server, so packages whose `__init__` would
do that are loaded bare (`package`), and the few names the loaded files need from such
modules are satisfied by the smallest shim. The allocators: the platform says Triton is
unavailable (true on this CPU, so SGLang takes its own torch-native path), and the
utilities they use are taken from SGLang's `utils/common.py` source by name rather than
re-implemented. bench_serving: one constant from `disaggregation/utils.py`, by name.

`custody bench prefix` has no SGLang figures; `prefix_cache_reference` says why, in its
results.
"""

from __future__ import annotations

import ast
import importlib
import importlib.machinery
import importlib.util
import sys
import types
from pathlib import Path

SGLANG_VERSION = "0.5.23"
INSTALL_HINT = f"pip install --no-deps sglang=={SGLANG_VERSION}"


# Why SGLang's Mamba radix cache cannot stand beside `custody bench prefix`, installed or
# not: the hits it would report depend on where states were put, and SGLang's scheduler
# decides that during the forward, not its cache.
PREFIX_CACHE_NOT_DRIVEN = (
    "where SGLang's hybrid prefix cache holds a Mamba state is decided by its scheduler "
    "during the forward (ScheduleBatch: mamba_last_track_seqlen, mamba_branching_seqlen, "
    "with the model runner's track buffers, GPU-bound), not by the cache; the cache class "
    "driven alone on CPU would report the states a replay put there, not SGLang's, so no "
    "SGLang hit tokens are reported"
)


class ReferenceUnavailable(RuntimeError):
    pass


def sglang_root() -> Path:
    """The installed wheel's `sglang` directory (its `__init__` is never run)."""
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        raise ReferenceUnavailable(f"SGLang is not installed; run: {INSTALL_HINT}")
    return Path(next(iter(spec.submodule_search_locations)))


def package(name: str, path: Path) -> None:
    """`name` as a package whose submodules load from `path`, its `__init__` not run (a
    spec is kept, so `importlib.util.find_spec` still answers for it)."""
    if name not in sys.modules:
        spec = importlib.machinery.ModuleSpec(name, None, is_package=True)
        spec.submodule_search_locations = [str(path)]
        sys.modules[name] = importlib.util.module_from_spec(spec)


def _functions_from(source: Path, names: set[str], namespace: dict) -> types.ModuleType:
    tree = ast.parse(source.read_text())
    picked = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in names]
    missing = names - {n.name for n in picked}
    if missing:
        raise ReferenceUnavailable(f"{source} lacks {sorted(missing)}")
    module = types.ModuleType("sglang.srt.utils")
    module.__path__ = [str(source.parent)]  # its submodules still load (bench_serving's)
    module.__dict__.update(namespace)
    exec(compile(ast.Module(body=picked, type_ignores=[]), str(source), "exec"), module.__dict__)
    return module


def _load(name: str, path: Path) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def load_allocators() -> tuple[type, type]:
    """(MambaSlotAllocator, PagedTokenToKVPoolAllocator) from the installed SGLang."""
    import logging
    import os
    from functools import lru_cache
    from typing import Optional

    import torch

    root = sglang_root()
    for pkg in (
        "",
        ".srt",
        ".srt.mem_cache",
        ".srt.mem_cache.allocator",
        ".kernels",
        ".kernels.ops",
        ".kernels.ops.memory",
    ):
        package("sglang" + pkg, root.joinpath(*pkg.split(".")[1:]))
    utils = _functions_from(
        root / "srt" / "utils" / "common.py",
        {"get_bool_env_var", "get_num_new_pages", "is_hip", "next_power_of_2"},
        {
            "os": os,
            "torch": torch,
            "Optional": Optional,
            "lru_cache": lru_cache,
            "logger": logging.getLogger("sglang"),
            "_warned_bool_env_var_keys": set(),
        },
    )
    sys.modules["sglang.srt.utils"] = utils
    kernels = types.ModuleType("sglang.kernels.ops.memory.allocator")
    kernels.alloc_decode_kernel = kernels.alloc_extend_kernel = None  # Triton: not on CPU
    sys.modules[kernels.__name__] = kernels
    platforms = types.ModuleType("sglang.srt.platforms")
    platforms.current_platform = types.SimpleNamespace(
        capabilities=types.SimpleNamespace(supports_triton=False)
    )
    sys.modules[platforms.__name__] = platforms
    alloc_dir = root / "srt" / "mem_cache" / "allocator"
    _load("sglang.srt.mem_cache.allocator.base", alloc_dir / "base.py")
    paged = _load("sglang.srt.mem_cache.allocator.paged", alloc_dir / "paged.py")
    mamba = _load("sglang.srt.mem_cache.allocator.mamba", alloc_dir / "mamba.py")
    return mamba.MambaSlotAllocator, paged.PagedTokenToKVPoolAllocator


def _constant(source: Path, name: str) -> object:
    """A module-level constant of `source`, read from its text (the module is not run)."""
    for node in ast.parse(source.read_text()).body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == name for t in node.targets
        ):
            return ast.literal_eval(node.value)
    raise ReferenceUnavailable(f"{source} lacks {name}")


def load_bench_serving() -> types.ModuleType:
    """SGLang's `sglang/benchmark/serving.py` (`python -m sglang.bench_serving`), as
    shipped. Its imports run as they are, but for the `__init__`s of `sglang`,
    `sglang.srt.utils` and `sglang.srt.disaggregation` (bare packages) and
    `sglang.srt.disaggregation.utils` (torch.distributed and the server), of which it
    uses FAKE_BOOTSTRAP_HOST alone. The packages its import chain needs beyond custody's
    are in the `bench` extra (orjson, pybase64, psutil, pyzmq, datasets)."""
    root = sglang_root()
    for pkg in ("", ".srt", ".srt.utils", ".srt.disaggregation"):
        package("sglang" + pkg, root.joinpath(*pkg.split(".")[1:]))
    name = "sglang.srt.disaggregation.utils"
    if name not in sys.modules:
        shim = types.ModuleType(name)
        source = root / "srt" / "disaggregation" / "utils.py"
        shim.FAKE_BOOTSTRAP_HOST = _constant(source, "FAKE_BOOTSTRAP_HOST")
        sys.modules[name] = shim
    return importlib.import_module("sglang.benchmark.serving")


def prefix_cache_reference() -> dict:
    """`custody bench prefix`'s `sglang_reference` entry: SGLang's Mamba radix cache is
    not driven, and why (what is installed, and where its states come from)."""
    try:
        root = sglang_root()
    except ReferenceUnavailable:
        found = (
            f"SGLang is not installed here ({SGLANG_VERSION}'s wheel, read for this "
            "benchmark, defines no MambaRadixCache: its Mamba prefix cache is a component "
            "of UnifiedRadixCache)"
        )
    else:
        sources = (root / "srt" / "mem_cache").rglob("*.py")
        defined = any("class MambaRadixCache(" in path.read_text() for path in sources)
        found = f"the installed SGLang {'defines' if defined else 'has no'} MambaRadixCache"
    return {"driven": False, "reason": f"{found}; {PREFIX_CACHE_NOT_DRIVEN}"}
