"""Restore by replay on fresh terminal envs, and replay validation."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from hashlib import sha256
from pathlib import Path

import pytest

from agile_llmenvs.adapters.terminal import (
    DEFAULT_PROBES,
    CommandHistory,
    TaskFolder,
    TerminalConfig,
    TerminalEnvironment,
    terminal_restore,
    validate_replay_consistency,
)
from agile_llmenvs.core import Action, State
from agile_llmenvs.errors import ContinuationPromptError, ReplayError, TaskMismatchError

TASKS = Path(__file__).resolve().parents[2] / "manifests" / "data" / "terminal_tasks"
FINGERPRINT = "find . -type f -exec md5sum {} + | sort -k 2; pwd | sed 's|.*/work||'"
PREFIX = ("mkdir -p out/deep && cd out", "wc -l < ../data.txt > n.txt", "x=$(cat n.txt)")
CONTINUATION = ("echo $x > deep/copy.txt", "cd .. && cp out/n.txt count.txt", FINGERPRINT)


def run(env: TerminalEnvironment, state: State, *commands: str) -> tuple[State, list[str]]:
    observations = []
    for command in commands:
        state = env.step(state, Action.from_text(command)).next_state
        observations.append(state.observation)
    return state, observations


def test_restore_then_continue_gives_the_files_of_an_uninterrupted_run(make_env) -> None:
    uninterrupted = make_env()
    state, _ = uninterrupted.reset(seed=3, options={"row_index": 0})
    expected_end, expected = run(uninterrupted, state, *PREFIX, *CONTINUATION)

    original = make_env()
    state, _ = original.reset(seed=3, options={"row_index": 0})
    saved, _ = run(original, state, *PREFIX)
    fresh = make_env()
    restored = terminal_restore(fresh, saved)
    assert restored == replace(saved, episode_id=0)
    end, observations = run(fresh, restored, *CONTINUATION)

    assert observations == expected[len(PREFIX) :]
    *files, cwd, status = observations[-1].split("\n")
    assert [line.split()[1] for line in files] == [
        "./count.txt",
        "./data.txt",
        "./out/deep/copy.txt",
        "./out/n.txt",
    ]
    assert (cwd, status) == ("", "[exit status 0]")  # back in the working directory
    assert end.messages == expected_end.messages
    assert end.payload.commands == (*PREFIX, *CONTINUATION)
    assert fresh.step(end, Action.from_text("submit")).reward == 1.0
    # the saved state's own episode is untouched by the restore
    _, own = run(original, saved, "cat deep/copy.txt 2>&1; echo $x")
    assert own == ["cat: deep/copy.txt: No such file or directory\n37\n[exit status 0]"]


def test_replay_time_is_not_charged_to_the_continuation(work_root: Path, tmp_path: Path) -> None:
    # the commands read a file the test changes outside any work folder: unsandboxed
    made: list[TerminalEnvironment] = []

    def make_env(**config: float) -> TerminalEnvironment:
        tasks = TaskFolder(TASKS, work_root=work_root, sandbox="none")
        made.append(TerminalEnvironment(tasks, TerminalConfig(**config)))
        return made[-1]

    try:
        _replay_time_is_not_charged(make_env, tmp_path)
    finally:
        for env in made:
            env.close()


def _replay_time_is_not_charged(
    make_env: Callable[..., TerminalEnvironment], tmp_path: Path
) -> None:
    delay = tmp_path / "delay"
    command = f"sleep $(cat {delay})"  # as long as the file says: a replay can be slower
    delay.write_text("0.1")
    original = make_env(trajectory_timeout_s=1.0)
    state, _ = original.reset(options={"task_index": 0})
    saved, _ = run(original, state, command)
    used = saved.payload.budget_used_s
    assert 0.1 <= used < 0.5

    delay.write_text("1.2")  # the replay alone outlasts the whole budget
    fresh = make_env(trajectory_timeout_s=1.0)
    restored = terminal_restore(fresh, saved)
    assert restored.payload.budget_used_s == used  # re-anchored: exactly what was left
    delay.write_text("0.3")
    going = fresh.step(restored, Action.from_text(command))
    assert going.done is False
    assert going.info["budget_left_s"] == pytest.approx(1.0 - used - 0.3, abs=0.2)
    delay.write_text("5")
    cut = fresh.step(going.next_state, Action.from_text(command))
    assert (cut.truncated, cut.info["end_reason"]) == (True, "time_budget")

    # A naive replay through step() spends the continuation's budget on the replay itself.
    delay.write_text("1.2")
    naive = make_env(trajectory_timeout_s=1.0)
    state, _ = naive.reset(options={"task_index": 0})
    replayed = naive.step(state, Action.from_text(command))
    assert (replayed.truncated, replayed.info["end_reason"]) == (True, "time_budget")


def test_restores_run_in_threads_on_fresh_instances(make_env) -> None:
    original = make_env()
    state, _ = original.reset(options={"task_index": 1})
    saved, _ = run(original, state, "echo 'Hello, agent!' > draft.txt")
    instances = [make_env() for _ in range(4)]
    with ThreadPoolExecutor(4) as pool:
        restored = list(pool.map(terminal_restore, instances, [saved] * 4))
    rewards = []
    names = ["draft.txt", "greeting.txt"] * 2
    for env, state, name in zip(instances, restored, names, strict=True):
        state, _ = run(env, state, f"cp draft.txt {name}")
        rewards.append(env.step(state, Action.from_text("submit")).reward)
    assert rewards == [0.0, 1.0, 0.0, 1.0]


def test_restore_refuses_a_task_list_that_changed(make_env, tmp_path: Path) -> None:
    original = make_env()
    state, _ = original.reset(options={"task_index": 1})
    moved = tmp_path / "tasks"  # a task was added before it: the indices shifted
    for name in ("a_added", "b_added", "create_greeting"):
        (moved / name).mkdir(parents=True)
        (moved / name / "instruction.md").write_text("Task.")
        (moved / name / "verify.sh").write_text("true\n")
    with pytest.raises(TaskMismatchError) as caught:
        terminal_restore(make_env(moved), state)
    assert str(caught.value) == (
        "task index 1 is 'b_added' in this env but 'create_greeting' in the state: the task "
        "list changed since the state was recorded (a different dataset version or tasks "
        "folder); restore on an env with the state's task list"
    )
    beyond = replace(state, payload=CommandHistory(5, "create_greeting"))
    with pytest.raises(TaskMismatchError) as caught:
        terminal_restore(make_env(), beyond)
    assert str(caught.value) == (
        "the state's task 'create_greeting' was at index 5, which this env does not have "
        "(task_index 5 is out of range: this env has 3 tasks (0 .. 2)); was the task list "
        "changed?"
    )


def test_restore_aborts_on_a_continuation_prompt(make_env, live_processes) -> None:
    original = make_env()
    state, _ = original.reset(options={"task_index": 0})
    saved, _ = run(original, state, "ls")
    edited = replace(
        saved, payload=replace(saved.payload, commands=("ls", "echo 'unclosed", "rm data.txt"))
    )
    original.release(saved)
    fresh = make_env()
    with pytest.raises(ContinuationPromptError) as caught:
        terminal_restore(fresh, edited)
    assert str(caught.value) == (
        'replayed command 2 of 3 ("echo \'unclosed") would leave the shell at a continuation '
        "prompt (an unclosed quote, heredoc or block), so the rest of the replay would be "
        "typed into it; this state cannot be restored by replay (its commands ran complete "
        "when recorded: was it made by another shell version, or edited?)"
    )
    assert live_processes() == []  # the half-restored episode was released


def test_restore_needs_a_live_terminal_state(make_env) -> None:
    env = make_env()
    with pytest.raises(ReplayError) as caught:
        terminal_restore(env, State("hi", (), payload={"commands": []}))
    assert str(caught.value) == (
        "state.payload is dict, not a CommandHistory: only states of a terminal (or Harbor) "
        "environment can be restored by replay"
    )
    state, _ = env.reset(options={"task_index": 1})
    done = env.step(state, Action.from_text("submit")).next_state
    with pytest.raises(ReplayError) as caught:
        terminal_restore(make_env(), done)
    assert str(caught.value) == (
        "the state of task 'create_greeting' at step 1 is done; there is no continuation to "
        "restore it for"
    )


def test_replay_validation_agrees_for_deterministic_commands(make_env) -> None:
    probes = ("cat n.txt", "ls")
    result = validate_replay_consistency(
        make_env,
        task_index=0,
        trajectory=("wc -l < data.txt > n.txt",),
        probe_commands=probes,
        num_trials=3,
        reference_probes={"cat n.txt": "37\n", "ls": "data.txt\nn.txt\n"},
    )
    assert result["consistent"] is True
    assert result["probe_outputs"] == [{"cat n.txt": "37\n", "ls": "data.txt\nn.txt\n"}] * 3
    assert result["divergent_probes"] == []
    assert result["matches_reference"] is True
    # a probe's hash covers its exit status and its output
    probe_hashes = [sha256(b"0\x0037\n").hexdigest(), sha256(b"0\x00data.txt\nn.txt\n").hexdigest()]
    assert result["probe_hashes"] == [probe_hashes] * 3
    assert result["hashes"] == [sha256("\n".join(probe_hashes).encode()).hexdigest()] * 3


def test_replay_validation_flags_time_and_randomness(make_env, test_tasks_dir) -> None:
    timed = validate_replay_consistency(
        make_env,
        task_index=0,
        trajectory=("date +%s%N > stamp.txt", "wc -l < data.txt > n.txt"),
        probe_commands=("cat n.txt", "cat stamp.txt"),
        num_trials=2,
    )
    assert timed["consistent"] is False
    assert timed["divergent_probes"] == ["cat stamp.txt"]
    assert timed["hashes"][0] != timed["hashes"][1]
    assert timed["matches_reference"] is None

    random_setup = validate_replay_consistency(
        lambda: make_env(test_tasks_dir), task_index=0, trajectory=(), num_trials=2
    )
    assert random_setup["consistent"] is False
    assert random_setup["divergent_probes"] == list(DEFAULT_PROBES)
    assert DEFAULT_PROBES == ('find "$HOME" -type f -exec md5sum {} + | sort -k 2',)


def test_replay_validation_checks_its_arguments(make_env) -> None:
    with pytest.raises(ValueError, match=r"^num_trials must be >= 1, got 0$"):
        validate_replay_consistency(make_env, 0, (), num_trials=0)
    with pytest.raises(ContinuationPromptError) as caught:
        validate_replay_consistency(make_env, 0, ("echo 'unclosed",), num_trials=1)
    assert str(caught.value) == (
        'trajectory command 1 of 1 ("echo \'unclosed") would leave the shell at a '
        "continuation prompt; fix the trajectory"
    )
