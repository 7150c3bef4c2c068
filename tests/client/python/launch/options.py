"""What the launcher's unit tests share: `muond launch` options parsed by the
real parser, and the layout they resolve to in a given environment with a
fixed GPU count, host address and generated job id."""
from muond import cli
from muond.launch.config import resolve


def options(*argv):
    """The parsed options of `muond launch ARGV -- true`."""
    return cli.build_parser().parse_args(["launch", *argv, "--", "true"])


def layout(argv=(), env=None, gpus=0, host="10.0.0.5"):
    """resolve() of `argv` in `env` (nothing of the real host read)."""
    return resolve(options(*argv), env or {}, count_gpus=lambda: gpus,
                   resolve_host=lambda: host, new_job_id=lambda: "gen-1")
