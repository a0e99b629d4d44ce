"""BranchManager: independence of branches, lifecycle, recursion, resolution, no leftovers."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable

import pytest
from branch_envs import LedgerEnv, LockedLedgerEnv, children_of, ledger_env, live_pids, marked_env

from agile_llmenvs.branching import BranchManager, ForkedEnvironment
from agile_llmenvs.core import Action, Environment, State, from_text_env
from agile_llmenvs.errors import BranchError, ReplayError, StaleStateError

A = Action.from_text


def at_step_two(env: Environment) -> tuple[State, tuple[Action, ...]]:
    state, _ = env.reset(seed=3, options={"start": "s"})
    actions = (A("a"), A("b"))
    for action in actions:
        state = env.step(state, action).next_state
    return state, actions


def pure_env() -> Environment:
    return from_text_env(LedgerEnv, name="ledger", pure_step=True)


SETUPS: dict[str, Callable[[], tuple[Environment, Callable[[], Environment] | None]]] = {
    "direct": lambda: (pure_env(), None),
    "process_fork": lambda: (ledger_env(), None),
    "action_replay": lambda: (ledger_env(), ledger_env),
}


@pytest.mark.parametrize("strategy", list(SETUPS))
def test_branches_are_independent_of_each_other_and_of_the_checkpoint(strategy: str) -> None:
    env, factory = SETUPS[strategy]()
    state, actions = at_step_two(env)
    with BranchManager.create(env, strategy=strategy, env_factory=factory) as manager:  # type: ignore[arg-type]
        assert manager.strategy_name == strategy
        manager.checkpoint("k", state, actions, {"seed": 3, "start": "s"})
        branches = [manager.branch("k") for _ in range(3)]
        assert all(s.observation == "s|a|b" and s.step_count == 2 for _, s in branches)
        first_env, first_state = branches[0]
        deep = first_env.step(first_state, A("x")).next_state
        deep = first_env.step(deep, A("y")).next_state
        assert deep.observation == "s|a|b|x|y"
        for index, (branch_env, branch_state) in enumerate(branches[1:], start=1):
            result = branch_env.step(branch_state, A(f"only{index}"))
            assert result.next_state.observation == f"s|a|b|only{index}"
            assert result.reward == 4.0
        again_env, again_state = manager.branch("k")
        assert again_env.step(again_state, A("z")).next_state.observation == "s|a|b|z"
    assert env.step(state, A("orig")).next_state.observation == "s|a|b|orig"


def test_process_fork_branches_live_in_their_own_processes() -> None:
    env = ledger_env()
    state, _ = at_step_two(env)
    with BranchManager.create(env) as manager:
        manager.checkpoint("k", state)
        branch_env, branch_state = manager.branch("k")
        assert isinstance(branch_env, ForkedEnvironment)
        info = branch_env.step(branch_state, A("x")).info
        assert info["pid"] == branch_env.pid != os.getpid()
        with pytest.raises(StaleStateError, match=r"episode 0 at step 2 cannot be stepped"):
            branch_env.step(branch_state, A("again"))  # the env's own error, same type


def test_same_name_overwrites_and_frees_the_old_checkpoint() -> None:
    env = ledger_env()
    state, _ = at_step_two(env)
    later = env.step(state, A("c")).next_state
    with BranchManager.create(env) as manager:
        manager.checkpoint("k", state)
        old_env, _ = manager.branch("k")
        assert isinstance(old_env, ForkedEnvironment)
        old_pids = [old_env.pid, old_env.parent.pid]  # type: ignore[union-attr]
        manager.checkpoint("k", later)
        assert manager.names == ("k",)
        _, new_state = manager.branch("k")
        assert new_state.observation == "s|a|b|c"
        assert live_pids(old_pids) == []
        with pytest.raises(BranchError, match=rf"branch process {old_pids[0]} was released"):
            old_env.step(state, A("x"))


def test_release_and_close() -> None:
    env = ledger_env()
    state, _ = at_step_two(env)
    manager = BranchManager.create(env)
    manager.checkpoint("a", state)
    manager.checkpoint("b", state)
    branch_env, _ = manager.branch("a")
    manager.release("a")
    assert manager.names == ("b",)
    assert "a" not in manager
    assert "b" in manager
    with pytest.raises(BranchError, match=r"^no checkpoint named 'a' \(checkpoints held: 'b'\)$"):
        manager.branch("a")
    with pytest.raises(BranchError, match=r"^no checkpoint named 'a'"):
        manager.release("a")
    assert isinstance(branch_env, ForkedEnvironment)
    assert live_pids([branch_env.pid]) == []
    manager.close()
    manager.close()  # idempotent
    with pytest.raises(BranchError, match=r"^this BranchManager is closed; create a new one$"):
        manager.branch("b")
    with pytest.raises(BranchError, match=r"^this BranchManager is closed"):
        manager.checkpoint("c", state)


def test_depth_two_recursion_gives_nine_independent_leaves() -> None:
    env = ledger_env()
    state, actions = at_step_two(env)
    leaves: list[str] = []
    pids: list[int] = []
    with BranchManager.create(env) as manager:
        manager.checkpoint("A", state, actions, {"seed": 3, "start": "s"})
        for i in range(3):
            b_env, b_state = manager.branch("A")
            result = b_env.step(b_state, A(f"i{i}"))
            with BranchManager.create(b_env) as sub:
                assert sub.strategy_name == "process_fork"
                sub.checkpoint("B", result.next_state)
                for j in range(3):
                    bb_env, bb_state = sub.branch("B")
                    assert isinstance(bb_env, ForkedEnvironment)
                    pids.append(bb_env.pid)
                    leaves.append(bb_env.step(bb_state, A(f"j{j}")).next_state.observation)
            # the branch itself did not move when its sub-branches did
            assert b_env.step(result.next_state, A("end")).next_state.observation == (
                f"s|a|b|i{i}|end"
            )
    assert leaves == [f"s|a|b|i{i}|j{j}" for i in range(3) for j in range(3)]
    assert len(set(pids)) == 9
    assert live_pids(pids) == []


def test_auto_resolution_picks_the_documented_strategy() -> None:
    assert BranchManager.create(pure_env()).strategy_name == "direct"
    forkable = BranchManager.create(ledger_env())
    assert forkable.strategy_name == "process_fork"
    forkable.close()
    replayed = BranchManager.create(marked_env(), env_factory=ledger_env)
    assert replayed.strategy_name == "action_replay"
    with pytest.raises(
        BranchError,
        match=r"^no branching strategy fits 'marked': it is not pure-step, not forkable, "
        r"and no env_factory was given for action_replay$",
    ):
        BranchManager.create(marked_env())


def test_a_strategy_that_does_not_fit_is_refused() -> None:
    with pytest.raises(BranchError, match=r"^direct branching needs a pure-step env; 'ledger'"):
        BranchManager.create(ledger_env(), strategy="direct")
    with pytest.raises(BranchError, match=r"^'marked' is not forkable \(spec.forkable=False"):
        BranchManager.create(marked_env(), strategy="process_fork")
    with pytest.raises(BranchError, match=r"^action_replay branching builds each branch"):
        BranchManager.create(ledger_env(), strategy="action_replay")
    with pytest.raises(BranchError, match=r"^unknown branching strategy 'copy'"):
        BranchManager.create(ledger_env(), strategy="copy")  # type: ignore[arg-type]


def test_action_replay_checks_what_it_replays() -> None:
    env = ledger_env()
    state, actions = at_step_two(env)
    with BranchManager.create(env, "action_replay", env_factory=ledger_env) as manager:
        with pytest.raises(
            BranchError,
            match=r"^checkpoint 'k': its state is at step 2 but 1 actions were given",
        ):
            manager.checkpoint("k", state, actions[:1], {"seed": 3, "start": "s"})
        manager.checkpoint("wrong", state, (A("a"), A("q")), {"seed": 3, "start": "s"})
        with pytest.raises(ReplayError, match=r"^replaying 2 actions reached"):
            manager.branch("wrong")


def test_an_env_that_does_not_pickle_is_rebuilt_by_replay_or_refused() -> None:
    env = from_text_env(LockedLedgerEnv, name="locked")
    state, actions = at_step_two(env)
    with (
        BranchManager.create(env) as manager,
        pytest.raises(
            BranchError, match=r"^process_fork ships 'locked' to its branch processes and it"
        ),
    ):
        manager.checkpoint("k", state, actions, {"seed": 3, "start": "s"})
    factory = lambda: from_text_env(LockedLedgerEnv, name="locked")  # noqa: E731
    with BranchManager.create(env, env_factory=factory) as manager:
        manager.checkpoint("k", state, actions, {"seed": 3, "start": "s"})
        branch_env, branch_state = manager.branch("k")
        assert branch_env.step(branch_state, A("x")).next_state.observation == "s|a|b|x"


def test_no_process_is_left_after_an_exception_inside_the_with() -> None:
    env = ledger_env()
    state, _ = at_step_two(env)
    pids: list[int] = []

    def fail_inside() -> None:
        with BranchManager.create(env) as manager:
            manager.checkpoint("k", state)
            for _ in range(3):
                branch_env, _ = manager.branch("k")
                assert isinstance(branch_env, ForkedEnvironment)
                pids.append(branch_env.pid)
            zygote = manager.strategy._zygote  # type: ignore[attr-defined]
            pids.extend([zygote.pid, *children_of(zygote.pid)])
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        fail_inside()
    assert len(pids) == 5
    assert live_pids(pids) == []


def test_many_branch_release_cycles_leave_no_child_process() -> None:
    env = ledger_env()
    state, _ = at_step_two(env)
    with BranchManager.create(env) as manager:
        manager.checkpoint("k", state)
        held = manager._held["k"]
        holder_pid = held.holder.pid  # type: ignore[attr-defined]
        for i in range(200):
            branch_env, branch_state = manager.branch("k")
            branch_env.step(branch_state, A(str(i)))
            branch_env.close()
        assert children_of(holder_pid) == []
        assert len(held.branches) <= 1  # type: ignore[attr-defined]


SCRIPT = """
import sys
from branch_envs import ledger_env
from agile_llmenvs.branching import BranchManager
from agile_llmenvs.core import Action
env = ledger_env()
state, _ = env.reset(options={"start": "s"})
manager = BranchManager.create(env)
manager.checkpoint("k", state)
branch_env, _ = manager.branch("k")
zygote = manager.strategy._zygote
print(zygote.pid, branch_env.parent.pid, branch_env.pid, flush=True)
"""


def test_no_process_is_left_at_interpreter_exit() -> None:
    path = os.pathsep.join(p for p in sys.path if p)
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": path},
        timeout=60,
        check=True,
    )
    pids = [int(pid) for pid in done.stdout.split()]
    assert len(pids) == 3
    deadline = time.monotonic() + 5
    while live_pids(pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert live_pids(pids) == []
