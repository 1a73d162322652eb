#!/usr/bin/env python3
"""Drives a running sdhive worker the way AUTOMATIC1111 API clients do: plain HTTP (stdlib urllib only),
base64 images, and `json.loads(response["info"])`.

Writes the decoded images to --dir (txt2img-0.png, txt2img-1.png, img2img-0.png) so the Rust test can compare
them with the engine's own output. --dir must hold init.png.

    python a1111_client.py --base-url http://127.0.0.1:7860 --dir /tmp/client
"""

import argparse
import base64
import json
import os
import struct
import sys
import urllib.error
import urllib.request


def call(base: str, method: str, path: str, body=None):
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(base + path, data=data, method=method)
    request.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(request, timeout=300) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def png_size(data: bytes) -> tuple:
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    return struct.unpack(">II", data[16:24])


def save_images(result: dict, directory: str, stem: str, count: int) -> None:
    assert len(result["images"]) == count, len(result["images"])
    for i, b64 in enumerate(result["images"]):
        data = base64.b64decode(b64)
        assert png_size(data) == (64, 64), png_size(data)
        with open(os.path.join(directory, f"{stem}-{i}.png"), "wb") as f:
            f.write(data)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--base-url", required=True)
    parser.add_argument("--dir", required=True)
    args = parser.parse_args()
    base = args.base_url.rstrip("/")

    status, models = call(base, "GET", "/sdapi/v1/sd-models")
    assert status == 200 and models and models[0]["title"], models
    status, options = call(base, "GET", "/sdapi/v1/options")
    assert status == 200 and options["sd_model_checkpoint"] == models[0]["title"], options
    status, samplers = call(base, "GET", "/sdapi/v1/samplers")
    assert "Euler a" in [s["name"] for s in samplers], samplers
    status, schedulers = call(base, "GET", "/sdapi/v1/schedulers")
    assert [s["name"] for s in schedulers] == ["automatic", "karras"], schedulers
    status, _ = call(base, "POST", "/sdapi/v1/options", {"sd_model_checkpoint": models[0]["title"]})
    assert status == 200, status

    status, result = call(
        base,
        "POST",
        "/sdapi/v1/txt2img",
        {
            "prompt": "a lighthouse at dusk",
            "steps": 4,
            "seed": 1234,
            "width": 64,
            "height": 64,
            "batch_size": 2,
            "sampler_name": "Euler a",
            "cfg_scale": 7,
        },
    )
    assert status == 200, result
    info = json.loads(result["info"])
    assert info["all_seeds"] == [1234, 1235], info
    assert info["seed"] == 1234 and info["sampler_name"] == "Euler a", info
    assert len(info["infotexts"]) == 2 and "Seed: 1235" in info["infotexts"][1], info
    assert result["parameters"]["prompt"] == "a lighthouse at dusk", result["parameters"]
    save_images(result, args.dir, "txt2img", 2)

    with open(os.path.join(args.dir, "init.png"), "rb") as f:
        init = "data:image/png;base64," + base64.b64encode(f.read()).decode()
    status, result = call(
        base,
        "POST",
        "/sdapi/v1/img2img",
        {
            "init_images": [init],
            "prompt": "a lighthouse at dawn",
            "steps": 4,
            "seed": 99,
            "denoising_strength": 0.6,
            "sampler_name": "Euler",
        },
    )
    assert status == 200, result
    info = json.loads(result["info"])
    assert info["denoising_strength"] == 0.6 and info["all_seeds"] == [99], info
    save_images(result, args.dir, "img2img", 1)

    status, error = call(base, "POST", "/sdapi/v1/txt2img", {"prompt": "x", "width": 100})
    assert status == 400 and error["field"] == "width" and error["detail"], error

    status, progress = call(base, "GET", "/sdapi/v1/progress")
    assert status == 200 and 0.0 <= progress["progress"] <= 1.0 and "state" in progress, progress
    status, _ = call(base, "POST", "/sdapi/v1/interrupt", {})
    assert status == 200, status

    print("A1111 client: listings, txt2img, img2img, errors, progress and interrupt OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
