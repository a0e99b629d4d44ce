"""The terminal env's verifier against a policy that forges its reward through the verifier's
own start-up (docs/terminal.md's threat model): each attack plants files in the work folder
(the policy's ``HOME`` and working directory) that a verifier starting Python, git or a shell
would run first, and the verifier always fails unless the attack works."""

from __future__ import annotations

import subprocess
import tracemalloc
from pathlib import Path

import pytest

from agile_llmenvs.adapters.terminal import TerminalEnvironment
from agile_llmenvs.adapters.terminal.tasks import remove_tree
from agile_llmenvs.core import Action, State
from tests.adapters.test_terminal_sandbox import make_task

FORGE_PY = "import os; open(os.environ['REWARD_FILE'], 'w').write('1'); os._exit(0)"
FORGE_SH = '#!/bin/sh\necho 1 > "$REWARD_FILE"\n'
USER_SITE = "$(python3 -c 'import site; print(site.getusersitepackages())')"

# name: (the policy's command, the verifier, which fails unless the attack runs)
ATTACKS = {
    "pth_in_user_site": (
        f'd={USER_SITE} && mkdir -p "$d" && echo "{FORGE_PY}" > "$d/forge.pth"',
        "python3 -c 'raise SystemExit(1)'\nexit 1\n",
    ),
    # sitecustomize.py: Debian's own (/usr/lib/python3.X) comes first on sys.path
    "usercustomize_in_user_site": (
        f'd={USER_SITE} && mkdir -p "$d" && echo "{FORGE_PY}" > "$d/usercustomize.py"',
        "python3 -c 'raise SystemExit(1)'\nexit 1\n",
    ),
    "json_py_in_work_folder": (
        f'echo "{FORGE_PY}" > json.py',
        "python3 -c 'import json'\nexit 1\n",
    ),
    "json_py_after_cd_to_work_folder": (
        f'echo "{FORGE_PY}" > json.py',
        "cd \"$WORK_DIR\" && python3 -c 'import json'\nexit 1\n",
    ),
    "gitconfig_diff_external": (
        f"printf '[diff]\\n\\texternal = %s/x.sh\\n' \"$HOME\" > .gitconfig; "
        f"printf '{FORGE_SH}' > x.sh; chmod +x x.sh",
        'd=$(mktemp -d) && git init -q "$d" && echo a > "$d/f" && git -C "$d" add f\n'
        'echo b > "$d/f" && git -C "$d" diff\nexit 1\n',
    ),
    "bashrc": (
        "echo 'echo 1 > \"$REWARD_FILE\"; exit 0' > .bashrc",
        "bash -i -c 'exit 1' </dev/null\nexit 1\n",
    ),
    "bash_env_from_profile": (
        "echo 'export BASH_ENV=$HOME/env.sh' > .profile; echo 'echo 1 > \"$REWARD_FILE\"' > env.sh",
        "bash -l -c 'bash -c \"exit 1\"'\nexit 1\n",
    ),
    "pythonstartup_from_profile": (
        f"echo 'export PYTHONSTARTUP=$HOME/start.py' > .profile; echo \"{FORGE_PY}\" > start.py",
        "bash -l -c 'python3 -i </dev/null'\nexit 1\n",
    ),
    "path_shim_for_cat": (
        f"mkdir -p bin && printf '{FORGE_SH}' > bin/cat && chmod +x bin/cat && "
        "echo 'PATH=$HOME/bin:$PATH' > .profile",
        "bash -l -c 'cat /dev/null'\nexit 1\n",
    ),
    "path_shim_for_python3": (
        f"mkdir -p bin && printf '{FORGE_SH}' > bin/python3 && chmod +x bin/python3 && "
        "echo 'PATH=$HOME/bin:$PATH' > .profile",
        "bash -l -c \"python3 -c 'raise SystemExit(1)'\"\nexit 1\n",
    ),
}


def play(env: TerminalEnvironment, *commands: str) -> tuple[State, float, dict]:
    state, _ = env.reset(options={"task_index": 0})
    for command in commands:
        state = env.step(state, Action.from_text(command)).next_state
    result = env.step(state, Action.from_text("submit"))
    return result.next_state, result.reward, result.info


