"""Nothing reaches the network at run time: the quick start trains, and its eval runs, with
every connection to a host other than this one refused and recorded.

Each command runs in a subprocess whose ``sitecustomize`` wraps ``socket`` (``getaddrinfo``,
``gethostbyname``, ``connect``, ``connect_ex``, ``create_connection``, ``sendto``): a
non-loopback host is written to a log and the call raises, as on a firewalled cluster. The
hub's offline switches are cleared, as a new user's shell has them, and the hub cache and
the tiny model's cache are fresh, so nothing already cached hides a fetch.
"""

from __future__ import annotations

import importlib.util
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

GUARD = '''\
"""Refuse and record every network call to a host that is not this machine."""
import ipaddress
import os
import socket
import traceback

_LOG = os.environ["NO_NETWORK_LOG"]
_LOCAL_NAMES = {"localhost", "localhost.localdomain", "ip6-localhost", "ip6-loopback"}


def _local(host):
    if host is None:
        return True
    if isinstance(host, bytes):
        host = host.decode()
    host = str(host).strip("[]").split("%")[0]
    if host in _LOCAL_NAMES or host == "":
        return True
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False  # a name that is not this machine's
    return address.is_loopback or address.is_unspecified


def _refuse(kind, host, port):
    frames = [f for f in traceback.extract_stack()[:-2] if "sitecustomize" not in f.filename]
    where = " <- ".join(f"{f.filename}:{f.lineno}" for f in reversed(frames[-6:]))
    with open(_LOG, "a", encoding="utf-8") as log:
        log.write(f"{kind} {host}:{port} from {where}\\n")
    raise OSError(f"network disabled by the test: {kind} {host}:{port}")


def _inet(address):
    return isinstance(address, tuple) and len(address) >= 2


_getaddrinfo = socket.getaddrinfo
_gethostbyname = socket.gethostbyname
_connect = socket.socket.connect
_connect_ex = socket.socket.connect_ex
_sendto = socket.socket.sendto


def getaddrinfo(host, port, *args, **kwargs):
    if not _local(host):
        _refuse("getaddrinfo", host, port)
    return _getaddrinfo(host, port, *args, **kwargs)


def gethostbyname(host):
    if not _local(host):
        _refuse("gethostbyname", host, None)
    return _gethostbyname(host)


def connect(self, address):
    if _inet(address) and not _local(address[0]):
        _refuse("connect", address[0], address[1])
    return _connect(self, address)


def connect_ex(self, address):
    if _inet(address) and not _local(address[0]):
        _refuse("connect_ex", address[0], address[1])
    return _connect_ex(self, address)


def sendto(self, data, *args):
    address = args[-1] if args else None
    if _inet(address) and not _local(address[0]):
        _refuse("sendto", address[0], address[1])
    return _sendto(self, data, *args)


socket.getaddrinfo = getaddrinfo
socket.gethostbyname = gethostbyname
socket.socket.connect = connect
socket.socket.connect_ex = connect_ex
socket.socket.sendto = sendto
# create_connection resolves through socket.getaddrinfo and connects through connect
'''

OFFLINE_SWITCHES = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE")


@pytest.fixture
def guarded_env(tmp_path: Path) -> dict[str, str]:
    """The environment of a subprocess whose network calls are refused and logged."""
    guard = tmp_path / "guard"
    guard.mkdir()
    (guard / "sitecustomize.py").write_text(GUARD, encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if k not in OFFLINE_SWITCHES}
    env.update(
        PYTHONPATH=os.pathsep.join(filter(None, [str(guard), env.get("PYTHONPATH")])),
        NO_NETWORK_LOG=str(tmp_path / "network.log"),
        HF_HOME=str(tmp_path / "hf-home"),
        AGILE_LLMENVS_CACHE=str(tmp_path / "cache"),
        MPLBACKEND="Agg",
    )
    return env


def _run(args: list[str], env: dict[str, str], cwd: Path) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "agile_llmenvs", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=840,
        check=False,
    )
    assert done.returncode == 0, f"{args} failed:\n{done.stdout}\n{done.stderr}"
    return done.stdout


def _attempts(env: dict[str, str]) -> list[str]:
    log = Path(env["NO_NETWORK_LOG"])
    return log.read_text(encoding="utf-8").splitlines() if log.exists() else []


