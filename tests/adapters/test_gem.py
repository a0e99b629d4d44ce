"""GEM's word games offline: a missing NLTK corpus is a one-line build error naming the fix,
and an installed one is used without NLTK ever trying the network."""

from __future__ import annotations

import socket
import sys
from pathlib import Path
from typing import Any

import pytest

from agile_llmenvs.envs import make_rollout_env_factory
from agile_llmenvs.errors import EnvBuildError
from agile_llmenvs.specs import LLMEnvSpec

pytest.importorskip("gem", reason="needs the `envs` extra")
nltk = pytest.importorskip("nltk", reason="needs the `envs` extra")

WORDS = ["cat", "dog", "sun", "hat", "lamp", "tree", "apple", "house", "table", "chair"]


@pytest.fixture
def tokenizer(tiny_model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture
def network_attempts(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every name lookup or connection made from here on: recorded, then refused."""
    attempts: list[str] = []

    def refuse(*args: Any, **kwargs: Any) -> Any:
        attempts.append(repr(args[:2]))
        raise OSError("network disabled by the test")

    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    monkeypatch.setattr(socket.socket, "connect", lambda self, *a: refuse(*a))
    return attempts


def nltk_data_at(monkeypatch: pytest.MonkeyPatch, folder: Path) -> None:
    """What ``NLTK_DATA=folder`` does, for the already imported ``nltk``: look only there."""
    monkeypatch.setenv("NLTK_DATA", str(folder))
    monkeypatch.setattr(nltk.data, "path", [str(folder)])


def rollout_spec(env_id: str) -> LLMEnvSpec:
    return LLMEnvSpec(
        env_type="rollout", entrypoint=env_id, factory="agile_llmenvs.adapters.gem:make"
    )


@pytest.mark.parametrize("env_id", ["game:Wordle-v0-easy", "game:Hangman-v0-random"])
def test_a_missing_corpus_is_named_at_build_time_without_a_download(
    env_id: str,
    tokenizer: Any,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    network_attempts: list[str],
) -> None:
    nltk_data_at(monkeypatch, tmp_path)
    with pytest.raises(EnvBuildError) as raised:
        make_rollout_env_factory(rollout_spec(env_id), tokenizer)
    assert str(raised.value) == (
        f"{env_id} needs the NLTK corpus 'words', which is not installed: run python -m "
        "nltk.downloader words, or set NLTK_DATA to a folder that holds it"
    )
    assert network_attempts == []


def test_an_installed_corpus_builds_every_slot_without_a_download(
    tokenizer: Any,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    network_attempts: list[str],
) -> None:
    corpus = tmp_path / "corpora" / "words"  # NLTK's layout of the `words` corpus
    corpus.mkdir(parents=True)
    for name in ("en", "en-basic"):
        (corpus / name).write_text("\n".join(WORDS) + "\n", encoding="ascii")
    nltk_data_at(monkeypatch, tmp_path)
    downloads: list[Any] = []
    download = nltk.download
    monkeypatch.setattr(nltk, "download", lambda *a, **k: downloads.append(a) or download(*a, **k))

    factory, max_turns = make_rollout_env_factory(rollout_spec("game:Wordle-v0-easy"), tokenizer)
    harnesses = [factory() for _ in range(8)]
    prompt = tokenizer.decode(harnesses[0].reset(seed=0))

    assert max_turns == 15
    assert "You are playing Wordle" in prompt
    assert downloads == []
    assert network_attempts == []
    for harness in harnesses:
        harness.close()


def test_a_math_env_without_pylatexenc_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    from agile_llmenvs.adapters.gem import make
    from agile_llmenvs.errors import OptionalDependencyError

    monkeypatch.setitem(sys.modules, "pylatexenc", None)  # as if not installed
    for module in ("gem.envs.math_env", "gem.utils.math_grader"):
        monkeypatch.delitem(sys.modules, module, raising=False)
    with pytest.raises(OptionalDependencyError) as raised:
        make("math:GSM8K")
    assert str(raised.value) == (
        "The package 'pylatexenc' is needed for GEM env 'math:GSM8K' but is not installed; "
        'run: pip install "agile-llmenvs[envs]"'
    )


def test_gems_own_factory_is_checked_too_without_a_download(
    tokenizer: Any,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    network_attempts: list[str],
) -> None:
    """``factory: gem:make`` (manifests/rollout_entrypoint.yaml's) builds through the adapter:
    the same one-line error, and ``nltk.download`` never called."""
    import gem

    from agile_llmenvs.adapters.gem import checked_factory, make

    nltk_data_at(monkeypatch, tmp_path)
    downloads: list[Any] = []
    monkeypatch.setattr(nltk, "download", lambda *a, **k: downloads.append(a))
    own = LLMEnvSpec(env_type="rollout", entrypoint="game:Wordle-v0-easy", factory="gem:make")
    with pytest.raises(EnvBuildError) as raised:
        make_rollout_env_factory(own, tokenizer)
    assert str(raised.value) == (
        "game:Wordle-v0-easy needs the NLTK corpus 'words', which is not installed: run python -m "
        "nltk.downloader words, or set NLTK_DATA to a folder that holds it"
    )
    assert downloads == []
    assert network_attempts == []
    assert checked_factory(gem.make) is make
    assert checked_factory(make) is make
    assert checked_factory(print) is print
