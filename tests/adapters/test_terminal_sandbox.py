"""The terminal env's bubblewrap sandbox against hostile commands (docs/terminal.md's threat
model): each test is an attack that worked on the unsandboxed shell."""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from agile_llmenvs.adapters.terminal import (
    SandboxLimits,
    TaskFolder,
    TerminalEnvironment,
)
from agile_llmenvs.adapters.terminal import jail as jail_module
from agile_llmenvs.adapters.terminal.tasks import LocalSandbox
from agile_llmenvs.core import Action, State
from agile_llmenvs.errors import EnvBuildError


def make_task(root: Path, verify: str, setup: str | None = None, name: str = "task") -> Path:
    """A tasks folder with one task whose ``verify.sh`` is ``verify``."""
    folder = root / "tasks" / name
    folder.mkdir(parents=True)
    (folder / "instruction.md").write_text("Do whatever you like.")
    (folder / "verify.sh").write_text(verify)
    if setup is not None:
        (folder / "setup.sh").write_text(setup)
    return root / "tasks"


def step(env: TerminalEnvironment, state: State, command: str) -> tuple[State, str]:
    result = env.step(state, Action.from_text(command))
    return result.next_state, result.next_state.observation


def cmdlines_with(marker: str) -> list[str]:
    """The command lines of every host process mentioning ``marker``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            line = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if marker in line:
            found.append(line)
    return found


@pytest.fixture
def sandbox_of(work_root: Path) -> Iterator[object]:
    """``sandbox_of(tasks_dir, **TaskFolder options)``: an opened LocalSandbox, closed after."""
    opened: list[LocalSandbox] = []

    def open_one(tasks_dir: Path, **options: object) -> LocalSandbox:
        folder = TaskFolder(tasks_dir, work_root=work_root, **options)  # type: ignore[arg-type]
        opened.append(folder.open(0, None))
        return opened[-1]

    yield open_one
    for sandbox in opened:
        sandbox.close()


def test_a_background_writer_cannot_forge_the_reward(make_env, tmp_path: Path) -> None:
    env = make_env(make_task(tmp_path, "exit 1\n"))
    state, _ = env.reset(options={"task_index": 0})
    forger = '(while :; do echo 1 > "$HOME/../verifier/reward"; sleep 0.01; done) &'
    state, _ = step(env, state, forger)
    time.sleep(0.2)
    result = env.step(state, Action.from_text("submit"))
    assert (result.reward, result.info["verifier_exit_code"]) == (0.0, 1)


def test_no_process_survives_the_episode(make_env, tmp_path: Path, work_root: Path) -> None:
    mark = uuid.uuid4().hex[:8]
    verify = f"setsid -f bash -c 'sleep 1006; : {mark}'\nexit 0\n"
    env = make_env(make_task(tmp_path, verify))
    state, _ = env.reset(options={"task_index": 0})
    state, _ = step(env, state, 'echo "$HOME" > /dev/null')
    state, out1 = step(
        env, state, f"setsid bash -c 'sleep 1003; : {mark}' >/dev/null 2>&1 & echo ok"
    )
    state, out2 = step(
        env, state, f"setsid -f bash -c 'sleep 1004; : {mark}' >/dev/null 2>&1; echo ok"
    )
    reviver = (
        f'setsid bash -c \'while :; do mkdir -p "$HOME"; echo {mark} > "$HOME/back"; '
        "sleep 0.05; done' >/dev/null 2>&1 </dev/null & echo ok"
    )
    state, out3 = step(env, state, reviver)
    assert (out1, out2, out3) == ("ok\n[exit status 0]",) * 3
    time.sleep(0.3)
    assert len(cmdlines_with(mark)) == 3  # they run while the episode does
    result = env.step(state, Action.from_text("submit"))
    assert result.reward == 1.0
    time.sleep(0.3)  # a survivor would have re-created its work folder by now
    assert cmdlines_with(mark) == []
    assert list(work_root.iterdir()) == []


def test_redirecting_the_shells_own_output_ends_at_the_command_limit(make_env) -> None:
    env = make_env(command_timeout_s=1.0, trajectory_timeout_s=10.0)
    state, _ = env.reset(options={"task_index": 0})
    started = time.monotonic()
    result = env.step(state, Action.from_text("exec >/dev/null 2>&1"))
    assert time.monotonic() - started < 4
    assert (result.info["timed_out"], result.info["shell_restarted"]) == (True, True)
    _, observation = step(env, result.next_state, "echo alive")
    assert observation == "alive\n[exit status 0]"


def test_a_verifier_whose_child_holds_its_pipe_is_bounded_and_scores(
    work_root: Path, tmp_path: Path
) -> None:
    verify = "(setsid sleep 30 &)\nsleep 30 &\nexit 0\n"
    tasks = TaskFolder(make_task(tmp_path, verify), work_root=work_root, script_timeout_s=3)
    with TerminalEnvironment(tasks) as env:
        state, _ = env.reset(options={"task_index": 0})
        started = time.monotonic()
        result = env.step(state, Action.from_text("submit"))
        assert time.monotonic() - started < 3
        assert (result.reward, result.info["verifier_exit_code"]) == (1.0, 0)


def test_writes_outside_the_work_folder_fail(make_env, tmp_path: Path) -> None:
    outside = tmp_path / f"outside-{uuid.uuid4().hex}"
    var_tmp = Path("/var/tmp") / f"agile-escape-{uuid.uuid4().hex}"
    try:
        env = make_env()
        state, _ = env.reset(options={"task_index": 0})
        _, observation = step(
            env,
            state,
            f"for f in /usr/escape-{outside.name} /etc/escape-{outside.name} {outside} "
            f"{var_tmp} /escape; do echo x 2>/dev/null > $f && echo wrote $f; done; "
            "echo x > mine.txt && echo wrote mine",
        )
        assert observation == "wrote mine\n[exit status 0]"
        assert not outside.exists()
        assert not var_tmp.exists()
        assert not Path(f"/usr/escape-{outside.name}").exists()
        assert not Path(f"/etc/escape-{outside.name}").exists()
    finally:
        for path in (outside, var_tmp, Path(f"/etc/escape-{outside.name}")):
            path.unlink(missing_ok=True)


def test_tmp_files_do_not_outlive_the_episode(make_env) -> None:
    name = f"agile-tmp-{uuid.uuid4().hex}"
    try:
        env = make_env()
        state, _ = env.reset(options={"task_index": 0})
        state, observation = step(env, state, f"echo x > /tmp/{name} && cat /tmp/{name}")
        assert observation == "x\n[exit status 0]"
        env.release(state)
        assert not (Path("/tmp") / name).exists()
    finally:
        (Path("/tmp") / name).unlink(missing_ok=True)


def test_the_network_is_unreachable(make_env) -> None:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(4)
    server.settimeout(0.3)
    port = server.getsockname()[1]
    try:
        env = make_env(command_timeout_s=5)
        state, _ = env.reset(options={"task_index": 0})
        _, observation = step(
            env, state, f"(echo hi > /dev/tcp/127.0.0.1/{port}) 2>/dev/null; echo $?"
        )
        assert observation == "1\n[exit status 0]"
        with pytest.raises(TimeoutError):
            server.accept()
    finally:
        server.close()


def test_allow_network_shares_the_hosts_network(sandbox_of, tmp_path: Path) -> None:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(4)
    server.settimeout(5)
    port = server.getsockname()[1]
    try:
        sandbox = sandbox_of(make_task(tmp_path, "exit 0\n"), allow_network=True)
        result = sandbox.run(f"echo hi > /dev/tcp/127.0.0.1/{port}; echo $?", 5)
        assert result.output == "0\n"
        server.accept()[0].close()
    finally:
        server.close()


def test_the_hosts_environment_is_not_visible(make_env, monkeypatch) -> None:
    secret = f"s3cret-{uuid.uuid4().hex}"
    monkeypatch.setenv("AGILE_TEST_SECRET", secret)
    holder = subprocess.Popen(["sleep", "30"], env={"AGILE_TEST_SECRET": secret})
    try:
        env = make_env()
        state, _ = env.reset(options={"task_index": 0})
        _, observation = step(
            env,
            state,
            f"env; cat /proc/1/environ /proc/$PPID/environ /proc/{os.getpid()}/environ "
            f"/proc/{holder.pid}/environ 2>/dev/null; echo done",
        )
    finally:
        holder.kill()
        holder.wait()
    assert secret not in observation
    assert "AGILE_TEST_SECRET" not in observation
    assert observation.endswith("done\n[exit status 0]")


def test_killing_the_parent_does_not_reach_the_host(make_env) -> None:
    env = make_env()
    state, _ = env.reset(options={"task_index": 0})
    state, _ = step(env, state, "kill -9 $PPID; kill -9 -1; echo after")
    _, observation = step(env, state, "echo alive")
    assert observation == "alive\n[exit status 0]"
    assert os.getpid() > 0  # still here


def test_a_fork_bomb_is_bounded_by_the_process_limit(sandbox_of, tmp_path: Path) -> None:
    sandbox = sandbox_of(make_task(tmp_path, "exit 0\n"), limits=SandboxLimits(processes=24))
    assert sandbox.run("ulimit -u", 5).output == "24\n"
    sandbox.run("(bomb() { bomb | bomb & }; bomb) >/dev/null 2>&1 &", 5)
    time.sleep(1.5)
    assert sandbox.shell is not None
    assert sandbox.shell.jailed is not None
    assert 3 < len(sandbox.shell.jailed.members()) <= 24
    sandbox.shell.close()
    assert sandbox.shell.jailed is None


def test_a_file_larger_than_the_limit_fails(sandbox_of, tmp_path: Path) -> None:
    limits = SandboxLimits(file_size_bytes=1 << 20)
    sandbox = sandbox_of(make_task(tmp_path, "exit 0\n"), limits=limits)
    result = sandbox.run(
        "(head -c 3000000 /dev/zero > big) 2>/dev/null; echo $?; stat -c %s big", 5
    )
    assert "File size limit exceeded" in result.output
    assert result.output.endswith(f"153\n{1 << 20}\n")  # 128 + SIGXFSZ; cut at the limit


def test_the_memory_limit_holds(sandbox_of, tmp_path: Path) -> None:
    limits = SandboxLimits(memory_bytes=256 << 20)
    sandbox = sandbox_of(make_task(tmp_path, "exit 0\n"), limits=limits)
    small = sandbox.run("dd if=/dev/zero of=/dev/null bs=16M count=1 2>/dev/null; echo $?", 5)
    assert small.output == "0\n"
    big = sandbox.run("dd if=/dev/zero of=/dev/null bs=512M count=1 2>&1; echo $?", 5)
    assert (
        big.output == "dd: memory exhausted by input buffer of size 536870912 bytes (512 MiB)\n1\n"
    )


def test_the_task_folder_is_not_visible_to_the_policy(make_env, tmp_path: Path) -> None:
    tasks = make_task(tmp_path, "exit 1\n")
    env = make_env(tasks)
    state, _ = env.reset(options={"task_index": 0})
    _, observation = step(
        env, state, f"echo 'exit 0' > {tasks}/task/verify.sh; ls {tasks} 2>&1 | wc -l"
    )
    assert observation.endswith("1\n[exit status 0]")
    assert (tasks / "task" / "verify.sh").read_text() == "exit 1\n"


def test_setup_and_verifier_see_the_task_and_work_folders(make_env, tmp_path: Path) -> None:
    setup = 'cp "$TASK_DIR/instruction.md" "$WORK_DIR/copy.md"\n'
    verify = 'test -f "$TASK_DIR/verify.sh" && echo 0.5 > "$REWARD_FILE"\n'
    verify += 'cat "$WORK_DIR/copy.md"\n'
    env = make_env(make_task(tmp_path, verify, setup))
    state, _ = env.reset(options={"task_index": 0})
    result = env.step(state, Action.from_text("submit"))
    assert (result.reward, result.info["verifier_output"]) == (0.5, "Do whatever you like.")


def test_a_host_without_bubblewrap_is_refused_with_the_fix(monkeypatch, tmp_path: Path) -> None:
    tasks = make_task(tmp_path, "exit 0\n")
    jail_module.check_bubblewrap.cache_clear()
    monkeypatch.setattr(jail_module.shutil, "which", lambda tool: None)
    try:
        with pytest.raises(EnvBuildError) as caught:
            TaskFolder(tasks)
    finally:
        monkeypatch.undo()
        jail_module.check_bubblewrap.cache_clear()
    assert str(caught.value) == (
        "the terminal sandbox needs 'bwrap' on PATH: install bubblewrap (apt-get install -y "
        "bubblewrap) on a host that allows namespaces, or pass sandbox='none' to run commands "
        "unsandboxed, as the current user"
    )
    with pytest.raises(ValueError, match=r"^sandbox must be one of \('bubblewrap', 'none'\)"):
        TaskFolder(tasks, sandbox="docker")


def test_unsandboxed_runs_only_when_asked_and_warns(caplog, tmp_path: Path) -> None:
    tasks = make_task(tmp_path, "exit 0\n")
    with caplog.at_level(logging.WARNING):
        TaskFolder(tasks, sandbox="none")
    assert "TERMINAL ENV UNSANDBOXED" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        assert TaskFolder(tasks).sandbox == "bubblewrap"
        assert TerminalEnvironment(tasks, sandbox="none").tasks.sandbox == "none"  # type: ignore[attr-defined]
    assert caplog.text.count("TERMINAL ENV UNSANDBOXED") == 1
