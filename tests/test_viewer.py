"""``agile-llmenvs show``: the page of a run's logged episodes, rendered in a real headless
Chromium (the DOM it builds and a screenshot), and the errors of a run with nothing to show.

The browser tests skip where ``chromium`` is missing, unless ``AGILE_LLMENVS_REQUIRE_BROWSER``
is set (CI sets it, and installs chromium), in which case they fail.
"""

from __future__ import annotations

import os
import shutil
import struct
import subprocess
from dataclasses import dataclass, field
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest

from agile_llmenvs.cli import main
from agile_llmenvs.core import EpisodeData, StopReason, TokenSample, Trajectory, failed_episode
from agile_llmenvs.llm_envs.tasks import Task
from agile_llmenvs.viewer import read_rollouts, render_page
from agile_llmenvs.viewer.command import parse_steps
from agile_llmenvs.viewer.page import RunPage
from agile_llmenvs.viewer.records import ROLLOUTS_FILE, select_steps

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
HOSTILE = "<script>alert(1)</script>"
BREAKOUT = "</pre><img src=x onerror=alert(2)>"

needs_browser = pytest.mark.skipif(
    CHROMIUM is None and not os.environ.get("AGILE_LLMENVS_REQUIRE_BROWSER"),
    reason="chromium is not installed (apt-get install chromium; CI sets "
    "AGILE_LLMENVS_REQUIRE_BROWSER=1 so these tests fail there instead)",
)


def _sample(tokenizer: Any, parts: list[tuple[str, str]]) -> TokenSample:
    """A token sample of ``(source, text)`` parts, each part's text tokenised on its own."""
    ids: list[int] = []
    mask: list[bool] = []
    turn_ids: list[int] = []
    turn = -1
    for source, text in parts:
        turn += source == "sampled"
        for token in tokenizer.encode(text, add_special_tokens=False):
            if ids:  # masks describe next-token targets
                mask.append(source == "sampled")
                turn_ids.append(turn if source == "sampled" else -1)
            ids.append(token)
    return TokenSample(tuple(ids), tuple(mask), tuple(turn_ids))


PROMPT = "<|im_start|>user\nSay a digit.<|im_end|>\n<|im_start|>assistant\n"
RETRY = "\n<|im_start|>user\nNot a digit." + BREAKOUT + "<|im_end|>\n<|im_start|>assistant\n"


def _trajectories(tokenizer: Any, step: int) -> list[Trajectory]:
    hostile = _sample(
        tokenizer,
        [
            ("prompt", PROMPT),
            ("sampled", HOSTILE + "<|im_end|>"),
            ("env", RETRY),
            ("sampled", "7<|im_end|>"),
        ],
    )
    plain = _sample(tokenizer, [("prompt", PROMPT), ("sampled", f"{step % 10}<|im_end|>")])
    task = Task(seed=step, row_index=3)
    return [
        Trajectory(0, 0, task, EpisodeData((hostile,), (0.0, 1.0), StopReason.TERMINATED)),
        Trajectory(0, 1, task, EpisodeData((plain,), (1.0,), StopReason.TERMINATED)),
        Trajectory(0, 2, task, failed_episode("the env server went away")),
    ]


