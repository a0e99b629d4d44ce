"""`agile-llmenvs serve`: a manifest's env or an entrypoint (a module or a file) hosted over
OpenEnv's WebSocket protocol; a user's mistake is one line and exit 2, --debug shows why."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from agile_llmenvs.cli import main
from agile_llmenvs.transport import RemoteEnvClient

TESTS = Path(__file__).resolve().parent
MANIFESTS = TESTS.parent / "manifests"
DEBUG = " (--debug shows the traceback)"
GUESS_ENV = '''
class GuessEnv:
    """Guess the secret digit; two tries."""

    max_turns = 2

    def __init__(self, secret: int = 3) -> None:
        self.secret = secret

    def reset(self, *, seed=None, **task):
        return "Guess my digit.", {}

    def step(self, action):
        right = action.strip() == str(self.secret)
        return ("Right!" if right else "Wrong."), float(right), right, False, {}

    def close(self):
        pass
'''


def _command(*args: str) -> list[str]:
    return [sys.executable, "-m", "agile_llmenvs", "serve", *args]


def _script(*args: str) -> list[str]:
    """The console script: unlike ``python -m``, its ``sys.path`` lacks the working directory."""
    script = Path(sys.executable).with_name("agile-llmenvs")
    if not script.exists():
        pytest.skip("the agile-llmenvs console script is not installed beside this Python")
    return [str(script), "serve", *args]


def _env() -> dict[str, str]:
    """The tests' envs importable, offline."""
    path = os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": path}


@contextmanager
def _served(*args: str, cwd: Path, script: bool = False) -> Iterator[str]:
    """``agile-llmenvs serve ARGS --port 0`` as a process in ``cwd`` (run by the console script
    with ``script``); yields its URL, then stops it with SIGTERM and checks that it exits 0."""
    proc = subprocess.Popen(
        (_script if script else _command)(*args, "--port", "0"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=cwd,
        env=_env(),
    )
    try:
        assert proc.stdout is not None
        assert proc.stderr is not None
        line = proc.stdout.readline()
        if not line.startswith("serving "):
            proc.kill()
            pytest.fail(f"serve did not start: {line!r} {proc.stderr.read()!r}")
        assert line.startswith(f"serving {args[0]} at http://127.0.0.1:")
        yield line.split(" at ", 1)[1].split(" ", 1)[0]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


@pytest.fixture
def project(tmp_path: Path) -> Path:
    """A folder holding ``envs/guess.py`` and a manifest whose env is its GuessEnv."""
    (tmp_path / "envs").mkdir()
    (tmp_path / "envs" / "guess.py").write_text(GUESS_ENV)
    (tmp_path / "guess.yaml").write_text(
        "env:\n"
        "  env_type: rollout\n"
        "  entrypoint: envs/guess.py:GuessEnv\n"
        "  env_config: {secret: 5}\n"
    )
    return tmp_path


def test_serves_the_entrypoint_env_of_a_manifest(project: Path) -> None:
    with _served("guess.yaml", cwd=project) as url, RemoteEnvClient(url, timeout_s=30) as client:
        assert client.reset().prompt == "Guess my digit."
        reply = client.step("5")
        assert (reply.prompt, reply.reward, reply.done) == ("Right!", 1.0, True)


def test_serves_the_dataset_env_of_a_manifest(tmp_path: Path) -> None:
    manifest = str(MANIFESTS / "rollout_digits.yaml")
    with _served(manifest, cwd=tmp_path) as url, RemoteEnvClient(url, timeout_s=30) as client:
        assert client.reset(row_index=3).prompt == "Say the digit 3."
        reply = client.step("3")
        assert (reply.reward, reply.done) == (1.0, True)


def test_serves_a_file_entrypoint(project: Path) -> None:
    args = ("envs/guess.py:GuessEnv", "--env-config", '{"secret": 7}')
    with _served(*args, cwd=project) as url, RemoteEnvClient(url, timeout_s=30) as client:
        client.reset()
        assert client.step("7").reward == 1.0


def test_production_mode_drops_the_http_episode_routes_and_keeps_sessions(
    project: Path,
) -> None:
    import urllib.error
    import urllib.request

    args = ("envs/guess.py:GuessEnv", "--env-config", '{"secret": 7}', "--mode", "production")
    with _served(*args, cwd=project) as url:
        for method, path in [("POST", "/reset"), ("POST", "/step"), ("GET", "/state")]:
            request = urllib.request.Request(url + path, data=b"{}", method=method)
            if method == "GET":
                request = urllib.request.Request(url + path)
            with pytest.raises(urllib.error.HTTPError) as missing:
                urllib.request.urlopen(request, timeout=10)
            assert missing.value.code == 404, path
        with urllib.request.urlopen(url + "/health", timeout=10) as health:
            assert health.status == 200
        with RemoteEnvClient(url, timeout_s=30) as client:
            client.reset()
            assert client.step("7").reward == 1.0


def test_the_console_script_serves_a_module_of_the_working_directory(tmp_path: Path) -> None:
    (tmp_path / "cwd_guess.py").write_text(GUESS_ENV)
    args = ("cwd_guess:GuessEnv", "--env-config", '{"secret": 4}')
    with (
        _served(*args, cwd=tmp_path, script=True) as url,
        RemoteEnvClient(url, timeout_s=30) as client,
    ):
        assert client.reset().prompt == "Guess my digit."
        assert client.step("4").reward == 1.0


def test_a_manifest_serves_a_module_beside_it_from_another_working_directory(
    tmp_path: Path,
) -> None:
    (tmp_path / "project").mkdir()
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "project" / "near_guess.py").write_text(GUESS_ENV)
    manifest = tmp_path / "project" / "guess.yaml"
    manifest.write_text("env: {env_type: rollout, entrypoint: 'near_guess:GuessEnv'}\n")
    with (
        _served(str(manifest), cwd=tmp_path / "elsewhere", script=True) as url,
        RemoteEnvClient(url, timeout_s=30) as client,
    ):
        client.reset()
        assert client.step("3").reward == 1.0


