"""The peers' tests run the field's own tools against custody; SGLang's kit needs its
heavy imports replaced first (sglang_kit_shim.py), before any test module imports it."""

from __future__ import annotations

from tests.peers import sglang_kit_shim

sglang_kit_shim.install()
