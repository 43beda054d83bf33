import argparse

import pytest

from lightning_5d.estimate import cli


@pytest.fixture
def l5d(capsys):
    """Run an `l5d estimate|plan` command line in this process: (exit code, stdout, stderr)."""

    def run(argv):
        parser = argparse.ArgumentParser(prog="l5d")
        cli.register(parser.add_subparsers(dest="command", required=True))
        args = parser.parse_args(argv)
        code = args.func(args)
        out = capsys.readouterr()
        return code, out.out, out.err

    return run
