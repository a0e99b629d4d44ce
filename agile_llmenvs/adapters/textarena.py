"""TextArena games (``textarena``, the ``envs`` extra) as text envs: ``factory:
agile_llmenvs.adapters.textarena:make`` with a game id such as ``GuessTheNumber-v0`` as the
entrypoint.

The policy plays one player (``player_id``, default 0). In a two-player game every other
player is an *opponent*: a callable ``(observation_text) -> action_text`` played inside
:meth:`TextArenaEnv.step` until it is the policy's turn again, or a second model
(:class:`ModelPlayer`): a backend config or any :class:`~agile_llmenvs.backends.Backend`.

Three things TextArena does that a text env must not:

* it pays the rewards at ``close()``, once the game is over: the adapter reports the policy's
  reward on the terminal step (0.0 before), and ``terminated`` is the game's own end;
* its default wrappers repeat the whole history every turn: the adapter plays the raw game and
  passes on only the messages that arrived since the policy's last turn (its own action's echo
  left out);
* its games draw from the global :mod:`random`: each env keeps its own random state, swapped in
  around every call into the game, so ``reset(seed=s)`` plays the same game whatever other envs
  do meanwhile.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
import random
import re
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any, cast

from agile_llmenvs.adapters._nltk import nltk_offline
from agile_llmenvs.backends.types import Backend, SamplingParams
from agile_llmenvs.errors import EnvBuildError, EnvExecutionError, OptionalDependencyError

__all__ = ["FirstMovePlayer", "ModelPlayer", "RandomMovePlayer", "TextArenaEnv", "make"]

Opponent = Callable[[str], str]

DEFAULT_OPPONENT_SAMPLING: dict[str, Any] = {"max_tokens": 64, "temperature": 0.0}
"""A model opponent's sampling unless its config's ``sampling`` says otherwise: greedy."""

DEFAULT_MAX_ACTION_CHARS = 2000
"""The most characters of a policy's reply a game parses (its last ones)."""

DEFAULT_MAX_TURNS = 100
"""The turn budget of a game that declares no turn limit (TicTacToe ends on its own)."""

_GLOBAL_RANDOM = threading.Lock()  # guards the swap of the global random state
_MOVE = re.compile(r"\[[^\[\]\n]+\]")
_GAME_ID = -1
# backends built from an opponent config, one per config per process, each with its lock


def listed_moves(observation: str) -> list[str]:
    """The bracketed moves (``[4]``, ``[e2e4]``) of the last line of ``observation`` that lists
    any (a game's "Available Moves: ..." line), else of the whole text; unique, in order."""
    lines = [line for line in observation.splitlines() if _MOVE.search(line)]
    listing = next((ln for ln in reversed(lines) if "move" in ln.lower()), None)
    found = _MOVE.findall(listing if listing is not None else observation)
    return list(dict.fromkeys(found))


class RandomMovePlayer:
    """An opponent that plays a random move of those the game lists (``[0]`` when it lists
    none, for the game's invalid-move rule to judge). ``reset(seed)`` makes it replayable."""

    def __init__(self, seed: int | None = None) -> None:
        self.rng = random.Random(seed)

    def reset(self, seed: int | None) -> None:
        """Restart its random stream (the env's seed, so an episode replays exactly)."""
        self.rng = random.Random(seed)

    def __call__(self, observation: str) -> str:
        moves = listed_moves(observation)
        return self.rng.choice(moves) if moves else "[0]"


class FirstMovePlayer:
    """A scripted opponent: always the first move the game lists (``[0]`` when none)."""

    def __call__(self, observation: str) -> str:
        moves = listed_moves(observation)
        return moves[0] if moves else "[0]"


