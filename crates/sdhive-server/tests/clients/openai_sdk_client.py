#!/usr/bin/env python3
"""Drives a running sdhive worker with the official `openai` Python SDK, as an OpenAI user would.

Checks the shapes the SDK parses (models list, images response, typed errors) and writes the decoded images
to --dir (generated-0.png, edited-0.png, and generated-0.webp from `output_format="webp"`) so the Rust test can
compare them with the engine's own output.
--dir must hold init.png and mask.png (RGBA; transparent = edit). The key comes from OPENAI_API_KEY.

    python openai_sdk_client.py --base-url http://127.0.0.1:7860/v1 --dir /tmp/client
"""

import argparse
import base64
import os
import struct
import sys

import openai


def png_size(data: bytes) -> tuple[int, int]:
    """Width and height from the IHDR chunk, without needing Pillow."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    assert data[12:16] == b"IHDR", "PNG without a leading IHDR chunk"
    return struct.unpack(">II", data[16:24])


def save_b64_image(response, directory: str, stem: str, size: tuple[int, int]) -> None:
    assert isinstance(response.created, int) and response.created > 1_600_000_000, response.created
    assert response.data and len(response.data) == 1, response.data
    item = response.data[0]
    assert item.url is None, item
    data = base64.b64decode(item.b64_json)
    assert png_size(data) == size, png_size(data)
    with open(os.path.join(directory, f"{stem}-0.png"), "wb") as f:
        f.write(data)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--base-url", required=True)
    parser.add_argument("--dir", required=True)
    args = parser.parse_args()

    client = openai.OpenAI(base_url=args.base_url, max_retries=0, timeout=300)

    models = client.models.list()
    ids = [m.id for m in models.data]
    assert ids, "no models listed"
    assert all(m.object == "model" and isinstance(m.created, int) and m.owned_by for m in models.data), models
    model = ids[0]
    assert client.models.retrieve(model).id == model

    generated = client.images.generate(
        model=model,
        prompt="a watercolor lighthouse",
        size="64x64",
        response_format="b64_json",
        extra_body={"steps": 4, "seed": 42},
    )
    save_b64_image(generated, args.dir, "generated", (64, 64))

    # gpt-image-1's output_format / output_compression, as the SDK sends them.
    webp = client.images.generate(
        model=model,
        prompt="a watercolor lighthouse",
        size="64x64",
        output_format="webp",
        extra_body={"steps": 4, "seed": 42},
    )
    assert webp.output_format == "webp", webp.output_format
    data = base64.b64decode(webp.data[0].b64_json)
    assert data[:4] == b"RIFF" and data[8:12] == b"WEBP", data[:16]
    with open(os.path.join(args.dir, "generated-0.webp"), "wb") as f:
        f.write(data)
    jpeg = client.images.generate(
        model=model,
        prompt="a watercolor lighthouse",
        size="64x64",
        output_format="jpeg",
        output_compression=60,
        extra_body={"steps": 1, "seed": 42},
    )
    assert jpeg.output_format == "jpeg" and base64.b64decode(jpeg.data[0].b64_json)[:2] == b"\xff\xd8", jpeg

    with open(os.path.join(args.dir, "init.png"), "rb") as image, open(
        os.path.join(args.dir, "mask.png"), "rb"
    ) as mask:
        edited = client.images.edit(
            model=model,
            image=image,
            mask=mask,
            prompt="a cat in the window",
            size="64x64",
            response_format="b64_json",
            extra_body={"steps": 4, "seed": 7},
        )
    save_b64_image(edited, args.dir, "edited", (64, 64))

    by_url = client.images.generate(
        prompt="a watercolor lighthouse", size="64x64", response_format="url", extra_body={"steps": 1}
    )
    url = by_url.data[0].url
    assert url and url.startswith(args.base_url.rsplit("/v1", 1)[0]), url

    # Typed errors: a 400 names the parameter, a wrong key is an AuthenticationError.
    try:
        client.images.generate(prompt="x", size="100x7")
        raise AssertionError("size 100x7 was accepted")
    except openai.BadRequestError as e:
        assert e.status_code == 400 and e.body["param"] == "size", e.body
    try:
        client.images.generate(prompt="x", n=0, extra_body={"steps": 1})
        raise AssertionError("n=0 was accepted")
    except openai.BadRequestError as e:
        assert e.body["param"] == "n", e.body
    try:
        client.images.generate(prompt="x", output_format="gif", extra_body={"steps": 1})
        raise AssertionError("output_format gif was accepted")
    except openai.BadRequestError as e:
        assert e.body["param"] == "output_format", e.body
    wrong = openai.OpenAI(base_url=args.base_url, api_key="not-the-key", max_retries=0)
    try:
        wrong.models.list()
        raise AssertionError("a wrong API key was accepted")
    except openai.AuthenticationError as e:
        assert e.status_code == 401, e

    print(f"openai {openai.__version__}: models {ids}, generate (png, webp, jpeg), edit, url and errors OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
