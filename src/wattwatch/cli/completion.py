"""``wattwatch completion bash|zsh|fish``: the shell's hook for Tab completion, from argcomplete.

The script asks ``wattwatch`` itself what to offer: on Tab the shell runs the command with
``_ARGCOMPLETE`` set, and ``main`` hands the parser to argcomplete, which answers from the same parser
a run uses (commands, actions, options, option choices) and exits before any command runs.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from wattwatch.cli import options
from wattwatch.config import Settings

SHELLS = ("bash", "zsh", "fish")

EPILOG = """examples:
  source <(wattwatch completion bash)          this shell; add it to ~/.bashrc to keep it
  wattwatch completion zsh > ~/.zfunc/_wattwatch   a directory on $fpath, before compinit in ~/.zshrc
  wattwatch completion fish > ~/.config/fish/completions/wattwatch.fish"""


def add_parser(sub: Any) -> None:
    """Add ``completion`` to the command parsers ``sub``."""
    comp = options.add_command(
        sub, "completion", help="print a shell completion script (bash, zsh or fish)", epilog=EPILOG
    )
    comp.add_argument("shell", choices=SHELLS, help="the shell to complete in")


def script(shell: str, prog: str = "wattwatch") -> str:
    """The completion script for ``shell``, completing the command ``prog``."""
    from argcomplete.shell_integration import shellcode

    return shellcode([prog], shell=shell)


def run(args: argparse.Namespace, settings: Settings) -> int:
    """Print the script."""
    sys.stdout.write(script(args.shell))
    return 0
