"""The Harbor adapter: a lazy import with a clear error, and the terminal env's one replay.

``harbor`` needs Python >= 3.12 and a container engine, which these machines lack, so its
container path cannot run here; what runs is everything that does not need it.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from dataclasses import replace

import pytest

from agile_llmenvs.adapters import terminal
from agile_llmenvs.adapters.harbor import (
    HarborAdapter,
    harbor_restore,
    validate_replay_consistency,
)
from agile_llmenvs.core import Action
from agile_llmenvs.errors import OptionalDependencyError, TaskMismatchError

HARBOR_MISSING = importlib.util.find_spec("harbor") is None


def test_importing_the_adapter_does_not_import_harbor() -> None:
    code = "import sys, agile_llmenvs.adapters.harbor; print('harbor' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout == "False\n"


@pytest.mark.skipif(not HARBOR_MISSING, reason="harbor is installed here")
def test_a_missing_harbor_says_what_to_install() -> None:
    with pytest.raises(OptionalDependencyError) as caught:
        HarborAdapter().get_environment("terminal-bench@2.0", max_steps=30)
    assert str(caught.value) == (
        "The package 'harbor' is needed for Harbor tasks (harbor needs Python >= 3.12 and a "
        "container engine such as Docker) but is not installed; run: pip install harbor"
    )
    assert isinstance(caught.value.__cause__, ImportError)


def test_harbor_restore_is_the_terminal_replay(make_env) -> None:
    assert validate_replay_consistency is terminal.validate_replay_consistency
    original = make_env()
    state, _ = original.reset(options={"task_index": 1})
    state = original.step(state, Action.from_text("echo 'Hello, agent!' > greeting.txt")).next_state
    fresh = make_env()
    restored = harbor_restore(fresh, state)
    assert restored.payload == state.payload
    assert fresh.step(restored, Action.from_text("submit")).reward == 1.0
    drifted = replace(state, payload=terminal.CommandHistory(1, "renamed_task"))
    with pytest.raises(TaskMismatchError, match=r"^task index 1 is 'create_greeting' in this env"):
        harbor_restore(make_env(), drifted)
