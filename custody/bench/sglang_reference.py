"""Load SGLang 0.5.23's own allocator classes, unmodified, as the benchmark reference.

Only the two allocator modules are loaded, from the installed wheel, by file path:
importing `sglang` itself pulls in the whole server. Their few imports are satisfied by
the smallest shim: the platform says Triton is unavailable (true on this CPU, so SGLang
takes its own torch-native path), and the utilities they use are taken from SGLang's
`utils/common.py` source by name rather than re-implemented.

`custody bench prefix` has no SGLang figures; `prefix_cache_reference` says why, in its
results.
"""

from __future__ import annotations

import ast
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


def _root() -> Path:
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        raise ReferenceUnavailable(f"SGLang is not installed; run: {INSTALL_HINT}")
    return Path(next(iter(spec.submodule_search_locations)))


def _package(name: str, path: Path) -> None:
    if name not in sys.modules:
        module = types.ModuleType(name)
        module.__path__ = [str(path)]
        sys.modules[name] = module


def _functions_from(source: Path, names: set[str], namespace: dict) -> types.ModuleType:
    tree = ast.parse(source.read_text())
    picked = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in names]
    missing = names - {n.name for n in picked}
    if missing:
        raise ReferenceUnavailable(f"{source} lacks {sorted(missing)}")
    module = types.ModuleType("sglang.srt.utils")
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

    root = _root()
    for pkg in (
        "",
        ".srt",
        ".srt.mem_cache",
        ".srt.mem_cache.allocator",
        ".kernels",
        ".kernels.ops",
        ".kernels.ops.memory",
    ):
        _package("sglang" + pkg, root.joinpath(*pkg.split(".")[1:]))
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


def prefix_cache_reference() -> dict:
    """`custody bench prefix`'s `sglang_reference` entry: SGLang's Mamba radix cache is
    not driven, and why (what is installed, and where its states come from)."""
    try:
        root = _root()
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
