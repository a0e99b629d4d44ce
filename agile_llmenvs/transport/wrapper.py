"""Adapt a plain-text env (:class:`~agile_llmenvs.core.TextEnv`) to OpenEnv's typed ABC."""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from agile_llmenvs.transport._openenv import Environment, EnvironmentMetadata
from agile_llmenvs.transport.images import IMAGES_FIELD, encode_image, image_values
from agile_llmenvs.transport.protocol import text_observation_frame
from agile_llmenvs.transport.types import TextAction, TextObservation, TextState

if TYPE_CHECKING:
    from agile_llmenvs.core.contract import TextEnv

__all__ = ["OpenEnvWrapper", "jsonable"]


_PLAIN = frozenset({str, int, bool, type(None)})


def jsonable(value: Any) -> Any:
    """``value`` with numpy scalars/arrays, tuples and sets turned into JSON types.

    A non-finite float (NaN, infinity) is kept as it is, not made a string: the reply paths
    (:func:`~agile_llmenvs.transport.protocol.refuse_non_finite`) fail the call, naming it.
    """
    if type(value) in _PLAIN:  # the common case, first: this runs on every env reply
        return value
    if isinstance(value, Mapping):  # an env's info: its plain values copied without a call
        return {str(k): v if type(v) in _PLAIN else jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        return [jsonable(v) for v in value]
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    # a non-finite float stays a float: every reply path then refuses it, naming its field
    return value


class OpenEnvWrapper(Environment):
    """Adapt a plain-text env to OpenEnv's typed ``Environment`` ABC.

    Translates between the env's string ``reset``/``step`` and OpenEnv's typed action,
    observation and state: env ``info`` travels in observation metadata, but for its images
    (``info["images"]``), which become the observation's ``images`` as base64 PNGs;
    ``dataset_size``, ``tools`` and ``max_turns`` surface on the state, and on the terminal
    step the ``question`` / ``answer`` the env put in ``info`` are set on the observation so
    rubrics can score.

    Args:
        inner: The local text env to host.
        env_name: Name in the OpenEnv metadata; defaults to ``inner``'s class name.
        owns_inner: If True, :meth:`close` closes ``inner`` (the per-session path).
    """

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self, inner: TextEnv, *, env_name: str | None = None, owns_inner: bool = False):
        super().__init__()
        self.inner = inner
        self.env_name = env_name or type(inner).__name__
        self.owns_inner = owns_inner
        self._episode_id: str | None = None
        self._steps = 0  # a plain int: a pydantic field assignment per step costs ~2 µs
        self._closed = False

    def reset(
        self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any
    ) -> TextObservation:
        """Start an episode of the inner env; reset kwargs are the task (e.g. ``row_index``).

        Raises:
            ImageObservationError: an image in ``info["images"]`` does not encode.
        """
        fields = _on_the_wire(self.reset_fields(seed, episode_id, **kwargs))
        return TextObservation.model_construct(**fields)

    def reset_fields(
        self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any
    ) -> dict[str, Any]:
        """:meth:`reset`, as the observation's fields without the model: JSON values, but for
        ``info["images"]``, left in the metadata as the env gave them (see :meth:`step_fields`)."""
        prompt, info = self.inner.reset(seed=seed, **_accepted(self.inner.reset, kwargs))
        self._episode_id, self._steps = episode_id, 0
        return {"prompt": str(prompt), "metadata": _metadata(info)}

    def step(
        self, action: TextAction, timeout_s: float | None = None, **kwargs: Any
    ) -> TextObservation:
        """Send the action's text to the inner env and type its 5-tuple as an observation.

        Raises:
            ImageObservationError: an image in ``info["images"]`` does not encode.
        """
        # every field is coerced already, so skip re-validating it: this is the hot path
        return TextObservation.model_construct(**_on_the_wire(self.step_fields(action.message)))

    def takes_text_directly(self) -> bool:
        """Whether :meth:`step_fields` / :meth:`step_frame` are this env's steps: true unless
        a subclass overrides ``step`` or ``step_async``."""
        cls = type(self)
        return cls.step is OpenEnvWrapper.step and cls.step_async is OpenEnvWrapper.step_async

    def step_frame(self, text: str) -> str:
        """:meth:`step` with ``text``, as its ``observation`` reply frame.

        The same bytes as ``observation_frame(step(TextAction(message=text)))``, without
        building either model: the server's path for a plain ``{"message": ...}`` step.

        Raises:
            ImageObservationError: an image in ``info["images"]`` does not encode.
        """
        return text_observation_frame(**_on_the_wire(self.step_fields(text)))

    def step_fields(self, text: str) -> dict[str, Any]:
        """:meth:`step` with ``text``, as the observation's fields without the action or
        observation model (the hot paths of the server and the in-process client).

        The fields are JSON values, but for ``info["images"]``: they stay in the metadata as
        the env gave them, which is how the in-process client hands them on; the wire's forms
        (:meth:`step`, :meth:`step_frame`) encode them into the observation's ``images``.
        """
        prompt, reward, terminated, truncated, info = self.inner.step(text)
        self._steps += 1
        done = bool(terminated or truncated)
        info = _metadata(info)
        return {
            "prompt": str(prompt),
            "reward": float(reward),
            "done": done,
            "truncated": bool(truncated),
            "question": info.get("question") if done else None,
            "answer": info.get("answer") if done else None,
            "metadata": info,
        }

    @property
    def state(self) -> TextState:
        """Episode id and step count, plus what the inner env declares about itself."""
        inner = self.inner
        rubric = getattr(inner, "rubric", None)
        scores = None
        if rubric is not None and hasattr(rubric, "named_rubrics"):
            scores = {name: r.last_score for name, r in rubric.named_rubrics()}
        tools = getattr(inner, "tools", None)
        return TextState(
            episode_id=self._episode_id,
            step_count=self._steps,
            dataset_size=getattr(inner, "dataset_size", None),
            tools=jsonable(list(tools)) if tools is not None else None,
            max_turns=getattr(inner, "max_turns", None),
            rubric_components=scores,
        )

    def get_metadata(self) -> Any:
        """OpenEnv metadata naming the env."""
        return EnvironmentMetadata(
            name=self.env_name, description=(type(self.inner).__doc__ or "").strip()[:200]
        )

    def close(self) -> None:
        """Close the inner env if this wrapper owns it; idempotent."""
        if self.owns_inner and not self._closed:
            self._closed = True
            close = getattr(self.inner, "close", None)  # some registries' envs have none
            if callable(close):
                close()


