"""README.md's "Run your own training script": the servers started by hand
share a job token. The snippet makes one under umask 077, the coordinator and
every daemon read it with --token_file and the trainer passes token_file=,
and the coordinator's --listen is one it serves without further flags (a
coordinator without a token would let any local process join, fill its jobs
and squat the job id)."""
import os
import re
import shlex
import unittest

RUNFILES = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
SECTION = "## Run your own training script"


def manual_path():
    """(shell commands with their continuation lines joined, python code)."""
    with open(os.path.join(RUNFILES, "README.md")) as f:
        text = f.read()
    start = text.index(SECTION)
    end = text.index("\n## ", start + len(SECTION))
    blocks = re.findall(r"```(\w+)\n(.*?)```", text[start:end], re.S)
    shell = [b for lang, b in blocks if lang == "sh"]
    python = [b for lang, b in blocks if lang == "python"]
    if len(shell) != 1 or len(python) != 1:
        raise AssertionError(f"expected one sh and one python block, got {blocks}")
    return shell[0].replace("\\\n", " ").splitlines(), python[0]


def server_args(commands, binary):
    """The argument lists of every command that runs `binary`."""
    found = []
    for line in commands:
        words = shlex.split(line, comments=True)
        for i, word in enumerate(words):
            if word.endswith("/" + binary):
                found.append(words[i + 1:])
    return found


class ReadmeManualPathTest(unittest.TestCase):
    def test_servers_and_trainer_share_a_private_token(self):
        commands, python = manual_path()
        made = [line for line in commands if "umask 077" in line and "/dev/urandom" in line]
        self.assertEqual(len(made), 1, f"no token made under umask 077 in {commands}")
        token = re.search(r">\s*(\S+?)\)?\s*(#.*)?$", made[0]).group(1)
        coordinators = server_args(commands, "muond-coordinator")
        daemons = server_args(commands, "muond-daemon")
        self.assertEqual(len(coordinators), 1, commands)
        self.assertGreaterEqual(len(daemons), 1, commands)
        for args in coordinators + daemons:
            self.assertIn(f"--token_file={token}", args)
        self.assertIn(f'token_file="{token}"', python)

    def test_the_coordinator_listens_on_this_host(self):
        commands, _ = manual_path()
        (args,) = server_args(commands, "muond-coordinator")
        listen = [a.split("=", 1)[1] for a in args if a.startswith("--listen=")]
        self.assertEqual(len(listen), 1, args)
        self.assertRegex(listen[0], r"^(127\.\d+\.\d+\.\d+|localhost|\[::1\]):\d+$|^unix:")


if __name__ == "__main__":
    unittest.main()
