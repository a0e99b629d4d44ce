"""The branching wire against hostile envs: no inherited sockets, no code run from a pickle."""

from __future__ import annotations

import pickle
import struct
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from branch_envs import TouchOnLoad, shell_ledger_env

from agile_llmenvs.branching import BranchManager, ForkedEnvironment
from agile_llmenvs.branching._wire import WireRefusedError, receive, send, socketpair
from agile_llmenvs.core import Action, State
from agile_llmenvs.errors import BranchError

A = Action.from_text
REFUSAL = (
    "the branching wire refused a message naming posix.system: it carries plain data, "
    "states, actions, step results, errors and numpy arrays, nothing else"
)


@pytest.fixture
def pwned() -> Iterator[Path]:
    """A path a forged pickle would create; it must never appear."""
    path = Path(f"/tmp/pwned-{uuid.uuid4().hex}")
    yield path
    path.unlink(missing_ok=True)


def _at_step_one() -> tuple[object, State]:
    env = shell_ledger_env()
    state, _ = env.reset(seed=0, options={"start": "s"})
    return env, env.step(state, A("a")).next_state


def test_a_shell_an_env_starts_inherits_no_branch_socket() -> None:
    env, state = _at_step_one()
    with BranchManager.create(env, strategy="process_fork") as manager:  # type: ignore[arg-type]
        manager.checkpoint("k", state)
        branch_env, branch_state = manager.branch("k")
        assert isinstance(branch_env, ForkedEnvironment)
        assert not branch_env.sock.get_inheritable()
        after = branch_env.step(branch_state, A("fds")).next_state
        listing = after.observation
        assert " 0 -> " in listing  # the shell ran and listed its descriptors
        assert "socket:" not in listing
        with BranchManager.create(branch_env) as nested:  # a branch of the branch, too
            nested.checkpoint("n", after)
            leaf_env, leaf_state = nested.branch("n")
            leaf_listing = leaf_env.step(leaf_state, A("fds")).next_state.observation
            assert " 0 -> " in leaf_listing
            assert "socket:" not in leaf_listing


def test_a_forged_pickle_from_a_branch_is_refused_and_runs_nothing(pwned: Path) -> None:
    env, state = _at_step_one()
    with BranchManager.create(env, strategy="process_fork") as manager:  # type: ignore[arg-type]
        manager.checkpoint("k", state)
        branch_env, branch_state = manager.branch("k")
        assert isinstance(branch_env, ForkedEnvironment)
        with pytest.raises(WireRefusedError) as refused:
            branch_env.step(branch_state, A(f"forge:{pwned}"))
        assert str(refused.value) == (
            f"branch process {branch_env.pid} sent a message the manager refuses, so the "
            f"branch is closed: {REFUSAL}"
        )
        assert isinstance(refused.value, BranchError)
        assert not pwned.exists()
        assert branch_env.closed
        with pytest.raises(BranchError, match="was released or closed"):
            branch_env.step(branch_state, A("b"))
        again_env, again_state = manager.branch("k")  # the checkpoint still branches
        assert again_env.step(again_state, A("b")).next_state.observation == "s|a|b"
    assert not pwned.exists()


def test_the_wire_refuses_any_global_but_its_own(pwned: Path) -> None:
    mine, theirs = socketpair()
    with mine, theirs:
        assert not mine.get_inheritable()
        assert not theirs.get_inheritable()
        forged = pickle.dumps(("ok", TouchOnLoad(str(pwned))))
        theirs.sendall(struct.pack("!Q", len(forged)) + forged)
        with pytest.raises(WireRefusedError) as refused:
            receive(mine)
        assert str(refused.value) == REFUSAL
        assert not pwned.exists()
        custom = pickle.dumps(TouchOnLoad)  # an env's own class is refused too
        theirs.sendall(struct.pack("!Q", len(custom)) + custom)
        with pytest.raises(WireRefusedError, match=r"naming branch_envs\.TouchOnLoad: "):
            receive(mine)
        import numpy as np

        message = (
            "ok",
            (State("o", ({"role": "user", "content": "o"},), payload=np.arange(3)), 1.5),
            ValueError("v"),
            BranchError("b"),
            {1, 2},
            frozenset({3}),
            complex(1, 2),
            np.float32(0.5),
        )
        send(theirs, message)  # the stream is still framed after a refusal
        back = receive(mine)
        assert back[0] == "ok"
        assert back[1][0].payload.tolist() == [0, 1, 2]
        assert [type(v) for v in back[2:]] == [
            ValueError,
            BranchError,
            set,
            frozenset,
            complex,
            np.float32,
        ]
