"""How every service starts, so that all four are run, configured and debugged alike:
settings from flags and the environment (shared/config.py), log lines that name the
service, and `kill -USR1` printing every thread's stack (a hung loop shows where)."""

from __future__ import annotations

import argparse
import faulthandler
import logging
import signal

from shared.config import Settings


def start(service: str, argv: list[str] | None = None) -> Settings:
    """The settings of `service` from `argv` (None: the command line), logging set up."""
    parser = argparse.ArgumentParser(description=f"custody {service} service")
    Settings.add_arguments(parser)
    settings = Settings.resolve(parser.parse_args(argv))
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {service} %(message)s")
    faulthandler.register(signal.SIGUSR1)
    return settings