def _metadata(info: Mapping[str, Any] | None) -> dict[str, Any]:
    """``info`` as JSON values, but for its images, kept as they are: a numpy image made a
    nested list would be no image any more."""
    if not info:
        return {}
    if IMAGES_FIELD not in info:
        return jsonable(info)
    return {str(k): v if k == IMAGES_FIELD else jsonable(v) for k, v in info.items()}


def _on_the_wire(fields: dict[str, Any]) -> dict[str, Any]:
    """``fields`` as the wire carries them: the metadata's images moved into ``images``, each
    a base64 PNG (a single image value counts as one).

    Raises:
        ImageObservationError: an image does not encode; the message names which.
    """
    metadata = fields["metadata"]
    if IMAGES_FIELD not in metadata:
        return fields
    raw = metadata[IMAGES_FIELD]
    values = image_values(raw)
    single = len(values) == 1 and values[0] is raw
    fields["images"] = [
        encode_image(value, where="info['images']" if single else f"info['images'][{i}]")
        for i, value in enumerate(values)
    ]
    fields["metadata"] = {k: v for k, v in metadata.items() if k != IMAGES_FIELD}
    return fields


def accepted_reset_kwargs(env: TextEnv, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The reset kwargs ``env.reset`` takes, which are what :class:`OpenEnvWrapper` passes it
    (the others are dropped)."""
    return _accepted(env.reset, kwargs)


def _accepted(method: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The kwargs ``method`` can take: OpenEnv drops unknown reset kwargs, and so do we (a
    collector's ``row_index`` reaching a procedural env that takes only ``seed``)."""
    if not kwargs:
        return kwargs
    names = _RESET_NAMES.get(method.__func__) if hasattr(method, "__func__") else None
    if names is None:
        params = inspect.signature(method).parameters
        takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
        names = None if takes_any else frozenset(params)
        if hasattr(method, "__func__"):
            _RESET_NAMES[method.__func__] = names if names is not None else _ANY
    if names is None or names is _ANY:
        return kwargs
    return {k: v for k, v in kwargs.items() if k in names}


_ANY: frozenset[str] = frozenset({"**"})
_RESET_NAMES: dict[Any, frozenset[str]] = {}  # per reset function: the kwargs it takes