class ModelPlayer:
    """An opponent played by a generation backend: the game's messages to its seat are ``user``
    messages of one conversation per episode, its replies (``assistant`` messages) its moves,
    sent to the game as they are.

    Generation is serialised on ``lock`` (one local backend shared by the envs of several
    rollout threads generates one call at a time). A sampling (non-greedy) opponent draws
    with the episode's seed, so a seeded episode replays.

    Attributes:
        moves: The moves it played this episode, in order.
    """

    def __init__(
        self,
        backend: Backend,
        *,
        sampling: SamplingParams | None = None,
        system_prompt: str = "",
        lock: threading.Lock | None = None,
    ) -> None:
        self.backend = backend
        self.sampling = sampling or SamplingParams(**DEFAULT_OPPONENT_SAMPLING)
        self.system_prompt = system_prompt
        self._lock = lock if lock is not None else threading.Lock()
        self._seed: int | None = None
        self._messages: list[dict[str, str]] = []
        self.moves: list[str] = []
        self.reset(None)

    def reset(self, seed: int | None) -> None:
        """Start a new episode's conversation (``seed`` seeds a sampling opponent)."""
        self._seed = seed
        system = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        self._messages = system
        self.moves = []

    def __call__(self, observation: str) -> str:
        self._messages.append({"role": "user", "content": observation})
        params = self.sampling
        if self._seed is not None and not params.greedy:
            params = dataclasses.replace(params, seed=self._seed + len(self.moves))
        with self._lock:
            completion = self.backend.generate_chat(list(self._messages), params)
        if completion.finish_reason == "error":
            raise EnvExecutionError(f"textarena: the opponent's backend failed: {completion.error}")
        self._messages.append({"role": "assistant", "content": completion.text})
        self.moves.append(completion.text)
        return completion.text


class TextArenaEnv:
    """A raw (unwrapped) TextArena game behind the :class:`~agile_llmenvs.llm_envs.TextEnv`
    contract.

    Attributes:
        max_turns: The most replies the game can take from the policy, so that the harness
            never truncates before the game's own end (and its reward): the game's turn limit
            (the policy's share of it when players alternate) plus one, as games check the
            limit before counting the turn, doubled because each turn forgives one invalid
            move; :data:`DEFAULT_MAX_TURNS` when the game declares no limit.
        num_players: The game's players (the policy and its opponents).
        max_action_chars: The most characters of a reply the game parses: a longer one is
            cut to its last ``max_action_chars`` (where a reasoning reply writes its move);
            an opponent's reply too.
            Games parse moves with regular expressions that backtrack: ConnectFour took 19 s
            on a 32,000-character ``[[[...`` reply, 77 s on 64,000.
    """

    def __init__(
        self,
        game: Any,
        *,
        num_players: int,
        player_id: int = 0,
        opponent: Opponent | None = None,
        max_turns: int | None = None,
        max_action_chars: int = DEFAULT_MAX_ACTION_CHARS,
    ) -> None:
        if max_action_chars < 1:
            raise EnvBuildError(f"max_action_chars must be at least 1, got {max_action_chars}")
        self.max_action_chars = max_action_chars
        self.game = game
        self.num_players = num_players
        self.player_id = player_id
        self.opponent = opponent if opponent is not None else RandomMovePlayer()
        self._random_state = random.getstate()
        with self._own_random():  # a probe game: the state's own limits
            game.reset(num_players=num_players, seed=0)
        self._random_state = random.Random().getstate()  # unseeded resets differ by env
        state = game.state
        self.max_turns = max_turns or _policy_turn_budget(
            getattr(state, "max_turns", None) or getattr(game, "max_turns", None),
            num_players,
            int(getattr(state, "error_allowance", 0) or 0),
        )
        self._done = True

    def reset(self, *, seed: int | None = None, **task: Any) -> tuple[str, dict[str, Any]]:
        """Start a game (``seed`` picks it and the built-in opponent's moves); other task keys
        (a collector's ``row_index``) are ignored."""
        if seed is not None:
            self._random_state = random.Random(seed).getstate()
        with self._own_random():
            self.game.reset(num_players=self.num_players, seed=seed)
        reset_opponent = getattr(self.opponent, "reset", None)
        if callable(reset_opponent):
            reset_opponent(seed)
        self._done = False
        opponent_moves = self._play_opponents()
        observation, reward, done, info = self._turn_result()
        info["opponent_moves"] = opponent_moves
        if done:  # an opponent ended the game before the policy's first move
            self._done = True
            info["reward"] = reward
        return observation, info

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        """Play the policy's text, then the opponents' moves until it is the policy's turn or
        the game is over."""
        if self._done:
            raise RuntimeError("step() before reset() or after the game ended")
        with self._own_random():
            self.game.step(action=action[-self.max_action_chars :])
        opponent_moves = self._play_opponents()
        observation, reward, done, info = self._turn_result()
        info["opponent_moves"] = opponent_moves
        self._done = done
        return observation, reward, done, False, info

    def close(self) -> None:
        """Nothing to release: the game holds no threads or files, and a model opponent's
        backend built from a config is shared by the process's envs, living as long as it."""

    def _play_opponents(self) -> list[str]:
        moves = []
        state = self.game.state
        while not state.done and state.current_player_id != self.player_id:
            opponent_id = state.current_player_id
            # an opponent's reply is cut as the policy's is: a model opponent answering 1 MB
            # neither stalls the game's parser nor fills the episode's info
            move = self.opponent(self._new_messages(opponent_id))[-self.max_action_chars :]
            moves.append(move)
            with self._own_random():
                self.game.step(action=move)
        return moves

    def _turn_result(self) -> tuple[str, float, bool, dict[str, Any]]:
        state = self.game.state
        observation = self._new_messages(self.player_id)
        if not state.done:
            return observation, 0.0, False, {}
        rewards, game_info = self.game.close()  # TextArena pays at close()
        reward = float((rewards or {}).get(self.player_id, 0.0))
        info = dict((game_info or {}).get(self.player_id, {}))
        reason = info.get("reason")
        if reason:
            observation = f"{observation}\n[GAME] {reason}".lstrip("\n")
        return observation, reward, True, info

    def _new_messages(self, player_id: int) -> str:
        """The messages ``player_id`` has not seen yet (its own action's echo left out), as
        TextArena's LLM wrapper renders them; the game's queue is emptied."""
        state = self.game.state
        messages = state.observations[player_id]
        state.observations[player_id] = []
        lines = []
        for sender, message, kind in messages:
            if sender == player_id and kind.name == "PLAYER_ACTION":
                continue
            name = "GAME" if sender == _GAME_ID else state.role_mapping.get(sender, sender)
            lines.append(f"[{name}] {message}")
        return "\n".join(lines)

    @contextmanager
    def _own_random(self) -> Iterator[None]:
        with _GLOBAL_RANDOM:
            outside = random.getstate()
            random.setstate(self._random_state)
            try:
                yield
            finally:
                self._random_state = random.getstate()
                random.setstate(outside)


