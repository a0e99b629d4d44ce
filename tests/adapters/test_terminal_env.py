"""The terminal env: a persistent shell per episode, tasks from a folder, budgets, verifiers."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from agile_llmenvs.adapters.terminal import (
    CommandHistory,
    TaskFolder,
    TerminalConfig,
    TerminalEnvironment,
    is_incomplete,
)
from agile_llmenvs.backends import ToolCall
from agile_llmenvs.core import Action, Environment, EnvironmentSpec, State
from agile_llmenvs.errors import (
    EnvBuildError,
    EnvStateError,
    StaleStateError,
    TaskSelectionError,
)

HELP = (
    "\n\nReply with one shell command per turn (a ```bash block is fine); its output and exit "
    "status come back. Reply submit when the task is done."
)


def run(env: TerminalEnvironment, state: State, *commands: str) -> tuple[State, list[str]]:
    """Step ``commands`` in turn; returns the last state and every observation."""
    observations = []
    for command in commands:
        state = env.step(state, Action.from_text(command)).next_state
        observations.append(state.observation)
    return state, observations


@pytest.mark.parametrize(
    ("command", "incomplete"),
    [
        ("echo 'unclosed", True),
        ("cat <<EOF\nno terminator", True),
        ("if true; then", True),
        ("ls |", True),
        ("echo a \\", True),
        ("echo $(ls", True),
        ("echo ok", False),
        ("fi", False),  # a syntax error, not a wait for more input
        ("echo a \\\\", False),  # an escaped backslash
        ("cat <<EOF\nbody\nEOF", False),
        ("for i in 1 2; do\n  echo $i\ndone", False),
    ],
)
def test_is_incomplete_finds_what_would_leave_a_continuation_prompt(
    command: str, incomplete: bool
) -> None:
    assert is_incomplete(command) is incomplete


def test_reset_shows_the_instruction_and_starts_the_history(make_env) -> None:
    env = make_env()
    assert isinstance(env, Environment)
    assert env.spec == EnvironmentSpec(
        "terminal:terminal_tasks", pure_step=False, dataset_size=3, max_turns=30, forkable=False
    )
    state, info = env.reset(seed=7, options={"row_index": 1})
    instruction = "Create a file named `greeting.txt` in the current directory whose only line is:"
    assert state == State(
        observation=f"{instruction}\n\nHello, agent!{HELP}",
        messages=({"role": "user", "content": f"{instruction}\n\nHello, agent!{HELP}"},),
        task={"row_index": 1},
        episode_id=0,
        payload=CommandHistory(1, "create_greeting"),
        seed=7,
    )
    assert info == {"task_index": 1, "task_name": "create_greeting"}


def test_commands_run_in_one_persistent_shell(make_env) -> None:
    env = make_env()
    state, _ = env.reset(options={"task_index": 0})
    state, observations = run(
        env,
        state,
        "wc -l data.txt",
        "```bash\nmkdir sub && cd sub && answer=42\n```",
        "pwd | sed 's|.*/||'; echo $answer",
        "ls /nonexistent-dir-for-the-test 2>&1 | sed 's/.*: //'; false",
        "printf 'no newline'",
    )
    assert observations == [
        "37 data.txt\n[exit status 0]",
        "[exit status 0]",
        "sub\n42\n[exit status 0]",
        "No such file or directory\n[exit status 1]",
        "no newline\n[exit status 0]",
    ]
    assert state.payload == CommandHistory(
        0,
        "count_lines",
        (
            "wc -l data.txt",
            "mkdir sub && cd sub && answer=42",
            "pwd | sed 's|.*/||'; echo $answer",
            "ls /nonexistent-dir-for-the-test 2>&1 | sed 's/.*: //'; false",
            "printf 'no newline'",
        ),
        state.payload.budget_used_s,
    )
    assert 0 < state.payload.budget_used_s < 5
    assert state.messages[1:3] == (
        {"role": "assistant", "content": "wc -l data.txt"},
        {"role": "user", "content": "37 data.txt\n[exit status 0]"},
    )


def test_incomplete_and_empty_commands_are_not_run_nor_recorded(make_env) -> None:
    env = make_env()
    state, _ = env.reset(options={"task_index": 0})
    result = env.step(state, Action.from_text("echo 'unclosed > quote.txt"))
    assert result.next_state.observation == (
        "[incomplete command, not run: the shell would wait for more input (an unclosed "
        "quote, heredoc, block or trailing backslash); send the whole command again]"
    )
    assert result.info["incomplete"] is True
    state, observations = run(env, result.next_state, "   ", "ls")
    assert observations == [
        "[empty command, nothing was run: reply with one shell command, or 'submit' when the "
        "task is done]",
        "data.txt\n[exit status 0]",
    ]
    assert state.step_count == 3
    assert state.payload.commands == ("ls",)


def test_an_exiting_shell_is_replaced_keeping_the_files(make_env) -> None:
    env = make_env()
    state, _ = env.reset(options={"task_index": 0})
    state, observations = run(
        env, state, "kept=yes; echo file > made.txt; exit 3", 'echo "[$kept]"; cat made.txt'
    )
    assert observations == [
        "[the shell exited with status 3; a new shell was started]",
        "[]\nfile\n[exit status 0]",
    ]


def test_a_hung_command_is_killed_at_its_timeout(make_env, live_processes) -> None:
    env = make_env(command_timeout_s=0.5)
    state, _ = env.reset(options={"task_index": 0})
    started = time.monotonic()
    result = env.step(state, Action.from_text("echo started; sleep 30"))
    assert time.monotonic() - started < 5
    assert result.next_state.observation == (
        "started\n[timed out after 0.5 s; the shell was restarted]"
    )
    assert (result.info["timed_out"], result.info["exit_code"], result.done) == (True, None, False)
    assert len(live_processes()) == 1  # the sleep went with the old shell
    state, observations = run(env, result.next_state, "echo alive")
    assert observations == ["alive\n[exit status 0]"]


def test_long_output_is_cut_in_the_middle(make_env) -> None:
    env = make_env(max_output_chars=10)
    state, _ = env.reset(options={"task_index": 0})
    _, observations = run(env, state, "seq 1 20")
    # 51 characters: the first and the last 5 are kept
    assert observations == ["1\n2\n3\n[... 41 characters cut ...]\n9\n20\n[exit status 0]"]


def test_submit_runs_the_verifier_which_sets_the_reward(make_env, live_processes) -> None:
    env = make_env()
    state, _ = env.reset(options={"task_index": 1})
    state, _ = run(env, state, "echo 'Hello, agent!' > greeting.txt")
    result = env.step(state, Action.from_text("SUBMIT"))
    assert (result.reward, result.terminated, result.truncated) == (1.0, True, False)
    assert result.info == {
        "step": 2,
        "end_reason": "submitted",
        "verifier_output": "",
        "verifier_exit_code": 0,
    }
    assert result.next_state.done
    assert result.next_state.messages[-1] == {"role": "assistant", "content": "SUBMIT"}
    assert live_processes() == []  # the episode ended: its shell is gone

    state, _ = env.reset(options={"task_index": 1})
    state, _ = run(env, state, "echo 'Hello, world!' > greeting.txt")
    assert env.step(state, Action.from_text("```bash\nsubmit\n```")).reward == 0.0


def test_a_verifier_can_write_a_fractional_reward(make_env) -> None:
    env = make_env()
    state, _ = env.reset(options={"task_index": 2})
    state, _ = run(env, state, "mkdir -p project/src project/docs")
    result = env.step(state, Action.from_text("submit"))
    assert result.reward == 0.5
    assert result.info["verifier_output"] == "2 of 4 directories exist\n"


def test_a_tool_call_command_is_run_when_the_text_has_none(make_env) -> None:
    env = make_env()
    state, _ = env.reset(options={"task_index": 0})
    call = ToolCall("bash", {"command": "head -n 2 data.txt"})
    result = env.step(state, Action("", tool_calls=(call,)))
    assert result.next_state.observation == "word-1\nword-2\n[exit status 0]"


def test_max_steps_ends_the_episode_truncated_and_verified(make_env) -> None:
    env = make_env(max_steps=2)
    state, _ = env.reset(options={"task_index": 0})
    state, _ = run(env, state, "wc -l < data.txt > count.txt")
    result = env.step(state, Action.from_text("cat count.txt"))
    assert result.next_state.observation == (
        "37\n[exit status 0]\n[step limit of 2 reached: the episode is over]"
    )
    assert (result.reward, result.terminated, result.truncated) == (1.0, False, True)
    assert result.info["end_reason"] == "max_steps"


def test_the_time_budget_cuts_a_command_and_ends_the_episode(make_env) -> None:
    env = make_env(trajectory_timeout_s=0.5, command_timeout_s=30)
    state, _ = env.reset(options={"task_index": 0})
    started = time.monotonic()
    result = env.step(state, Action.from_text("sleep 30"))
    assert time.monotonic() - started < 5
    assert result.next_state.observation == (
        "[timed out after 0.5 s; the shell was restarted]\n"
        "[time budget of 0.5 s of command time spent: the episode is over]"
    )
    assert (result.reward, result.truncated, result.info["end_reason"]) == (
        0.0,
        True,
        "time_budget",
    )
    assert result.next_state.payload.budget_used_s >= 0.5


def test_a_state_is_stepped_once(make_env) -> None:
    env = make_env()
    state, _ = env.reset(options={"task_index": 0})
    env.step(state, Action.from_text("ls"))
    with pytest.raises(StaleStateError) as caught:
        env.step(state, Action.from_text("ls"))
    assert str(caught.value) == (
        "episode 0 at step 0 cannot be stepped: its sandbox has moved on, ended or been "
        "released (terminal steps are not pure: step each state once; restore a state on a "
        "fresh env with terminal_restore)"
    )


def test_episodes_run_side_by_side_and_release_frees_one(make_env, live_processes) -> None:
    env = make_env()
    first, _ = env.reset(options={"task_index": 0})
    second, _ = env.reset(options={"task_index": 0})
    first, _ = run(env, first, "echo one > mine.txt", "sleep 100 &")
    second, observations = run(env, second, "ls")
    assert observations == ["data.txt\n[exit status 0]"]
    assert len(live_processes()) == 3  # two shells and the background sleep
    env.release(first)
    assert len(live_processes()) == 1
    with pytest.raises(StaleStateError):
        env.step(first, Action.from_text("ls"))
    env.close()
    assert live_processes() == []
    with pytest.raises(EnvStateError) as caught:
        env.reset(options={"task_index": 0})
    assert str(caught.value) == "this terminal environment is closed; make a new one"


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (
            None,
            "reset options name no task: pass options={'task_index': i} (or {'row_index': i}, "
            "as runners do)",
        ),
        (
            {"task_index": 0, "row_index": 0},
            "reset options name both 'task_index' and 'row_index': pass options={'task_index': i} "
            "(or {'row_index': i}, as runners do)",
        ),
        (
            {"task_index": 0, "level": 2},
            "unknown reset option(s) ['level']: the terminal env takes one of 'task_index' or "
            "'row_index'",
        ),
        ({"task_index": 3}, "task_index 3 is out of range: this env has 3 tasks (0 .. 2)"),
        ({"row_index": True}, "task_index must be an int, got True"),
    ],
)
def test_reset_options_must_select_one_task(make_env, options, message: str) -> None:
    env = make_env()
    with pytest.raises(TaskSelectionError) as caught:
        env.reset(options=options)
    assert str(caught.value) == message


def test_a_failing_setup_leaves_nothing_behind(make_env, tmp_path: Path, live_processes) -> None:
    task = tmp_path / "tasks" / "broken"
    task.mkdir(parents=True)
    (task / "instruction.md").write_text("Nothing to do.")
    (task / "verify.sh").write_text("true\n")
    (task / "setup.sh").write_text("echo preparing; exit 4\n")
    env = make_env(tmp_path / "tasks")
    with pytest.raises(EnvBuildError) as caught:
        env.reset(options={"task_index": 0})
    assert str(caught.value) == (
        "setup.sh of task 'broken' exited 4; its output ends: 'preparing\\n'"
    )
    assert live_processes() == []


def test_a_tasks_folder_needs_instruction_and_verifier(tmp_path: Path) -> None:
    with pytest.raises(EnvBuildError) as caught:
        TaskFolder(tmp_path / "missing")
    assert str(caught.value) == (
        f"tasks_dir {str(tmp_path / 'missing')!r} is not a directory of task folders"
    )
    (tmp_path / "tasks" / "only_instruction").mkdir(parents=True)
    (tmp_path / "tasks" / "only_instruction" / "instruction.md").write_text("Do it.")
    with pytest.raises(EnvBuildError) as caught:
        TerminalEnvironment(tmp_path / "tasks")
    assert str(caught.value) == (
        f"task 'only_instruction' in {str(tmp_path / 'tasks')!r} has no verify.sh; each task "
        "folder needs instruction.md and verify.sh (setup.sh is optional)"
    )


def test_config_values_are_checked() -> None:
    with pytest.raises(ValueError, match=r"^command_timeout_s must be > 0, got 0$"):
        TerminalConfig(command_timeout_s=0)
    with pytest.raises(ValueError, match=r"^trajectory_timeout_s must be > 0 or None, got -1$"):
        TerminalConfig(trajectory_timeout_s=-1)