def _write_run(run: Path, tokenizer: Any) -> None:
    """A run folder as a GRPO run leaves it: 20 steps of metrics, episodes of steps 10, 20."""
    from agile_llmenvs.training.run import RolloutLog

    log = RolloutLog(run / ROLLOUTS_FILE, tokenizer, every=10, count=3)
    for step in (10, 20):
        log.maybe_write(step, _trajectories(tokenizer, step))
    rows = ["step,reward_mean,loss,eval_reward_mean"]
    for step in range(1, 21):
        evaluation = f"{step / 25:.2f}" if step % 10 == 0 else ""
        rows.append(f"{step},{step / 20:.3f},0.1,{evaluation}")
    (run / "metrics.csv").write_text("\n".join(rows) + "\n", encoding="utf-8")


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def page(tokenizer: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``agile-llmenvs show`` on a written run folder; the page's path."""
    run = tmp_path_factory.mktemp("show") / "run"
    run.mkdir()
    _write_run(run, tokenizer)
    assert main(["show", str(run)]) == 0
    return run / "rollouts.html"


@dataclass
class Element:
    tag: str
    attrs: dict[str, str]
    text: str = ""
    children: list[Element] = field(default_factory=list)

    @property
    def classes(self) -> set[str]:
        return set(self.attrs.get("class", "").split())


class _DOM(HTMLParser):
    """Every element of an HTML document, flat, each with the text directly inside it."""

    VOID = {"meta", "img", "br", "input", "link", "hr", "circle", "line", "path"}

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.elements: list[Element] = []
        self.open: list[Element] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        element = Element(tag, {k: v or "" for k, v in attrs})
        self.elements.append(element)
        if self.open:
            self.open[-1].children.append(element)
        if tag not in self.VOID:
            self.open.append(element)

    def handle_endtag(self, tag: str) -> None:
        while self.open and self.open.pop().tag != tag:
            pass

    def handle_data(self, data: str) -> None:
        if self.open:
            self.open[-1].text += data

    def find(self, tag: str | None = None, cls: str | None = None) -> list[Element]:
        return [
            e
            for e in self.elements
            if (tag is None or e.tag == tag) and (cls is None or cls in e.classes)
        ]


def _chromium(page: Path, profile: Path, *flags: str) -> str:
    assert CHROMIUM is not None, "chromium is not installed: apt-get install -y chromium"
    command = [
        CHROMIUM,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        f"--user-data-dir={profile}",
        *flags,
        page.as_uri(),
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def _transcript_texts(dom: _DOM, source: str) -> list[str]:
    """The texts of the transcripts' spans of one source (the legend's are not)."""
    return [e.text for e in dom.find("span", source) if "data-turn" in e.attrs]


@needs_browser
def test_chromium_renders_the_episodes_coloured_by_provenance(
    page: Path, tmp_path: Path, tokenizer: Any
) -> None:
    dom = _DOM()
    dom.feed(_chromium(page, tmp_path / "profile", "--dump-dom"))

    episodes = dom.find("article", "episode")
    assert [e.attrs["data-step"] for e in episodes] == ["10"] * 3 + ["20"] * 3
    sampled = _transcript_texts(dom, "sampled")
    assert sampled.count(HOSTILE + "<|im_end|>") == 2  # the policy's turn 0, as text
    assert sampled.count("7<|im_end|>") == 2  # its turn 1
    assert "0<|im_end|>" in sampled  # step 20's plain episode
    [prompt, *_] = _transcript_texts(dom, "prompt")
    assert prompt == PROMPT
    env_spans = _transcript_texts(dom, "env")
    assert env_spans[:2] == [RETRY, RETRY]
    badges = [e.text for e in dom.find("span", "turn-reward") if "data-turn" in e.attrs]
    assert badges == ["turn 0: +0.000", "turn 1: +1.000", "turn 0: +1.000"] * 2
    assert not dom.find("script")  # the hostile completion made no element
    assert not dom.find("img")
    assert [e.text for e in dom.find("p", "error")] == ["env error: the env server went away"] * 2
    stops = [e.text for e in dom.find("span", "stop")]
    assert stops == ["terminated", "terminated", "env_error"] * 2

    [curve] = [e for e in dom.find("path") if e.attrs.get("id") == "reward-curve"]
    assert curve.attrs["d"].startswith("M")
    assert curve.attrs["d"].count("L") == 19
    [evaluation] = [e for e in dom.find("path") if e.attrs.get("id") == "eval-curve"]
    assert evaluation.attrs["d"].count("L") == 1
    marks = dom.find("circle", "shown-step")
    assert len(marks) == 2
    links = [e for e in dom.find("a") if any("shown-step" in c.classes for c in e.children)]
    assert [e.attrs["href"] for e in links] == ["#step-10", "#step-20"]
    assert {s.attrs["id"] for s in dom.find("section", "step")} == {"step-10", "step-20"}
    assert len(dom.find(cls="legend")) == 1


@needs_browser
def test_chromium_takes_a_screenshot_of_the_page(page: Path, tmp_path: Path) -> None:
    screenshot = tmp_path / "rollouts.png"
    _chromium(
        page,
        tmp_path / "profile",
        f"--screenshot={screenshot}",
        "--window-size=1200,2000",
        "--hide-scrollbars",
    )
    data = screenshot.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", data[16:24])
    assert (width, height) == (1200, 2000)
    assert len(data) > 30_000, len(data)  # a blank page of that size is a few kB


def test_page_escapes_every_text_and_has_no_script(tokenizer: Any, tmp_path: Path) -> None:
    _write_run(tmp_path, tokenizer)
    episodes = read_rollouts(tmp_path / ROLLOUTS_FILE)
    html = render_page(RunPage(title=HOSTILE, episodes=episodes, logged_steps=[10, 20], curve=[]))
    assert "<script" not in html
    assert "<img" not in html
    assert html.count("&lt;script&gt;") == 4  # the heading, <title>, a transcript per step
    assert "Content-Security-Policy" in html
    assert "http://" not in html.replace('xmlns="http://www.w3.org/2000/svg"', "")
    assert "https://" not in html


def test_show_without_rollouts_names_the_file_and_the_field(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["show", str(tmp_path)]) == 2
    [line] = capsys.readouterr().err.splitlines()
    assert f"{tmp_path / 'rollouts.jsonl'} does not exist" in line
    assert "training.log_rollouts_every" in line

    (tmp_path / "rollouts.jsonl").write_text("\n", encoding="utf-8")
    assert main(["show", str(tmp_path)]) == 2
    [line] = capsys.readouterr().err.splitlines()
    assert f"{tmp_path / 'rollouts.jsonl'} holds no episodes" in line
    assert "training.log_rollouts_every" in line
    assert not (tmp_path / "rollouts.html").exists()


def test_show_picks_steps_and_writes_where_asked(
    tokenizer: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "run"
    run.mkdir()
    _write_run(run, tokenizer)
    output = tmp_path / "out" / "page.html"
    assert main(["show", str(run), "--steps", "15-30", "--output", str(output)]) == 0
    assert capsys.readouterr().out == f"wrote {output}: 3 episodes\n"
    html = output.read_text(encoding="utf-8")
    assert 'id="step-20"' in html
    assert 'id="step-10"' not in html

    assert main(["show", str(run), "--steps", "11-19"]) == 2
    assert "no episodes of the steps asked for" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["show", str(run), "--steps", "20-10"])
    with pytest.raises(SystemExit):
        main(["show", str(run), "--limit", "-1"])


def test_a_line_cut_short_by_a_kill_is_left_out(tokenizer: Any, tmp_path: Path) -> None:
    _write_run(tmp_path, tokenizer)
    path = tmp_path / ROLLOUTS_FILE
    text = path.read_text(encoding="utf-8")
    path.write_text(text + text.splitlines()[0][:40], encoding="utf-8")
    assert len(read_rollouts(path)) == 6
    path.write_text('{"step": 1}\n' + text, encoding="utf-8")
    with pytest.raises(ValueError, match=r"rollouts.jsonl:1: not a logged episode \(group"):
        read_rollouts(path)


def test_steps_are_picked_by_range_and_spread_to_the_limit() -> None:
    assert [list(r) for r in parse_steps("3,10-12")] == [[3], [10, 11, 12]]
    logged = list(range(10, 110, 10))
    assert select_steps(logged, None, 0) == logged
    assert select_steps(logged, None, 4) == [10, 40, 70, 100]
    assert select_steps(logged, None, 1) == [100]
    assert select_steps(logged, parse_steps("25-55,90"), 10) == [30, 40, 50, 90]


def test_viewer_reads_the_file_the_trainer_writes() -> None:
    from agile_llmenvs import _run_files as run_files
    from agile_llmenvs.training.grpo import loop
    from agile_llmenvs.viewer import records

    # one name, in one module: the GRPO loop writes the file the viewer reads
    assert loop.ROLLOUTS_FILE is run_files.ROLLOUTS_FILE
    assert records.ROLLOUTS_FILE is run_files.ROLLOUTS_FILE
