"""Launching hvdkit jobs: ``hvdkitrun`` and the scheduler/worker rendezvous."""

__all__ = ["main"]


def main(argv=None) -> int:
    """Entry point of ``hvdkitrun`` / ``python -m hvdkit.launch``."""
    from .cli import main as cli_main

    return cli_main(argv)
