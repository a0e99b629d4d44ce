"""TextWorld games (``textworld``, the ``envs`` extra) as text envs: ``factory:
agile_llmenvs.adapters.textworld:make`` with a game file (``path/to/game.z8``) or ``custom``
(games generated offline from seeds, as ``tw-make custom`` makes them) as the entrypoint.

The observation is the game's own text: the objective and the room at the start, then the
feedback of each command, each followed by the commands the game admits there (numbered, and
answered by number when ``answer_by_number``, so that a small model can play). The reward is the
quest's score gained by the step; the episode ends when the game is won or lost.

TextWorld replays a game exactly (the same commands give the same text), so an episode branches
by ``action_replay`` as well as by ``process_fork``.
"""

from __future__ import annotations

import os
import random
import re
import shutil
import tempfile
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agile_llmenvs._cache import cache_root
from agile_llmenvs.errors import EnvBuildError, EnvStateError, OptionalDependencyError

__all__ = ["GameSettings", "TextWorldEnv", "default_games_dir", "generated_game", "make"]

CUSTOM = "custom"
"""The entrypoint that generates games from seeds instead of playing one file."""

DEFAULT_GAMES = 16
"""Distinct games a ``custom`` env's seeds map to (``seed % games``)."""

_TEXTWORLD = threading.RLock()  # TextWorld parses its logic with tatsu, not thread-safe
_IDLE: dict[Path, list[Any]] = {}  # started games closed envs left, per file: a start is 0.2 s
_MAX_IDLE = 64  # the most started games left idle per file
_STATUS_LINE = re.compile(r"^>\s.*$", re.MULTILINE)  # the ">  -= Room =-0/1" prompt line
_BLANK_LINES = re.compile(r"\n{3,}")
_RESTART = re.compile(r"^Would you like to RESTART.*$", re.MULTILINE)  # the end's prompt
_NUMBER = re.compile(r"\d+")


@dataclass(frozen=True)
class GameSettings:
    """What a generated game is made of (``tw-make custom``'s options of the same names).

    Attributes:
        world_size: Rooms in the world.
        nb_objects: Objects in the world, besides the rooms.
        quest_length: The length of the action chain TextWorld builds the quest from; its
            walkthrough can be shorter (seed 4 of the defaults is won by one command).
        theme: The text grammar's theme.
    """

    world_size: int = 2
    nb_objects: int = 3
    quest_length: int = 2
    theme: str = "house"

    def __post_init__(self) -> None:
        for name in ("world_size", "nb_objects", "quest_length"):
            value = getattr(self, name)
            if value < 1:
                raise EnvBuildError(f"textworld: {name} must be at least 1, got {value}")

    @property
    def key(self) -> str:
        """The settings as a folder name: games of different settings never share a file."""
        return f"w{self.world_size}-o{self.nb_objects}-q{self.quest_length}-{self.theme}"


def default_games_dir() -> Path:
    """Where generated games are kept: ``$AGILE_LLMENVS_CACHE/textworld`` if that variable is
    set and non-empty, else ``~/.cache/agile_llmenvs/textworld``."""
    return cache_root() / "textworld"


def generated_game(settings: GameSettings, seed: int, games_dir: Path | None = None) -> Path:
    """The game file TextWorld generates from ``seed`` with ``settings``, made on first use.

    The same seed and settings make the same game (``tw-make custom --seed``'s); a made game
    is kept under ``games_dir/settings.key`` and read from there after. A game is written to a
    temporary folder and moved into place, its ``.json`` before its ``.z8``, so that a reader
    never sees half a game, whatever other processes generate meanwhile.

    Raises:
        OptionalDependencyError: ``textworld`` is not installed.
        EnvBuildError: TextWorld cannot make a game of these settings.
    """
    folder = (games_dir or default_games_dir()) / settings.key
    game_file = folder / f"game-{seed}.z8"
    if game_file.is_file():
        return game_file
    _import_textworld()
    from textworld import GameOptions
    from textworld.generator import compile_game, make_game

    folder.mkdir(parents=True, exist_ok=True)
    with _TEXTWORLD, tempfile.TemporaryDirectory(dir=folder, prefix=".making-") as tmp:
        options = GameOptions()
        options.seeds = seed
        options.nb_rooms = settings.world_size
        options.nb_objects = settings.nb_objects
        options.chaining.min_length = settings.quest_length
        options.chaining.max_length = settings.quest_length
        options.chaining.max_depth = settings.quest_length
        options.grammar.theme = settings.theme
        options.path = str(Path(tmp) / game_file.name)
        options.file_ext = ".z8"
        try:
            made = Path(compile_game(make_game(options), options))
        except Exception as exc:
            raise EnvBuildError(
                f"textworld: could not make a game of {settings} from seed {seed}: "
                f"{type(exc).__name__}: {exc}"
            ) from exc
        os.replace(made.with_suffix(".json"), game_file.with_suffix(".json"))
        shutil.move(str(made), game_file)
    return game_file


