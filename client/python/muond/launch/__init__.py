"""`muond launch`: muond's servers around any trainer command.

    cli         the subcommand: options, help text, exit statuses, main()
    config      options + torchrun/Slurm environment -> one LaunchLayout
                (slurm: compressed host lists; addresses: hosts and ports)
    discovery   the server binaries, muonctl, GPUs and address of this host
    launcher    Launch: start the servers, run the command, stop everything
                (servers: a started server; joins: every rank joined?)
    processes   finding, signalling, stopping and reaping the command's
                processes; the job's dead shm objects
    reaper      the forked process that cleans up after a SIGKILLed launcher
    errors      LaunchError (refused: 2), ServerDied (1), Interrupted (128+N)
    messages    the launcher's log lines and how an exit is described

The `muond` command (muond/cli.py) calls add_parser() and main().
"""
from muond.launch.cli import add_parser, main
from muond.launch.config import LaunchLayout, check_paths, resolve
from muond.launch.discovery import count_gpus
from muond.launch.errors import LaunchError
from muond.launch.launcher import Launch

__all__ = ["Launch", "LaunchError", "LaunchLayout", "add_parser", "check_paths", "count_gpus",
           "main", "resolve"]