@pytest.mark.parametrize("attack", sorted(ATTACKS))
def test_the_policys_files_cannot_forge_the_verifiers_reward(
    attack: str, make_env, tmp_path: Path
) -> None:
    command, verify = ATTACKS[attack]
    env = make_env(make_task(tmp_path, verify))
    _, reward, info = play(env, command)
    assert (reward, info["verifier_exit_code"]) == (0.0, 1), info["verifier_output"]


def test_a_conftest_in_the_work_folder_is_not_collected(make_env, tmp_path: Path) -> None:
    if subprocess.run(["/usr/bin/python3", "-c", "import pytest"], check=False).returncode:
        pytest.skip("the jail's Python (/usr/bin/python3) has no pytest to run a verifier")
    tasks = make_task(tmp_path, 'python3 -m pytest -q -p no:cacheprovider "$TASK_DIR"\n')
    (tasks / "task" / "test_fails.py").write_text("def test_fails():\n    assert False\n")
    env = make_env(tasks)
    conftest = "import os\nopen(os.environ['REWARD_FILE'], 'w').write('1')\nos._exit(0)\n"
    _, reward, _ = play(env, f"printf '{conftest}' > conftest.py; cp conftest.py pytest.py")
    assert reward == 0.0


def test_the_verifier_runs_in_a_fresh_home_and_clean_environment(make_env, tmp_path: Path) -> None:
    verify = (
        'test "$PWD" = "$HOME" && test "$HOME" != "$WORK_DIR" && ls -A "$HOME" | wc -l\n'
        "env | sort | grep -E '^(PYTHON|GIT_|PATH=|BASH_ENV|ENV=)'\n"
        'cat "$WORK_DIR/answer.txt"\n'
    )
    env = make_env(make_task(tmp_path, verify))
    _, reward, info = play(env, "echo 42 > answer.txt")
    assert reward == 1.0
    assert info["verifier_output"].splitlines() == [
        "0",
        "GIT_CONFIG_GLOBAL=/dev/null",
        "GIT_CONFIG_NOSYSTEM=1",
        "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        "PYTHONDONTWRITEBYTECODE=1",
        "PYTHONNOUSERSITE=1",
        "PYTHONSAFEPATH=1",
        "42",
    ]


def test_verifier_output_keeps_a_tail_and_says_the_size(make_env, tmp_path: Path) -> None:
    size = 200 << 20
    verify = f"head -c {size} /dev/zero | tr '\\0' x; echo; echo END\nexit 1\n"
    env = make_env(make_task(tmp_path, verify))
    tracemalloc.start()
    try:
        _, reward, info = play(env)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    output = info["verifier_output"]
    head, tail = output.split("\n", 1)
    assert head == f"[output: {size + 5} bytes, the last 65536 kept]"
    assert tail == "x" * (65536 - 5) + "\nEND\n"
    assert (reward, info["verifier_exit_code"]) == (0.0, 1)
    assert peak < 8 << 20, f"{peak} bytes held while reading the verifier's output"


def test_cleanup_removes_a_deep_and_locked_tree(make_env, work_root: Path) -> None:
    build = (
        "python3 -c '\nimport os\nfor depth in range(3000):\n"
        '    os.mkdir("d"); os.chdir("d")\n    if depth % 500 == 0: open("f", "w").close()\n'
        'os.chmod(".", 0)\'\n'
        "chmod 000 d/d; chmod 500 d; echo built"
    )
    env = make_env()
    state, _ = env.reset(options={"task_index": 0})
    next_state = env.step(state, Action.from_text(build)).next_state
    assert "built" in next_state.observation
    env.release(next_state)
    assert list(work_root.iterdir()) == []


def test_cleanup_never_follows_a_link_out(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_text("host file")
    tree = tmp_path / "episode" / "work"
    (tree / "sub").mkdir(parents=True)
    (tree / "sub" / "link").symlink_to(outside)
    (tree / "file-link").symlink_to(outside / "keep.txt")
    remove_tree(tmp_path / "episode")
    assert not (tmp_path / "episode").exists()
    assert (outside / "keep.txt").read_text() == "host file"