def _policy_turn_budget(game_turns: int | None, num_players: int, error_allowance: int) -> int:
    if not game_turns:
        return DEFAULT_MAX_TURNS
    # +1: games check their limit before counting the turn (GuessTheNumber's 10 take 11 guesses)
    return (math.ceil(int(game_turns) / num_players) + 1) * (1 + error_allowance)


def make(
    env_id: str,
    *,
    opponent: str | Mapping[str, Any] | Backend | Opponent = "random",
    player_id: int = 0,
    num_players: int | None = None,
    max_turns: int | None = None,
    max_action_chars: int = DEFAULT_MAX_ACTION_CHARS,
    **kwargs: Any,
) -> TextArenaEnv:
    """Build TextArena game ``env_id`` (``GuessTheNumber-v0``; a ``-raw``/``-train`` suffix is
    dropped, the game is always played raw) as a text env.

    Args:
        env_id: A TextArena registry id.
        opponent: Who plays the other seats: ``"random"`` (a random listed move, seeded by
            ``reset``), ``"first"`` (the first listed move), a ``"module:attr"`` callable (a
            class is instantiated without arguments), the callable itself, or a second model
            (:class:`ModelPlayer`): a backend config mapping (``{backend, model, ...}`` as an
            eval config's ``model``, plus optional ``sampling: {max_tokens, temperature,
            ...}``, greedy and 64 tokens by default, and ``system_prompt``), built once per
            process, or a :class:`~agile_llmenvs.backends.Backend`.
        player_id: The seat the policy plays.
        num_players: Players in the game; default the fewest it accepts (1, else 2).
        max_turns: Override the turn budget derived from the game.
        max_action_chars: The most characters of a reply the game parses (its last ones;
            see :class:`TextArenaEnv`).
        **kwargs: The game's own constructor arguments (``max_turns`` of the game is
            ``game_max_turns`` here, to keep it apart from the env's budget).

    Raises:
        OptionalDependencyError: ``textarena`` is not installed.
        EnvBuildError: TextArena has no game ``env_id``, refuses ``kwargs`` or ``num_players``,
            or ``opponent`` names nothing callable or is an invalid backend config; or the
            game needs NLTK data that is not installed (it is never downloaded here).
    """
    try:
        with nltk_offline(f"TextArena game {env_id!r}"):  # its package imports word games
            import textarena
            from textarena.envs.registration import ENV_REGISTRY
    except ImportError as exc:
        raise OptionalDependencyError(
            "textarena", extra="envs", feature=f"the TextArena game {env_id!r}"
        ) from exc
    base_id = re.sub(r"-(raw|train)$", "", env_id)
    if base_id not in ENV_REGISTRY:
        raise EnvBuildError(f"TextArena has no game {env_id!r} (ids look like 'TicTacToe-v0')")
    if "game_max_turns" in kwargs:
        kwargs["max_turns"] = kwargs.pop("game_max_turns")
    try:
        with nltk_offline(f"TextArena game {env_id!r}"):
            game = textarena.make(base_id, **kwargs)
    except EnvBuildError:
        raise
    except Exception as exc:
        raise EnvBuildError(
            f"TextArena could not build {env_id!r}: {type(exc).__name__}: {exc}"
        ) from exc
    while isinstance(game, textarena.Wrapper):  # the raw game: no history-repeating wrappers
        game = game.env
    players = num_players or _fewest_players(game, env_id)
    try:
        return TextArenaEnv(
            game,
            num_players=players,
            player_id=player_id,
            opponent=_opponent(opponent),
            max_turns=max_turns,
            max_action_chars=max_action_chars,
        )
    except EnvBuildError:
        raise
    except Exception as exc:
        raise EnvBuildError(
            f"TextArena could not start {env_id!r} with {players} players: "
            f"{type(exc).__name__}: {exc}"
        ) from exc