def test_the_guard_refuses_and_records_remote_hosts(
    guarded_env: dict[str, str], tmp_path: Path
) -> None:
    probe = (
        "import socket\n"
        "socket.getaddrinfo('localhost', 80)\n"
        "try:\n"
        "    socket.create_connection(('example.org', 443), timeout=1)\n"
        "except OSError as exc:\n"
        "    print(exc)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe],
        env=guarded_env,
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    assert done.stdout == "network disabled by the test: getaddrinfo example.org:443\n"
    [attempt] = _attempts(guarded_env)
    assert attempt.startswith("getaddrinfo example.org:443 from ")


def readme_next_steps() -> list[list[str]]:
    """The commands of the README's "Next steps" block, as argument lists."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    block = text.split("## Next steps", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    return [shlex.split(line) for line in block.splitlines() if line.strip()]


def test_the_readme_next_steps_are_agile_llmenvs_commands() -> None:
    commands = readme_next_steps()
    assert [command[:2] for command in commands] == [
        ["agile-llmenvs", "eval"],
        ["agile-llmenvs", "show"],
        ["agile-llmenvs", "train"],
        ["agile-llmenvs", "train"],
        ["agile-llmenvs", "train"],
        ["agile-llmenvs", "validate"],
    ]


@pytest.mark.slow
@pytest.mark.timeout(900)  # the quick start takes about 50 s on 2 idle cores
def test_quickstart_train_and_eval_make_no_network_call(
    guarded_env: dict[str, str], tmp_path: Path
) -> None:
    """The full quick start (800 GRPO steps), its eval, the shipped eval example, and every
    command of the README's "Next steps", run as a reader runs them (from a folder whose
    ``manifests`` is the repository's)."""
    (tmp_path / "manifests").symlink_to(ROOT / "manifests")
    _run(["train", "manifests/quickstart.yaml"], guarded_env, tmp_path)
    assert (tmp_path / "runs" / "quickstart" / "checkpoint-800" / "model").is_dir()
    outputs = [_run(command[1:], guarded_env, tmp_path) for command in readme_next_steps()]
    [overall] = [line for line in outputs[0].splitlines() if line.startswith("overall")]
    tasks, accuracy = overall.split()[1:3]
    assert tasks == "10"
    assert float(accuracy.rstrip("%")) >= 90.0, outputs[0]  # what the quick start learned
    assert (tmp_path / "runs" / "quickstart" / "rollouts.html").is_file()
    assert "is already complete" in outputs[2]
    assert (tmp_path / "runs" / "digits-sft" / "metrics.csv").is_file()
    assert (tmp_path / "runs" / "digits-dpo" / "metrics.csv").is_file()
    if importlib.util.find_spec("reasoning_gym") is not None:  # the `envs` extra
        example = ROOT / "manifests" / "eval" / "leg_counting.yaml"
        _run(["eval", str(example), "--limit", "4"], guarded_env, tmp_path)
    assert _attempts(guarded_env) == []


WORD_GAME_LOADER = """\
def load_textarena(game):
    from verifiers.legacy.envs.integrations.textarena_env import TextArenaEnv

    return TextArenaEnv(game=game, num_train_examples=2, num_eval_examples=1)
"""


def _word_game_manifest(folder: Path, name: str, game: str, *, via_verifiers: bool) -> Path:
    env = (
        f"  entrypoint: word_games:load_textarena\n"
        f"  factory: agile_llmenvs.adapters.verifiers:make\n"
        f"  env_config: {{game: {game}}}\n"
        if via_verifiers
        else f"  entrypoint: {game}\n  factory: agile_llmenvs.adapters.textarena:make\n"
    )
    path = folder / f"{name}.yaml"
    path.write_text(f"name: {name}\nenv:\n  env_type: rollout\n{env}", encoding="utf-8")
    return path


@pytest.mark.parametrize("via_verifiers", [False, True], ids=["textarena", "verifiers"])
def test_validating_word_games_never_downloads_nltk_data(
    guarded_env: dict[str, str], tmp_path: Path, via_verifiers: bool
) -> None:
    """TextArena's word games call ``nltk.download`` when imported (and verifiers' TextArena
    env when built), which fetches NLTK's index even for data already installed. ``validate``
    builds them without a network call: data that is installed is used, data that is not is a
    one-line error naming the fix."""
    pytest.importorskip("textarena")
    if via_verifiers:
        pytest.importorskip("verifiers.legacy.envs.integrations.textarena_env")
    (tmp_path / "word_games.py").write_text(WORD_GAME_LOADER, encoding="utf-8")
    data = tmp_path / "nltk_data"  # NLTK's layout: the `words` corpus and the tagger's folder
    (data / "corpora" / "words").mkdir(parents=True)
    (data / "corpora" / "words" / "en").write_text("apple\nbanana\ncherry\n", encoding="utf-8")
    (data / "corpora" / "words" / "en-basic").write_text("apple\nbanana\n", encoding="utf-8")
    (data / "taggers" / "averaged_perceptron_tagger_eng").mkdir(parents=True)
    env = {
        **guarded_env,
        "NLTK_DATA": str(data),
        "HOME": str(tmp_path),  # no ~/nltk_data of this machine's
        "PYTHONPATH": os.pathsep.join([str(tmp_path), guarded_env["PYTHONPATH"]]),
    }
    # Hangman needs the `words` corpus, installed above: it builds, offline
    hangman = _word_game_manifest(tmp_path, "hangman", "Hangman-v0", via_verifiers=via_verifiers)
    out = _run(["validate", str(hangman)], env, tmp_path)
    assert out.startswith(f"ok    {hangman}: run 'hangman': rollout env ")
    # Wordle also needs the tagger's weights, which are not there: refused, naming the fix
    wordle = _word_game_manifest(tmp_path, "wordle", "Wordle-v0", via_verifiers=via_verifiers)
    (data / "taggers" / "averaged_perceptron_tagger_eng").rmdir()
    done = subprocess.run(
        [sys.executable, "-m", "agile_llmenvs", "validate", str(wordle)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    who = (
        "verifiers env 'word_games:load_textarena'"
        if via_verifiers
        else ("TextArena game 'Wordle-v0'")
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert (
        f"  env.entrypoint: {who} needs the NLTK data 'averaged_perceptron_tagger_eng', which "
        "is not installed: run python -m nltk.downloader averaged_perceptron_tagger_eng, or "
        "set NLTK_DATA to a folder that holds it"
    ) in done.stdout + done.stderr
    assert _attempts(env) == []
