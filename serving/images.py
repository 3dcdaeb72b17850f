"""Images that arrive over gRPC -> the engine's image path (engine/vision/, docs/vision.md).

Both protocols carry an image as the bytes of an encoded file (PNG, JPEG, ...): jaxfill.v1
in GenerateRequest.images, vLLM's protocol as a `data:` URL in media_refs (what the smg
gateway forwards for an OpenAI `image_url` part when the worker processes media itself).
They are decoded here with Pillow, on the host, off the event loop, and handed to
RequestFactory.expand_images, the Python API's own placeholder expansion, so a request
served over gRPC is the same request as `Engine.generate({"prompt": ids, "images": [...]})`.
Whatever is refused here (no vision tower, bytes Pillow cannot read, a URL that is not
data:) is refused before the request is queued: it never holds a KV page.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import io

from jaxfill.engine.request import InvalidRequest
from jaxfill.engine.request_factory import NO_VISION_TOWER
from jaxfill.serving.request_core import BadField


def decode_image(data: bytes, field: str):
    """A PIL image, fully read (a truncated file fails here, not in the engine)."""
    try:
        from PIL import Image
    except ImportError:  # pragma: no cover - the `vision` extra
        raise BadField(field, "images need Pillow (the `vision` extra) on the server") from None
    if not data:
        raise BadField(field, "is empty (expected the bytes of an encoded image: PNG, JPEG, WebP, ...)")
    try:
        image = Image.open(io.BytesIO(data))
        image.load()
    except (OSError, ValueError, SyntaxError, EOFError, Image.DecompressionBombError) as e:
        raise BadField(field, f"undecodable image ({len(data)} bytes): {e}") from None
    return image


def data_url_bytes(url: str, field: str) -> bytes:
    """The payload of `data:<mime>;base64,<payload>` (jaxfill fetches nothing: http(s) and
    file URLs are refused; GetServerInfo advertises the data scheme only)."""
    head, sep, payload = url.partition(",")
    if not url.startswith("data:") or not sep:
        scheme = url.split(":", 1)[0] if ":" in url else url[:16]
        raise BadField(field, f"only data: URLs are read (jaxfill fetches no media), got a {scheme!r} URL")
    if not head.endswith(";base64"):
        raise BadField(field, "a data: URL must be base64 (data:<mime>;base64,<payload>)")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:
        raise BadField(field, f"bad base64 payload: {e}") from None


def marked(core, text: str, with_images: bool) -> str:
    """A text prompt with images as the model's processor writes it around each placeholder
    before tokenizing (Gemma 3's newlines; Qwen3-VL's: as is), so text over gRPC expands as
    in the Python API (RequestFactory._with_images)."""
    vision = core.engine.factory.vision
    return vision.mark_text(text) if with_images and text and vision is not None else text


async def expand(core, ids: list[int], blobs: list[bytes], field: str) -> list[int]:
    """`ids` (one image placeholder per blob, unexpanded) with the decoded images attached
    and their placeholders expanded (engine PromptIds). field: where the images sit in the
    message ("images", "media_refs.items"); errors name `field[i]` or `field`."""
    factory = core.engine.factory
    if factory.vision is None:
        raise BadField(field, NO_VISION_TOWER)  # before decoding anything

    def work():
        images = [decode_image(b, f"{field}[{i}]") for i, b in enumerate(blobs)]
        try:
            return factory.expand_images(ids, images)
        except InvalidRequest as e:
            raise BadField(field, str(e).split(": ", 1)[-1]) from None

    return await asyncio.get_running_loop().run_in_executor(None, work)
