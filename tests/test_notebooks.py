"""The notebooks run end to end in a real Jupyter kernel and show what they claim.

They are stored without outputs; each is executed from ``notebooks/`` (where a reader opens
it) with nbclient on the ``python3`` kernel of this environment, and its printed results are
checked.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))

nbformat = pytest.importorskip("nbformat", reason="the notebooks need the docs extra")


def _execute(name: str) -> Any:
    pytest.importorskip("nbclient", reason="the notebooks need the docs extra")
    pytest.importorskip("ipykernel", reason="the notebooks need the docs extra")
    from jupyter_client.kernelspec import KernelSpecManager
    from nbclient import NotebookClient

    if "python3" not in KernelSpecManager().find_kernel_specs():
        pytest.fail(
            "no python3 kernel spec: `pip install ipykernel` installs it with the docs extra"
        )
    notebook = nbformat.read(ROOT / "notebooks" / name, as_version=4)
    client = NotebookClient(
        notebook,
        timeout=600,
        kernel_name="python3",
        resources={"metadata": {"path": str(ROOT / "notebooks")}},
    )
    client.execute()
    return notebook


def _stdout(notebook: Any) -> str:
    return "".join(
        output.get("text", "")
        for cell in notebook.cells
        if cell.cell_type == "code"
        for output in cell.outputs
        if output.output_type == "stream" and output.name == "stdout"
    )


def _images(notebook: Any) -> int:
    return sum(
        "image/png" in output.get("data", {})
        for cell in notebook.cells
        if cell.cell_type == "code"
        for output in cell.outputs
    )


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebooks_are_stored_without_outputs(path: Path) -> None:
    notebook = nbformat.read(path, as_version=4)
    nbformat.validate(notebook)
    for cell in notebook.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [], f"{path.name}: clear the outputs before committing"
            assert cell.execution_count is None, f"{path.name}: clear the execution counts"


def test_the_notebooks_are_the_documented_ones() -> None:
    assert [path.name for path in NOTEBOOKS] == ["branching.ipynb", "quickstart.ipynb"]


@pytest.mark.slow
def test_quickstart_learns_and_plots_the_reward_curve() -> None:
    notebook = _execute("quickstart.ipynb")
    out = _stdout(notebook)
    assert "400 steps; metrics in" in out
    first = float(re.search(r"mean reward, first 50 steps: ([\d.]+)", out).group(1))  # type: ignore[union-attr]
    last = float(re.search(r"mean reward, last 50 steps: ([\d.]+)", out).group(1))  # type: ignore[union-attr]
    assert first < 0.1  # the random-init model rarely says a digit
    assert last > first + 0.2, (first, last)
    assert _images(notebook) == 1  # the reward curve, inline


@pytest.mark.slow
def test_branching_q_values_match_the_exact_ones() -> None:
    notebook = _execute("branching.ipynb")
    out = _stdout(notebook)
    rows = re.findall(r"Q\(start, (\w+)\): estimate ([\d.]+) \+- ([\d.]+), exact ([\d.]+)", out)
    assert [action for action, *_ in rows] == ["risky", "safe"]
    for _, estimate, half_width, exact in rows:
        assert abs(float(estimate) - float(exact)) <= float(half_width)
    assert [float(exact) for *_, exact in rows] == [1.1875, 0.25]
    assert "best first action: risky" in out
    assert _images(notebook) == 1