def test_each_mistake_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "invalid.yaml").write_text(
        "env: {env_type: rollout, entrypoint: 'a:B', max_turns: 0}\n"
    )
    cartpole, remote = MANIFESTS / "cartpole.yaml", MANIFESTS / "rollout_remote.yaml"
    monkeypatch.chdir(tmp_path)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        cases = {
            ("absent_pkg.envs:MyEnv",): (
                "'absent_pkg.envs:MyEnv': cannot import module 'absent_pkg.envs' (No module "
                "named 'absent_pkg'); is its package installed and on PYTHONPATH? (a module "
                "Python cannot find is looked up next to the manifest, then in the working "
                "directory). If 'absent_pkg.envs:MyEnv' is a registry id rather than a "
                "'module:Class' path, pass it as the entrypoint with a factory that builds it, "
                "e.g. factory='gem:make'"
            ),
            ("echo-v0", "--factory", "echo_envs:maker"): (
                "'echo_envs:maker': echo_envs has no attribute 'maker'. Did you mean 'make'?"
            ),
            ("echo_envs:EchoEnv", "--env-config", '{"greting": "hi"}'): (
                "env.env_config: 'greting' is not a keyword argument of EchoEnv (it takes: "
                "greeting); did you mean 'greeting'?"
            ),
            ("echo_envs:EchoEnv", "--env-config", "[1]"): (
                "--env-config: expected a JSON object of keyword arguments such as "
                "'{\"size\": 3}', got list"
            ),
            ("echo_envs:EchoEnv", "--port", str(port)): (
                f"cannot bind the env server to 127.0.0.1:{port}: [Errno 98] Address already in use"
            ),
            ("echo_envs:EchoEnv", "--port", "70000"): (
                "--port: expected 0..65535 (0: any free port), got 70000"
            ),
            ("invalid.yaml",): "env.max_turns: Input should be greater than or equal to 1",
            (str(cartpole),): (
                f"env.env_type: {cartpole} declares a gym env; serve hosts text envs (env_type: "
                "rollout, from an entrypoint or from dataset rows with a rubric)"
            ),
            (str(remote),): (
                "env.env_url: this env is already hosted at ws://127.0.0.1:8000; hosting needs an "
                "`entrypoint` or dataset rows with a rubric"
            ),
            (str(remote), "--env-config", "{}"): (
                f"--factory and --env-config configure an entrypoint; {remote} is a manifest: set "
                "`factory` and `env_config` in its env section instead"
            ),
        }
        for args, message in cases.items():
            assert main(["serve", *args]) == 2, args
            assert capsys.readouterr().err == f"error: {message}{DEBUG}\n"


def test_a_mistake_exits_2_as_a_process_and_debug_shows_the_traceback(tmp_path: Path) -> None:
    (tmp_path / "envs").mkdir()
    (tmp_path / "envs" / "broken.py").write_text("import absent_dependency\n")
    run = {"capture_output": True, "text": True, "timeout": 300, "cwd": tmp_path, "env": _env()}
    done = subprocess.run(_command("envs/broken.py:MyEnv"), check=False, **run)
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr == (
        "error: envs/broken.py:MyEnv: importing failed: ModuleNotFoundError: No module named "
        f"'absent_dependency'{DEBUG}\n"
    )
    done = subprocess.run(_command("envs/broken.py:MyEnv", "--debug"), check=False, **run)
    assert done.returncode == 1
    assert done.stderr.startswith("Traceback (most recent call last):\n")
    assert done.stderr.endswith(
        "agile_llmenvs.errors.ImportPathError: envs/broken.py:MyEnv: importing failed: "
        "ModuleNotFoundError: No module named 'absent_dependency'\n"
    )


