"""Images on the OpenEnv wire: an env's ``info["images"]`` travel as the observation's
``images``, base64 PNGs, both ways (our server to OpenEnv's client, OpenEnv's server to ours),
pixel for pixel; an image that does not encode is an env error, and the server goes on."""

from __future__ import annotations

import asyncio
import base64
import io
import json
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from PIL import Image
from serving import UvicornApp
from websockets.sync.client import connect

from agile_llmenvs.errors import EnvExecutionError
from agile_llmenvs.transport import (
    EnvReply,
    InProcessEnvClient,
    OpenEnvServer,
    OpenEnvWrapper,
    RemoteEnvClient,
    TextAction,
    TextObservation,
)
from agile_llmenvs.transport._openenv import Action, Environment, Observation, State
from agile_llmenvs.transport.images import (
    ImageObservationError,
    decode_image,
    encode_image,
    reply_images,
)

#: 6 rows x 8 columns, every pixel its own (r, g, b): 0..143 in order.
PIXELS = np.arange(6 * 8 * 3, dtype=np.uint8).reshape(6, 8, 3)
#: 2 rows x 3 columns, counting down from 255.
OTHER_PIXELS = (255 - np.arange(2 * 3 * 3)).astype(np.uint8).reshape(2, 3, 3)
#: 4 x 4, for the single image a step shows (an array, as an env may hand one).
STEP_PIXELS = np.full((4, 4, 3), (10, 200, 30), dtype=np.uint8)
NOT_AN_IMAGE = b"not an image"
#: How every image error ends: what to send instead.
_HOW = (
    "send a PIL image, PNG or JPEG bytes, those bytes as base64 (or a data:image/...;base64, "
    "URL), or an H x W x 3 uint8 array"
)


