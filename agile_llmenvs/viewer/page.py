"""The HTML page of a run's logged episodes: one self-contained file, nothing fetched.

Each episode's transcript is coloured by where its ids came from (prompt, sampled by the
policy, inserted by the env), with each turn's reward after that turn's completion; a reward
curve drawn as inline SVG links its marked steps to their episodes. There is no script: the
page is HTML and inline CSS, every text is escaped, and a Content-Security-Policy forbids
scripts and any fetch, so a completion that holds markup shows as text.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from html import escape

from agile_llmenvs.viewer.records import EpisodeRecord, RewardPoint, SampleRecord

__all__ = ["RunPage", "render_page"]

_SOURCES = ("prompt", "sampled", "env")
_SOURCE_HELP = {
    "prompt": "the task's prompt, before the first sampled token",
    "sampled": "sampled by the policy (what GRPO trains on)",
    "env": "inserted by the env or the chat template",
}

_CSP = "default-src 'none'; style-src 'unsafe-inline'; img-src data:"

_STYLE = """
body { font: 14px/1.45 system-ui, "DejaVu Sans", sans-serif; margin: 24px; color: #1d2327;
       background: #fafafa; max-width: 1120px; }
h1 { font-size: 20px; margin: 0 0 4px; } h2 { font-size: 16px; margin: 28px 0 8px; }
code, pre { font-family: ui-monospace, "DejaVu Sans Mono", monospace; font-size: 12.5px; }
.summary { color: #50575e; margin: 0 0 12px; }
.legend { display: flex; gap: 16px; flex-wrap: wrap; margin: 8px 0 16px; }
.legend span.tok, .legend span.turn-reward { padding: 1px 8px; }
.tok.prompt { background: #e8eaed; color: #3c4043; }
.tok.sampled { background: #c9f0cf; color: #0b4f1c; border-bottom: 2px solid #2e9b4a; }
.tok.env { background: #d6e6fb; color: #0b3d91; border-bottom: 2px dotted #3f7fd9; }
.turn-reward { background: #fff2c4; color: #5c4400; border: 1px solid #d9b44a;
               border-radius: 9px; padding: 0 6px; margin: 0 3px; font-weight: 600; }
.curve-box { background: #fff; border: 1px solid #dcdcde; border-radius: 6px; padding: 8px;
             display: inline-block; }
.curve-box svg text { font-size: 11px; fill: #50575e; }
nav.steps a { margin-right: 8px; }
.episode { background: #fff; border: 1px solid #dcdcde; border-radius: 6px; margin: 10px 0;
           padding: 8px 12px; }
.episode header { display: flex; gap: 14px; flex-wrap: wrap; align-items: baseline; }
.episode .reward { font-weight: 600; }
.stop { border-radius: 4px; padding: 0 6px; background: #eef0f2; }
.stop.env_error, .stop.aborted { background: #fde2e1; color: #8a1f11; }
.turns { color: #50575e; }
pre.transcript { white-space: pre-wrap; word-break: break-word; margin: 8px 0 4px;
                 line-height: 1.6; }
.segment-label { color: #50575e; font-size: 12px; margin-top: 6px; }
.error { color: #8a1f11; }
"""


@dataclass(frozen=True)
class RunPage:
    """What one page shows.

    Attributes:
        title: The run's name (its folder).
        episodes: The episodes of the shown steps, in step order.
        logged_steps: Every step the log has episodes of.
        curve: The run's reward curve (empty: no metrics file).
        sources: The file names the page was made from, for its footer line.
    """

    title: str
    episodes: Sequence[EpisodeRecord]
    logged_steps: Sequence[int]
    curve: Sequence[RewardPoint]
    sources: Sequence[str] = ()


def render_page(page: RunPage) -> str:
    """The page as one HTML document."""
    steps = sorted({episode.step for episode in page.episodes})
    body = [
        f"<h1>Rollouts of <code>{escape(page.title)}</code></h1>",
        f'<p class="summary">{_summary(page, steps)}</p>',
        _legend(),
        _curve_box(page.curve, steps),
        '<nav class="steps">steps shown: '
        + " ".join(f'<a href="#step-{step}">{step}</a>' for step in steps)
        + "</nav>",
    ]
    for step in steps:
        episodes = [episode for episode in page.episodes if episode.step == step]
        body.append(_step_section(step, episodes, page.curve))
    return (
        "<!DOCTYPE html>\n"
        '<html lang="en"><head><meta charset="utf-8">'
        f'<meta http-equiv="Content-Security-Policy" content="{_CSP}">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>rollouts: {escape(page.title)}</title><style>{_STYLE}</style></head>\n"
        "<body>\n" + "\n".join(body) + "\n</body></html>\n"
    )


def _summary(page: RunPage, steps: Sequence[int]) -> str:
    logged = sorted(set(page.logged_steps))
    text = (
        f"{_count(len(page.episodes), 'episode')} from {len(steps)} of "
        f"{_count(len(logged), 'logged step')} "
        f"(logged: steps {logged[0]}-{logged[-1]})"
        if logged
        else "no episodes"
    )
    if page.sources:
        text += " · from " + ", ".join(f"<code>{escape(name)}</code>" for name in page.sources)
    return text


def _legend() -> str:
    items = [
        f'<span><span class="tok {source}">{source}</span> {escape(_SOURCE_HELP[source])}</span>'
        for source in _SOURCES
    ]
    items.append('<span><span class="turn-reward">turn 0: +1.000</span> a turn\'s reward</span>')
    return '<div class="legend">' + "".join(items) + "</div>"


def _step_section(
    step: int, episodes: Sequence[EpisodeRecord], curve: Sequence[RewardPoint]
) -> str:
    point = next((p for p in curve if p.step == step), None)
    mean = f" · batch reward_mean {point.reward_mean:.3f}" if point is not None else ""
    articles = "\n".join(_episode(episode, index) for index, episode in enumerate(episodes))
    return (
        f'<section class="step" id="step-{step}" data-step="{step}">'
        f"<h2>step {step}{mean}</h2>\n{articles}</section>"
    )


def _episode(episode: EpisodeRecord, index: int) -> str:
    task = ""
    if episode.task is not None:
        task = f"seed {episode.task.seed}"
        if episode.task.row_index is not None:
            task += f" · row {episode.task.row_index}"
    turn_rewards = ", ".join(f"{reward:+.3f}" for reward in episode.rewards) or "none"
    header = (
        f'<span class="which">episode {index} · group {episode.group} · slot {episode.slot}'
        f"{' · ' + task if task else ''}</span>"
        f'<span class="reward">reward {episode.reward:.3f}</span>'
        f'<span class="stop {escape(episode.stop_reason)}">{escape(episode.stop_reason)}</span>'
        f'<span class="turns">{_count(len(episode.rewards), "turn")}; per-turn rewards: '
        f"{turn_rewards}</span>"
    )
    parts = [f"<header>{header}</header>"]
    if episode.error is not None:
        parts.append(f'<p class="error">env error: {escape(episode.error)}</p>')
    badges = _badge_places(episode.samples)
    for number, sample in enumerate(episode.samples):
        if len(episode.samples) > 1:
            label = f"segment {number + 1} of {len(episode.samples)}"
            parts.append(f'<div class="segment-label">{label} (the context started over)</div>')
        parts.append(_transcript(sample, number, badges, episode.rewards))
    return (
        f'<article class="episode" data-step="{episode.step}" data-reward="{episode.reward}">'
        + "".join(parts)
        + "</article>"
    )


def _count(number: int, noun: str) -> str:
    return f"{number} {noun}" + ("" if number == 1 else "s")


def _badge_places(samples: Sequence[SampleRecord]) -> dict[tuple[int, int], int]:
    """Where each turn's reward goes: after the last sampled span of that turn, as
    ``(sample, span) -> turn``."""
    last: dict[int, tuple[int, int]] = {}
    for number, sample in enumerate(samples):
        for index, span in enumerate(sample.spans):
            if span.source == "sampled" and span.turn >= 0:
                last[span.turn] = (number, index)
    return {place: turn for turn, place in last.items()}


def _transcript(
    sample: SampleRecord,
    number: int,
    badges: dict[tuple[int, int], int],
    rewards: Sequence[float],
) -> str:
    pieces = []
    for index, span in enumerate(sample.spans):
        turn = f" turn {span.turn}" if span.turn >= 0 else ""
        pieces.append(
            f'<span class="tok {span.source}" data-turn="{span.turn}" '
            f'title="{span.source}{turn}">{escape(span.text)}</span>'
        )
        turn_index = badges.get((number, index))
        if turn_index is not None and turn_index < len(rewards):
            pieces.append(
                f'<span class="turn-reward" data-turn="{turn_index}">'
                f"turn {turn_index}: {rewards[turn_index]:+.3f}</span>"
            )
    return f'<pre class="transcript">{"".join(pieces)}</pre>'


def _curve_box(curve: Sequence[RewardPoint], shown: Sequence[int]) -> str:
    if not curve:
        return '<p class="summary">no reward curve: the run folder has no metrics.csv rows</p>'
    return f'<div class="curve-box">{_curve_svg(curve, shown)}</div>'


def _curve_svg(curve: Sequence[RewardPoint], shown: Sequence[int]) -> str:
    """``reward_mean`` per step (and ``eval_reward_mean`` where present) as an SVG chart;
    the shown steps are marked and link to their episodes."""
    width, height, left, right, top, bottom = 760, 220, 52, 14, 14, 30
    evals = [(p.step, p.eval_reward_mean) for p in curve if not math.isnan(p.eval_reward_mean)]
    values = [p.reward_mean for p in curve] + [value for _, value in evals]
    steps = [p.step for p in curve]
    x_low, x_high = min(steps), max(steps)
    y_low, y_high = min(values), max(values)
    if x_low == x_high:
        x_low, x_high = x_low - 1, x_high + 1
    if y_low == y_high:
        y_low, y_high = y_low - 0.5, y_high + 0.5

    def x(step: float) -> float:
        return left + (step - x_low) / (x_high - x_low) * (width - left - right)

    def y(value: float) -> float:
        return top + (y_high - value) / (y_high - y_low) * (height - top - bottom)

    def path(points: Sequence[tuple[int, float]]) -> str:
        return " ".join(
            f"{'M' if i == 0 else 'L'}{x(s):.1f},{y(v):.1f}" for i, (s, v) in enumerate(points)
        )

    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" role="img" aria-label="reward curve">',
        f'<line x1="{left}" y1="{height - bottom}" x2="{width - right}" y2="{height - bottom}" '
        'stroke="#8c8f94"/>',
        f'<line x1="{left}" y1="{top}" x2="{left}" y2="{height - bottom}" stroke="#8c8f94"/>',
        f'<text x="{left - 6}" y="{y(y_high) + 4:.1f}" text-anchor="end">{y_high:.3g}</text>',
        f'<text x="{left - 6}" y="{y(y_low) + 4:.1f}" text-anchor="end">{y_low:.3g}</text>',
        f'<text x="{left}" y="{height - 10}" text-anchor="start">step {x_low}</text>',
        f'<text x="{width - right}" y="{height - 10}" text-anchor="end">step {x_high}</text>',
        f'<text x="{width / 2:.0f}" y="{height - 10}" text-anchor="middle">reward_mean'
        f"{' (and eval_reward_mean, dashed)' if evals else ''}</text>",
        f'<path id="reward-curve" d="{path([(p.step, p.reward_mean) for p in curve])}" '
        'fill="none" stroke="#2e9b4a" stroke-width="1.6"/>',
    ]
    if evals:
        parts.append(
            f'<path id="eval-curve" d="{path(evals)}" fill="none" stroke="#3f7fd9" '
            'stroke-width="1.4" stroke-dasharray="5 3"/>'
        )
    by_step = {p.step: p.reward_mean for p in curve}
    for step in shown:
        if step in by_step:
            value = by_step[step]
            parts.append(
                f'<a href="#step-{step}"><circle class="shown-step" cx="{x(step):.1f}" '
                f'cy="{y(value):.1f}" r="4" fill="#fff" stroke="#0b4f1c" stroke-width="1.6">'
                f"<title>step {step}: reward_mean {value:.3f}</title></circle></a>"
            )
    parts.append("</svg>")
    return "".join(parts)
