"""``wattwatch completion bash|zsh|fish``: a shell completion script generated from the argument parser.

The script is static: every command, action, option and option choice is written into it, so pressing Tab
never starts Python (a start costs a few hundred milliseconds). Regenerate it after an upgrade. zsh uses the
bash script through ``bashcompinit``; fish gets its own ``complete`` lines.
"""

from __future__ import annotations

import argparse
import shlex
from collections.abc import Iterator
from typing import Any

from wattwatch.record import field, record

SHELLS = ("bash", "zsh", "fish")


def add_parser(sub: Any, formatter: type[argparse.HelpFormatter]) -> None:
    """Register ``wattwatch completion``."""
    comp = sub.add_parser(
        "completion",
        help="print a shell completion script (bash, zsh or fish)",
        formatter_class=formatter,
        epilog="examples:\n  source <(wattwatch completion bash)          this shell; add it to ~/.bashrc to keep it\n"
        "  wattwatch completion zsh > ~/.zfunc/wattwatch.zsh   then source it from ~/.zshrc\n"
        "  wattwatch completion fish > ~/.config/fish/completions/wattwatch.fish",
    )
    comp.add_argument("shell", choices=SHELLS, help="the shell to complete in")


@record
class Level:
    """A command (or the program itself): its words, its options, and which options take which values."""

    path: tuple[str, ...]
    help: str = ""
    commands: dict[str, str] = field(default_factory=dict)  # name -> help
    options: dict[str, str] = field(default_factory=dict)  # flag -> help
    values: dict[str, tuple[str, ...] | None] = field(default_factory=dict)  # flag -> choices (None: any)


def levels(parser: argparse.ArgumentParser, path: tuple[str, ...] = (), help_text: str = "") -> Iterator[Level]:
    """Every command level of ``parser``, the program first, depth first."""
    level = Level(path, help_text)
    children: list[tuple[str, argparse.ArgumentParser, str]] = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help or "" for a in action._choices_actions}
            for name, child in action.choices.items():
                level.commands[name] = str(helps.get(name, ""))
                children.append((name, child, str(helps.get(name, ""))))
            continue
        if action.help == argparse.SUPPRESS:
            continue
        if not action.option_strings:
            # A positional with choices (`completion bash`) is offered like a command word.
            for choice in action.choices or ():
                level.commands[str(choice)] = str(action.help or "")
            continue
        for flag in action.option_strings:
            level.options[flag] = str(action.help or "")
            if action.nargs != 0:
                level.values[flag] = tuple(str(c) for c in action.choices) if action.choices else None
    yield level
    for name, child, text in children:
        yield from levels(child, (*path, name), text)


def script(parser: argparse.ArgumentParser, shell: str, prog: str = "wattwatch") -> str:
    """The completion script for ``shell``."""
    found = list(levels(parser))
    if shell == "fish":
        return _fish(found, prog)
    text = _bash(found, prog)
    if shell == "zsh":
        return (
            f"# {prog} completion for zsh: the bash completion through bashcompinit.\n"
            "autoload -U +X compinit && compinit\nautoload -U +X bashcompinit && bashcompinit\n" + text
        )
    return text


def _bash(found: list[Level], prog: str) -> str:
    fn = "_" + prog.replace("-", "_")
    words = []
    for level in found:
        key = " ".join(level.path)
        words.append(f"        {shlex.quote(key)}) cmds={shlex.quote(' '.join(level.commands))}; "
                     f"opts={shlex.quote(' '.join(level.options))}; "
                     f"vals={shlex.quote(' '.join(level.values))} ;;")  # fmt: skip
    choices = []
    for level in found:
        for flag, values in level.values.items():
            if values:
                pattern = shlex.quote(f"{' '.join(level.path)}|{flag}")
                words_of = shlex.quote(" ".join(values))
                choices.append(f'        {pattern}) COMPREPLY=($(compgen -W {words_of} -- "$cur")); return 0 ;;')
    return f"""# {prog} completion for bash; load it with: source <({prog} completion bash)
{fn}() {{
    local cur="${{COMP_WORDS[COMP_CWORD]}}" prev="${{COMP_WORDS[COMP_CWORD-1]}}"
    local key="" cmds opts vals next i w
    _{fn}_level() {{
        case "$1" in
{chr(10).join(words)}
        *) cmds=""; opts=""; vals="" ;;
        esac
    }}
    # Walk the words before the cursor: command names go down a level; an option's value is skipped;
    # after `--` the words are another command's (wattwatch run -- CMD): complete files.
    for ((i = 1; i < COMP_CWORD; i++)); do
        w="${{COMP_WORDS[i]}}"
        if [[ "$w" == "--" ]]; then COMPREPLY=($(compgen -f -- "$cur")); return 0; fi
        _{fn}_level "$key"
        if [[ "$w" == -* ]]; then
            [[ " $vals " == *" $w "* ]] && ((i++))
            continue
        fi
        next="${{key:+$key }}$w"
        [[ " $cmds " == *" $w "* ]] && key="$next"
    done
    _{fn}_level "$key"
    case "$key|$prev" in
{chr(10).join(choices)}
    esac
    if [[ " $vals " == *" $prev "* ]]; then COMPREPLY=($(compgen -f -- "$cur")); return 0; fi
    if [[ "$cur" == -* || -z "$cmds" ]]; then
        COMPREPLY=($(compgen -W "$opts" -- "$cur"))
    else
        COMPREPLY=($(compgen -W "$cmds" -- "$cur"))
    fi
    return 0
}}
complete -o default -F {fn} {prog}
"""


def _fish_text(text: str) -> str:
    return shlex.quote(" ".join(text.split())[:100])


def _fish(found: list[Level], prog: str) -> str:
    lines = [
        f"# {prog} completion for fish; save it as ~/.config/fish/completions/{prog}.fish",
        f"complete -c {prog} -f",
    ]
    for level in found:
        # Options once the level's command words are typed; its command names only until one of them is.
        cond = "; and ".join(f"__fish_seen_subcommand_from {w}" for w in level.path) or "__fish_use_subcommand"
        names_cond = cond
        if level.path and level.commands:
            names_cond += "; and not __fish_seen_subcommand_from " + " ".join(level.commands)
        for name, text in level.commands.items():
            lines.append(f"complete -c {prog} -n {shlex.quote(names_cond)} -a {name} -d {_fish_text(text)}")
        for flag, text in level.options.items():
            values = level.values.get(flag, ())
            arg = f"-l {flag[2:]}" if flag.startswith("--") else f"-s {flag[1:]}"
            if values:
                arg += f" -x -a {shlex.quote(' '.join(values))}"
            elif flag in level.values:
                arg += " -r -F"
            lines.append(f"complete -c {prog} -n {shlex.quote(cond)} {arg} -d {_fish_text(text)}")
    return "\n".join(lines) + "\n"