def _fewest_players(game: Any, env_id: str) -> int:
    for players in (1, 2):
        try:
            with _GLOBAL_RANDOM:
                outside = random.getstate()
                try:
                    game.reset(num_players=players, seed=0)
                finally:
                    random.setstate(outside)
        except (AssertionError, ValueError):  # TextArena asserts the player count
            continue
        return players
    raise EnvBuildError(
        f"TextArena game {env_id!r} takes neither 1 nor 2 players: set env_config.num_players"
    )


def _opponent(opponent: str | Mapping[str, Any] | Backend | Opponent) -> Opponent:
    if isinstance(opponent, Mapping):
        return _model_player(dict(opponent))
    if hasattr(opponent, "generate_chat"):  # a Backend, built by the user
        return ModelPlayer(cast(Backend, opponent))
    if callable(opponent):
        return opponent
    if not isinstance(opponent, str):
        raise EnvBuildError(
            "opponent must be 'random', 'first', a 'module:attr' callable, a backend config or "
            f"a Backend, got {type(opponent).__name__}"
        )
    if opponent == "random":
        return RandomMovePlayer()
    if opponent == "first":
        return FirstMovePlayer()
    module_name, _, attr = opponent.partition(":")
    try:
        found = getattr(importlib.import_module(module_name), attr) if attr else None
    except (ImportError, AttributeError) as exc:
        raise EnvBuildError(f"opponent {opponent!r} cannot be imported: {exc}") from exc
    if isinstance(found, type):  # a player class, as the built-in ones: one instance
        found = found()
    if not callable(found):
        raise EnvBuildError(
            f"opponent must be 'random', 'first' or a 'module:attr' callable, got {opponent!r}"
        )
    return found


def _model_player(config: dict[str, Any]) -> ModelPlayer:
    """The opponent a backend config describes; the backend is built once per process (every
    rollout slot's env builds its opponent, and a local model is loaded only once)."""
    from agile_llmenvs.config.factories import shared_backend

    try:
        sampling = SamplingParams(**{**DEFAULT_OPPONENT_SAMPLING, **config.pop("sampling", {})})
    except (TypeError, ValueError) as exc:
        raise EnvBuildError(f"textarena: env_config.opponent.sampling: {exc}") from exc
    system_prompt = str(config.pop("system_prompt", ""))
    backend, lock = shared_backend(config, "textarena: env_config.opponent")
    return ModelPlayer(backend, sampling=sampling, system_prompt=system_prompt, lock=lock)
