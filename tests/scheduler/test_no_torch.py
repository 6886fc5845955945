"""The scheduler is a pure-Python process: importing all of it loads no torch."""

import subprocess
import sys

CHECK = """
import pkgutil, importlib, sys
import services.scheduler as root
for mod in pkgutil.walk_packages(root.__path__, "services.scheduler."):
    importlib.import_module(mod.name)
importlib.import_module("shared.deferred_ops")
importlib.import_module("shared.tokenizer")
print("torch loaded" if "torch" in sys.modules else "no torch")
"""


def test_scheduler_imports_no_torch():
    done = subprocess.run(
        [sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "no torch"
