"""How an action's text becomes a shell command, and a command's result an observation."""

from __future__ import annotations

import re
from dataclasses import dataclass

from agile_llmenvs.adapters.terminal.shell import CommandResult
from agile_llmenvs.core.types import Action

__all__ = ["ParsedAction", "format_observation", "parse_action", "truncate_output"]

_FENCE = re.compile(r"```[ \t]*(?:bash|sh|shell|console)?[ \t]*\n(.*?)```", re.S)


@dataclass(frozen=True)
class ParsedAction:
    """What the policy asked for: a command to run, or to submit.

    Attributes:
        command: The shell command ("" when there is none).
        submit: The policy declared the task done.
    """

    command: str
    submit: bool = False


def parse_action(action: Action, submit_keyword: str) -> ParsedAction:
    """The command in ``action``.

    The first fenced block (```` ```bash ````, ```` ```sh ````, or bare ```` ``` ````) is the
    command when the text has one, else the whole text, stripped. A tool call with a string
    ``command`` argument is used when the text holds no command. The command
    ``submit_keyword`` alone (any case) ends the episode instead of running.
    """
    fenced = _FENCE.search(action.text)
    command = (fenced.group(1) if fenced else action.text).strip()
    if not command:
        for call in action.tool_calls:
            argument = call.arguments.get("command")
            if isinstance(argument, str) and argument.strip():
                command = argument.strip()
                break
    if command.lower() == submit_keyword.lower():
        return ParsedAction("", submit=True)
    return ParsedAction(command)


def truncate_output(text: str, max_chars: int) -> str:
    """``text`` cut to its first and last ``max_chars // 2`` characters when longer."""
    if len(text) <= max_chars:
        return text
    half = max_chars // 2
    cut = len(text) - 2 * half
    return f"{text[:half]}\n[... {cut} characters cut ...]\n{text[len(text) - half :]}"


def format_observation(result: CommandResult, max_chars: int) -> str:
    """What the policy reads after a command: its output, then one bracketed status line."""
    if result.incomplete:
        return (
            "[incomplete command, not run: the shell would wait for more input (an unclosed "
            "quote, heredoc, block or trailing backslash); send the whole command again]"
        )
    output = truncate_output(result.output, max_chars)
    if result.timed_out:
        status = f"[timed out after {result.elapsed_s:.1f} s; the shell was restarted]"
    elif result.shell_restarted:
        status = f"[the shell exited with status {result.exit_code}; a new shell was started]"
    else:
        status = f"[exit status {result.exit_code}]"
    if output and not output.endswith("\n"):
        output += "\n"
    return output + status