class TextWorldEnv:
    """A TextWorld game behind the :class:`~agile_llmenvs.llm_envs.TextEnv` contract.

    Attributes:
        max_turns: The turn budget the harness gives an episode.
        max_score: The current game's highest score (after a reset).
        walkthrough: The commands of the current game's own solution (after a reset).
        commands: The commands the game admits now, in the order they are listed.
    """

    def __init__(
        self,
        game: str | Path | None = None,
        *,
        settings: GameSettings | None = None,
        games: int | None = DEFAULT_GAMES,
        first_seed: int = 0,
        games_dir: str | Path | None = None,
        answer_by_number: bool = False,
        list_commands: bool = True,
        max_turns: int = 8,
    ) -> None:
        if (game is None) == (settings is None):
            raise EnvBuildError("textworld: give a game file or the settings to generate games")
        if games is not None and games < 1:
            raise EnvBuildError(f"textworld: games must be at least 1 or null, got {games}")
        if max_turns < 1:
            raise EnvBuildError(f"textworld: max_turns must be at least 1, got {max_turns}")
        if answer_by_number and not list_commands:
            raise EnvBuildError(
                "textworld: answer_by_number needs list_commands: the numbers are the listed "
                "commands'"
            )
        self._textworld = _import_textworld()
        self.game = Path(game) if game is not None else None
        if self.game is not None and not self.game.is_file():
            raise EnvBuildError(f"textworld: no game file at {self.game}")
        self.settings = settings
        self.games = games
        self.first_seed = first_seed
        self.games_dir = Path(games_dir) if games_dir is not None else None
        self.answer_by_number = answer_by_number
        self.list_commands = list_commands
        self.max_turns = max_turns
        self.max_score = 0.0
        self.walkthrough: list[str] = []
        self.commands: list[str] = []
        self._rng = random.Random()
        self._env: Any = None  # the started game being played
        self._path: Path | None = None
        self._played: list[str] = []  # the game's commands since the reset
        self._score = 0.0
        self._done = True

    def game_file(self, seed: int | None) -> Path:
        """The game a reset with ``seed`` plays: the given file, or the generated game of
        ``first_seed + seed % games`` (``seed`` itself when ``games`` is None; a random one
        of them when ``seed`` is None)."""
        if self.game is not None:
            return self.game
        assert self.settings is not None  # __init__ guarantees one of the two
        if seed is None:
            seed = self._rng.randrange(self.games or 2**31)
        index = seed % self.games if self.games is not None else seed
        return generated_game(self.settings, self.first_seed + index, self.games_dir)

    def reset(self, *, seed: int | None = None, **task: Any) -> tuple[str, dict[str, Any]]:
        """Start the game ``seed`` picks (other task keys, a collector's ``row_index``, are
        ignored); the observation is its objective and first room."""
        path = self.game_file(seed)
        state = self._restart(path)
        text = f"{_clean(state.objective)}\n\n{_clean(state.description)}"
        return self._with_commands(text, state), {"max_score": self.max_score, "game": str(path)}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        """Play the policy's command (its number's, with ``answer_by_number``): the reward is
        the score it gained; a number that lists no command is answered without a move."""
        if self._done or self._env is None:
            raise EnvStateError("textworld: step() before reset(), or after the game ended")
        command = action.strip()
        if self.answer_by_number:
            number = _NUMBER.search(action)
            index = int(number.group()) if number is not None else 0
            if not 1 <= index <= len(self.commands):
                text = f"Answer with the number of a command, 1 to {len(self.commands)}."
                return self._with_commands(text, None), 0.0, False, False, {"invalid": True}
            command = self.commands[index - 1]
        state, reward = self._play(command)
        info = {"command": command, "score": self._score, "won": bool(state.won)}
        text = self._with_commands(_clean(state.feedback), state, over=self._done)
        return text, reward, self._done, False, info

    def close(self) -> None:
        """Leave the started game to the next env of this process that plays it."""
        if self._env is not None and self._path is not None:
            with _TEXTWORLD:
                idle = _IDLE.setdefault(self._path, [])
                if len(idle) < _MAX_IDLE:
                    idle.append(self._env)
                else:
                    self._env.close()
        self._env = None
        self._path = None

    def __getstate__(self) -> dict[str, Any]:
        """The env without its started game: a copy starts the game again and replays the
        commands played since the reset (TextWorld replays exactly), for ``process_fork``."""
        state = dict(self.__dict__)
        state.update(_env=None, _textworld=None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._textworld = _import_textworld()
        if self._path is not None:  # the listed commands, score and end come back by replay
            played = self._played
            self._restart(self._path)
            for command in played:
                self._play(command)

    def _restart(self, path: Path) -> Any:
        """Start (or restart) the game at ``path``: its first state."""
        with _TEXTWORLD:
            if self._env is not None and self._path != path:
                self.close()
            if self._env is None:
                idle = _IDLE.get(path)
                self._env = idle.pop() if idle else self._start(path)
            self._path = path
            state = self._env.reset()
        self.max_score = float(state.max_score)
        self.walkthrough = list(state.get("extra.walkthrough") or [])
        self._played = []
        self._score = float(state.score or 0)
        self._done = False
        return state

    def _start(self, path: Path) -> Any:
        infos = self._textworld.EnvInfos(
            admissible_commands=True,
            max_score=True,
            score=True,
            won=True,
            lost=True,
            objective=True,
            description=True,
            extras=["walkthrough"],
        )
        with warnings.catch_warnings():  # jericho's: TextWorld keeps the score itself
            warnings.filterwarnings("ignore", message=".*is not fully supported")
            return self._textworld.start(str(path), request_infos=infos)

    def _play(self, command: str) -> tuple[Any, float]:
        """Send ``command`` to the game: its state and the score it gained."""
        with _TEXTWORLD:
            state, score, done = self._env.step(command)
        self._played.append(command)
        reward = float(score) - self._score
        self._score = float(score)
        self._done = bool(done)
        return state, reward

    def _with_commands(self, text: str, state: Any, *, over: bool = False) -> str:
        """``text`` and the admitted commands (those of ``state``, else the last listed),
        unless the game is ``over``."""
        if state is not None:
            self.commands = list(state.admissible_commands or [])
        if not self.list_commands or over:
            return text
        if self.answer_by_number:
            listed = "\n".join(f"{i}. {c}" for i, c in enumerate(self.commands, 1))
            return f"{text}\n\nCommands (answer with a number):\n{listed}"
        return f"{text}\n\nCommands: {', '.join(self.commands)}"


def make(
    entrypoint: str = CUSTOM,
    *,
    world_size: int = 2,
    nb_objects: int = 3,
    quest_length: int = 2,
    theme: str = "house",
    games: int | None = DEFAULT_GAMES,
    first_seed: int = 0,
    games_dir: str | None = None,
    answer_by_number: bool = False,
    list_commands: bool = True,
    max_turns: int = 8,
) -> TextWorldEnv:
    """A TextWorld env: ``entrypoint`` is a game file, or ``custom`` for games generated from
    the reset seeds with the given settings (``seed % games`` picks one of ``games`` games,
    generated from ``first_seed`` on; ``games: null`` gives every seed its own game).

    Raises:
        OptionalDependencyError: ``textworld`` is not installed.
        EnvBuildError: a setting is out of range, or ``entrypoint`` is not a game file.
    """
    custom = entrypoint == CUSTOM
    return TextWorldEnv(
        None if custom else entrypoint,
        settings=GameSettings(world_size, nb_objects, quest_length, theme) if custom else None,
        games=games,
        first_seed=first_seed,
        games_dir=games_dir,
        answer_by_number=answer_by_number,
        list_commands=list_commands,
        max_turns=max_turns,
    )


def _import_textworld() -> Any:
    try:
        import textworld
    except ImportError as exc:
        raise OptionalDependencyError("textworld", extra="envs", feature="TextWorld games") from exc
    return textworld


def _clean(text: str | None) -> str:
    """A game's text without its status line, its end's restart prompt and runs of blank
    lines."""
    text = _RESTART.sub("", _STATUS_LINE.sub("", text or ""))
    return _BLANK_LINES.sub("\n\n", text).strip()