def _png(pixels: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def _pixels(b64_png: str) -> np.ndarray:
    """A wire image's pixels, read with PIL alone (as any OpenEnv client would)."""
    with Image.open(io.BytesIO(base64.b64decode(b64_png))) as image:
        assert image.format == "PNG"
        return np.asarray(image.convert("RGB"))


class ImageEnv:
    """A text env that shows images: two on reset (a PIL image, PNG bytes), one array on each
    step; reset with ``bad=True`` or the action ``bad`` shows bytes that are no image."""

    def reset(self, *, seed: int | None = None, bad: bool = False, **task: Any) -> Any:
        second = NOT_AN_IMAGE if bad else _png(OTHER_PIXELS)
        return "look", {"images": [Image.fromarray(PIXELS), second], "level": 1}

    def step(self, action: str) -> Any:
        if action == "bad":
            return "broken", 0.0, False, False, {"images": [STEP_PIXELS, NOT_AN_IMAGE]}
        return f"saw {action}", 1.0, action == "stop", False, {"images": STEP_PIXELS, "turn": 1}


# -- our server, OpenEnv's client and ours -------------------------------------------------


def test_openenv_client_receives_our_images_as_base64_pngs_pixel_exact() -> None:
    from openenv.core import GenericEnvClient

    async def episode(url: str) -> list[Any]:
        async with GenericEnvClient(base_url=url) as client:
            return [await client.reset(seed=1), await client.step({"message": "a"})]

    with OpenEnvServer(make_env=ImageEnv, max_concurrent_envs=2) as server:
        reset, step = asyncio.run(episode(server.url))
    first, second = reset.observation["images"]
    assert np.array_equal(_pixels(first), PIXELS)
    assert np.array_equal(_pixels(second), OTHER_PIXELS)
    assert reset.observation["prompt"] == "look"
    assert reset.metadata == reset.observation["metadata"] == {"level": 1}
    [only] = step.observation["images"]  # a single value is one image
    assert np.array_equal(_pixels(only), STEP_PIXELS)
    assert step.metadata == {"turn": 1}


def test_the_wire_frame_of_an_image_reply_exactly() -> None:
    with (
        OpenEnvServer(make_env=ImageEnv, max_concurrent_envs=2) as server,
        connect(server.url.replace("http://", "ws://") + "/ws", compression=None) as ws,
    ):
        ws.send(json.dumps({"type": "reset", "data": {"seed": 1}}))
        frame = json.loads(ws.recv(timeout=10))
        ws.send(json.dumps({"type": "step", "data": {"message": "bad"}}))
        error = json.loads(ws.recv(timeout=10))
    assert error == {
        "type": "error",
        "data": {
            "message": "ImageObservationError: info['images'][1] could not be decoded (12 bytes "
            f"that are no image format PIL reads: cannot identify image file); {_HOW}",
            "code": "EXECUTION_ERROR",
            "error_type": "ImageObservationError",
        },
    }
    assert frame == {
        "type": "observation",
        "data": {
            "observation": {
                "metadata": {"level": 1},
                "prompt": "look",
                "truncated": False,
                "question": None,
                "answer": None,
                "images": [encode_image(PIXELS), encode_image(OTHER_PIXELS)],
            },
            "reward": None,
            "done": False,
            "metadata": {"level": 1},
        },
    }


def test_our_remote_client_gets_the_images_and_reply_images_decodes_them() -> None:
    with (
        OpenEnvServer(make_env=ImageEnv, max_concurrent_envs=2) as server,
        RemoteEnvClient(server.url, timeout_s=10) as client,
    ):
        reset, step = client.reset(seed=1), client.step("stop")
    assert reset.prompt == "look"  # the images list is no second text field
    assert reset.metadata == {"level": 1}
    decoded = [np.asarray(decode_image(v)) for v in reply_images(reset.observation, reset.metadata)]
    assert [d.tolist() for d in decoded] == [PIXELS.tolist(), OTHER_PIXELS.tolist()]
    [only] = reply_images(step.observation, step.metadata)
    assert np.array_equal(np.asarray(decode_image(only)), STEP_PIXELS)
    assert (step.reward, step.done, step.metadata) == (1.0, True, {"turn": 1})


def test_openenv_create_app_hosting_our_wrapper_sends_the_same_images() -> None:
    """The typed path (``reset`` / ``step`` as models, dumped by OpenEnv) encodes alike."""
    from openenv.core.env_server.http_server import create_app

    app = create_app(
        lambda: OpenEnvWrapper(ImageEnv(), owns_inner=True),
        TextAction,
        TextObservation,
        max_concurrent_envs=2,
    )
    with UvicornApp(app) as served, RemoteEnvClient(served.url, timeout_s=10) as client:
        reset, step = client.reset(seed=1), client.step("a")
    assert reset.observation["images"] == [encode_image(PIXELS), encode_image(OTHER_PIXELS)]
    assert step.observation["images"] == [encode_image(STEP_PIXELS)]
    assert (reset.metadata, step.metadata) == ({"level": 1}, {"turn": 1})


def test_a_text_env_frame_carries_no_images_field() -> None:
    from echo_envs import EchoEnv

    with OpenEnvServer(make_env=EchoEnv) as server, RemoteEnvClient(server.url) as client:
        reply = client.reset(seed=1)
    assert sorted(reply.observation) == ["answer", "prompt", "question", "truncated"]
    assert reply_images(reply.observation, reply.metadata) == []


def test_in_process_images_stay_in_info_as_the_env_gave_them() -> None:
    client = InProcessEnvClient(ImageEnv())
    reset, step = client.reset(seed=1), client.step("a")
    picture, png = reset.metadata["images"]
    assert isinstance(picture, Image.Image)
    assert png == _png(OTHER_PIXELS)
    assert isinstance(step.metadata["images"], np.ndarray)  # not jsonable's nested list
    assert "images" not in reset.observation
    decoded = [np.asarray(decode_image(v)) for v in reply_images(reset.observation, reset.metadata)]
    assert [d.tolist() for d in decoded] == [PIXELS.tolist(), OTHER_PIXELS.tolist()]
    [only] = reply_images(step.observation, step.metadata)
    assert np.array_equal(np.asarray(decode_image(only)), STEP_PIXELS)


# -- an image that does not encode ----------------------------------------------------------


def _bad_image_message(where: str) -> str:
    """The client's error for ``NOT_AN_IMAGE`` at ``where``, after the server's url."""
    return (
        f"ImageObservationError: {where} could not be decoded (12 bytes that are no image "
        f"format PIL reads: cannot identify image file); {_HOW} (raised as "
        "ImageObservationError in the env) [code EXECUTION_ERROR]"
    )


def test_an_image_that_does_not_encode_is_an_env_error_and_the_server_goes_on() -> None:
    with OpenEnvServer(make_env=ImageEnv, max_concurrent_envs=2) as server:
        with RemoteEnvClient(server.url, timeout_s=10) as client:
            client.reset(seed=1)
            with pytest.raises(EnvExecutionError) as step_error:
                client.step("bad")
            assert str(step_error.value) == f"{client.url}: " + _bad_image_message(
                "info['images'][1]"
            )
            assert step_error.value.code == "EXECUTION_ERROR"
            with pytest.raises(EnvExecutionError) as reset_error:
                client.reset(seed=2, bad=True)
            assert str(reset_error.value) == f"{client.url}: " + _bad_image_message(
                "info['images'][1]"
            )
            assert client.reset(seed=3).prompt == "look"  # the same session goes on
            assert client.step("a").prompt == "saw a"
        with RemoteEnvClient(server.url, timeout_s=10) as fresh:  # and so do new sessions
            assert fresh.reset(seed=4).metadata == {"level": 1}


# -- OpenEnv's server, our client -------------------------------------------------------


class LookAction(Action):
    message: str


class ImagesObservation(Observation):
    text: str
    images: list[str]


class ScreenshotObservation(Observation):
    text: str
    screenshot: str


class _NativeImageEnvironment(Environment):
    """An OpenEnv-native env, nothing of ours inside, showing images in its observation."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        super().__init__()
        self._state = State(episode_id=None, step_count=0)

    def step(self, action: LookAction, timeout_s: float | None = None, **kwargs: Any) -> Any:
        self._state.step_count += 1
        return self.reset()

    @property
    def state(self) -> State:
        return self._state


class ImagesEnvironment(_NativeImageEnvironment):
    def reset(self, seed: int | None = None, episode_id: str | None = None, **kw: Any) -> Any:
        images = [base64.b64encode(_png(p)).decode() for p in (PIXELS, OTHER_PIXELS)]
        return ImagesObservation(text="two pictures", images=images, metadata={"n": 2})


class ScreenshotEnvironment(_NativeImageEnvironment):
    def reset(self, seed: int | None = None, episode_id: str | None = None, **kw: Any) -> Any:
        screenshot = base64.b64encode(_png(PIXELS)).decode()
        return ScreenshotObservation(text="a screen", screenshot=screenshot)


@pytest.fixture
def native_servers() -> Iterator[dict[str, str]]:
    from openenv.core.env_server.http_server import create_app

    apps = {
        "images": create_app(ImagesEnvironment, LookAction, ImagesObservation),
        "screenshot": create_app(ScreenshotEnvironment, LookAction, ScreenshotObservation),
    }
    with UvicornApp(apps["images"]) as images, UvicornApp(apps["screenshot"]) as screenshot:
        yield {"images": images.url, "screenshot": screenshot.url}


def test_our_client_reads_an_openenv_env_images_field(native_servers: dict[str, str]) -> None:
    with RemoteEnvClient(native_servers["images"], timeout_s=10) as client:
        replies = [client.reset(seed=1), client.step("again")]
    for reply in replies:
        assert reply.prompt == "two pictures"
        assert reply.metadata == {"n": 2}
        decoded = [np.asarray(decode_image(v)) for v in reply_images(reply.observation, {})]
        assert [d.tolist() for d in decoded] == [PIXELS.tolist(), OTHER_PIXELS.tolist()]


def test_our_client_reads_an_openenv_env_named_image_field(
    native_servers: dict[str, str],
) -> None:
    with RemoteEnvClient(native_servers["screenshot"], timeout_s=10) as client:
        reply = client.reset(seed=1)
    assert reply_images(reply.observation, reply.metadata) == []  # not under its own name
    [screenshot] = reply_images(reply.observation, reply.metadata, field="screenshot")
    assert np.array_equal(np.asarray(decode_image(screenshot)), PIXELS)


# -- the image values themselves -----------------------------------------------------------


def test_decode_image_reads_every_form_to_the_same_rgb_pixels() -> None:
    png = _png(PIXELS)
    b64 = base64.b64encode(png).decode()
    forms = [
        Image.fromarray(PIXELS),
        Image.fromarray(PIXELS).convert("RGBA"),
        png,
        bytearray(png),
        b64,
        "data:image/png;base64," + b64,
        PIXELS,
    ]
    for form in forms:
        image = decode_image(form)
        assert image.mode == "RGB"
        assert np.array_equal(np.asarray(image), PIXELS), type(form)
    assert _pixels(encode_image(PIXELS)).tolist() == PIXELS.tolist()


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (
            "not base64!",
            "image 2 of 3 is a string that is not base64 (Only base64 data is allowed); " + _HOW,
        ),
        (
            NOT_AN_IMAGE,
            "image 2 of 3 could not be decoded (12 bytes that are no image format PIL reads: "
            "cannot identify image file); " + _HOW,
        ),
        (
            np.zeros((2, 2, 3), dtype=np.float64),
            "image 2 of 3 is an array of shape (2, 2, 3) and dtype float64, not H x W x 3 "
            "uint8; " + _HOW,
        ),
        (
            np.zeros((2, 2), dtype=np.uint8),
            "image 2 of 3 is an array of shape (2, 2) and dtype uint8, not H x W x 3 uint8; "
            + _HOW,
        ),
        (
            np.zeros((2, 2, 4), dtype=np.uint8),
            "image 2 of 3 is an array of shape (2, 2, 4) and dtype uint8, not H x W x 3 uint8; "
            + _HOW,
        ),
        ({"pixels": [1, 2, 3]}, "image 2 of 3 is a dict; " + _HOW),
        (3.5, "image 2 of 3 is a float; " + _HOW),
    ],
    ids=["bad-base64", "bytes-no-image", "float-array", "2d-array", "4-channel", "dict", "float"],
)
def test_decode_image_says_what_came_and_what_to_send(value: Any, message: str) -> None:
    with pytest.raises(ImageObservationError) as error:
        decode_image(value, where="image 2 of 3")
    assert str(error.value) == message
    with pytest.raises(ImageObservationError) as encoded:
        encode_image(value, where="image 2 of 3")
    assert str(encoded.value) == message


def test_an_image_error_is_a_value_error_of_the_library() -> None:
    from agile_llmenvs.errors import AgileLLMEnvsError

    assert issubclass(ImageObservationError, AgileLLMEnvsError)
    assert issubclass(ImageObservationError, ValueError)


def test_reply_images_finds_the_observation_images_then_info() -> None:
    picture = Image.fromarray(PIXELS)
    assert reply_images({"images": ["a", "b"]}, {"images": ["c"]}) == ["a", "b"]
    assert reply_images({"prompt": "x"}, {"images": [picture]}) == [picture]
    assert reply_images({"prompt": "x"}, {"images": picture}) == [picture]
    assert reply_images({"prompt": "x"}, {"images": PIXELS})[0] is PIXELS
    assert reply_images({"prompt": "x"}, {"images": b"raw"}) == [b"raw"]
    assert reply_images({"shot": "b64"}, {}, field="shot") == ["b64"]
    assert reply_images({"prompt": "x"}, {}) == []


def test_reply_images_names_the_fields_a_wrong_image_field_could_be() -> None:
    with pytest.raises(ImageObservationError) as error:
        reply_images({"prompt": "x", "images": []}, {}, field="screenshot")
    assert str(error.value) == (
        "image_field 'screenshot' is not in the observation; it has ['images', 'prompt']"
    )


def test_the_observation_schema_declares_images_as_base64_strings() -> None:
    schema = TextObservation.model_json_schema()["properties"]["images"]
    assert schema == {
        "description": "Images shown to the policy, each a base64 PNG.",
        "items": {"type": "string"},
        "title": "Images",
        "type": "array",
    }
    assert TextObservation().images == []


def test_the_prompt_of_a_structured_observation_ignores_its_images_list() -> None:
    reply = EnvReply(observation={"text": "a screen", "images": ["iVBORw0KGgo="], "step": 2})
    assert reply.prompt == "a screen"