class _RecordedServer:
    """Stands in for ``OpenEnvServer``: records how ``serve`` built it, then stops serving."""

    built: dict[str, object] = {}
    url = "http://0.0.0.0:1"
    serving = False

    def __init__(self, **kwargs: object) -> None:
        _RecordedServer.built = kwargs

    def close(self) -> None:
        pass


@pytest.mark.parametrize(
    ("host", "token", "warned"),
    [
        ("0.0.0.0", None, True),
        ("::", None, True),
        ("127.0.0.1", None, False),
        ("0.0.0.0", "s", False),
    ],
)
def test_serve_warns_when_it_listens_beyond_loopback_without_a_token(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    host: str,
    token: str | None,
    warned: bool,
) -> None:
    import agile_llmenvs.transport.server

    monkeypatch.setattr(agile_llmenvs.transport.server, "OpenEnvServer", _RecordedServer)
    monkeypatch.setattr(signal, "signal", lambda *args: None)
    args = ["serve", "echo_envs:EchoEnv", "--host", host] + (["--token", token] if token else [])
    assert main(args) == 1  # the stand-in stops serving at once
    warning = (
        f"warning: serving on {host} without --token: anyone who can reach this port can run "
        "and exhaust its envs; pass --token-file FILE or set $AGILE_LLMENVS_TOKEN (clients "
        "send it as a Bearer token), or bind 127.0.0.1\n"
    )
    assert (warning in capsys.readouterr().err) is warned
    assert _RecordedServer.built["max_concurrent_envs"] == 8  # one GRPO group of 8


@pytest.mark.parametrize(
    ("given", "token"),
    [("option", "from-option"), ("file", "from-file"), ("variable", "from-variable")],
)
def test_serve_takes_its_token_from_a_file_or_the_environment(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, given: str, token: str
) -> None:
    """`--token` shows in `ps` to every user of the machine; a file or a variable does not."""
    import agile_llmenvs.transport.server

    monkeypatch.setattr(agile_llmenvs.transport.server, "OpenEnvServer", _RecordedServer)
    monkeypatch.setattr(signal, "signal", lambda *args: None)
    (tmp_path / "token").write_text("from-file\n")
    monkeypatch.setenv("AGILE_LLMENVS_TOKEN", "from-variable")
    extra = {
        "option": ["--token", "from-option"],
        "file": ["--token-file", str(tmp_path / "token")],
        "variable": [],
    }[given]
    assert main(["serve", "echo_envs:EchoEnv", *extra]) == 1  # the stand-in stops at once
    assert _RecordedServer.built["token"] == token


@pytest.mark.parametrize(
    ("args", "variable", "message"),
    [
        (
            ["--token", "a", "--token-file", "t"],
            None,
            "--token and --token-file: give the token one way",
        ),
        (["--token-file", "empty"], None, "is empty; write the token in it"),
        (["--token-file", "missing"], None, "--token-file: cannot read"),
        ([], "  ", "$AGILE_LLMENVS_TOKEN is set but empty"),
    ],
)
def test_a_token_given_wrong_is_refused_naming_how(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    args: list[str],
    variable: str | None,
    message: str,
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "empty").write_text("")
    (tmp_path / "t").write_text("x\n")
    if variable is not None:
        monkeypatch.setenv("AGILE_LLMENVS_TOKEN", variable)
    else:
        monkeypatch.delenv("AGILE_LLMENVS_TOKEN", raising=False)
    assert main(["serve", "echo_envs:EchoEnv", *args]) == 2
    assert message in capsys.readouterr().err


def test_serve_passes_the_mode_and_refuses_an_unknown_one(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import agile_llmenvs.transport.server

    monkeypatch.setattr(agile_llmenvs.transport.server, "OpenEnvServer", _RecordedServer)
    monkeypatch.setattr(signal, "signal", lambda *args: None)
    assert main(["serve", "echo_envs:EchoEnv"]) == 1
    assert _RecordedServer.built["mode"] is None  # the server reads OPENENV_MODE
    assert main(["serve", "echo_envs:EchoEnv", "--mode", "production"]) == 1
    assert _RecordedServer.built["mode"] == "production"
    with pytest.raises(SystemExit) as refused:
        main(["serve", "echo_envs:EchoEnv", "--mode", "staging"])
    assert refused.value.code == 2
    assert "invalid choice: 'staging'" in capsys.readouterr().err


def test_serve_help_says_the_default_capacity_suits_a_grpo_group(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "else 8: one GRPO group of the default group_size" in help_text
    assert (
        "production drops the simulation controls POST /reset, POST /step and GET /state (404)"
        in help_text
    )
