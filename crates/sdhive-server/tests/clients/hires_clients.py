#!/usr/bin/env python3
"""Drives a running sdhive worker's hires fix and upscalers with the clients people script it with: `webuiapi`
(PyPI, the A1111 client) and the official `openai` SDK. The Rust test (hires_e2e.rs) holds the images to the
goldens; this script makes the calls exactly as the clients make them, asserts what the clients parse, and writes
into --dir:

    webuiapi-upscalers.json, webuiapi-latent-modes.json   get_upscalers() / get_latent_upscale_modes()
    webuiapi-hires.png, webuiapi-hires-info.json          txt2img(enable_hr=True, hr_upscaler="Latent", ...)
    webuiapi-extras.png                                   extra_single_image(upscaler_1="esrgan_x4_new", x2)
    webuiapi-batch-0.png, webuiapi-batch-1.png            extra_batch_images (Lanczos to 60x50, crop)
    openai-hires.png                                      images.generate with extra_body={"hires": {...}}

    python hires_clients.py --base-url http://127.0.0.1:7860 --dir /tmp/client
"""

import argparse
import base64
import io
import json
import os

import openai
import webuiapi
from PIL import Image

PROMPT = "a photo of an astronaut riding a horse"
FIXTURES = os.path.join(os.path.dirname(__file__), "..", "..", "..", "..", "tests", "fixtures")


def webuiapi_calls(base: str, out: str) -> None:
    host, port = base.removeprefix("http://").rsplit(":", 1)
    api = webuiapi.WebUIApi(host=host, port=int(port))

    upscalers = api.get_upscalers()
    names = [u["name"] for u in upscalers]
    assert names[:3] == ["None", "Lanczos", "Nearest"], names
    with open(os.path.join(out, "webuiapi-upscalers.json"), "w") as f:
        json.dump(upscalers, f)
    with open(os.path.join(out, "webuiapi-latent-modes.json"), "w") as f:
        json.dump(api.get_latent_upscale_modes(), f)

    # The golden case `latent` of tests/fixtures/golden/hires.json.
    result = api.txt2img(
        prompt=PROMPT, negative_prompt="", sampler_name="Euler", steps=8, cfg_scale=7.5, seed=42, width=64,
        height=64, enable_hr=True, hr_upscaler=webuiapi.HiResUpscaler.Latent, hr_scale=2,
        denoising_strength=0.6, hr_second_pass_steps=0,
    )
    assert result.image.size == (128, 128), result.image.size
    assert isinstance(result.info, dict), result.info
    result.image.save(os.path.join(out, "webuiapi-hires.png"))
    with open(os.path.join(out, "webuiapi-hires-info.json"), "w") as f:
        json.dump(result.info, f)

    source = Image.open(os.path.join(FIXTURES, "upscalers", "input.png")).convert("RGB")
    extras = api.extra_single_image(image=source, upscaler_1="esrgan_x4_new", upscaling_resize=2)
    extras.image.save(os.path.join(out, "webuiapi-extras.png"))

    batch = api.extra_batch_images(
        images=[source, source], resize_mode=1, upscaling_resize_w=60, upscaling_resize_h=50, upscaling_crop=True,
        upscaler_1="Lanczos",
    )
    assert len(batch.images) == 2, batch.images
    for i, image in enumerate(batch.images):
        assert image.size == (60, 50), image.size
        image.save(os.path.join(out, f"webuiapi-batch-{i}.png"))


def openai_calls(base: str, out: str) -> None:
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused")
    got = client.images.generate(
        model="dall-e-3", prompt=PROMPT, size="64x64", response_format="b64_json",
        extra_body={"steps": 8, "cfg_scale": 7.5, "seed": 42, "sampler": "Euler",
                    "hires": {"upscaler": "Latent", "scale": 2, "denoising_strength": 0.6}},
    )
    image = Image.open(io.BytesIO(base64.b64decode(got.data[0].b64_json)))
    assert image.size == (128, 128), image.size
    image.save(os.path.join(out, "openai-hires.png"))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--base-url", required=True)
    parser.add_argument("--dir", required=True)
    args = parser.parse_args()
    webuiapi_calls(args.base_url, args.dir)
    openai_calls(args.base_url, args.dir)


if __name__ == "__main__":
    main()
