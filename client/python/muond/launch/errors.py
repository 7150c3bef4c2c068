"""How a launch fails; the cli turns each into its exit status."""
from __future__ import annotations


class LaunchError(ValueError):
    """A launch refused before anything started; the message names the
    option or environment variable and the rule. Exit status 2."""


class ServerDied(Exception):
    """A server the launcher started died, did not answer in time, or a rank
    never joined: everything is stopped. Exit status 1."""


class Interrupted(Exception):
    """A stop signal reached the launcher. Exit status 128 + the signal."""

    def __init__(self, signum: int):
        super().__init__(f"signal {signum}")
        self.signum = signum
