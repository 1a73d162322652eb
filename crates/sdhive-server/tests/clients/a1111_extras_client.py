#!/usr/bin/env python3
"""Drives a running sdhive worker (or hive) with `webuiapi` (PyPI, the A1111 client) through the A1111 routes
besides generation: HTTP Basic auth as `WebUIApi(username=..., password=...)` sends it, png_info, get_memory,
get_cmd_flags, the empty listings, get_prompt_styles, txt2img with styles, and the `samples_format` option (set
with set_options and per request in override_settings) with the infotext read back as A1111 reads it (piexif).
The server must have --api-auth USER:PASSWORD and the styles file of a1111_extras.rs (`film` and `tail`). Exits
non-zero on the first mismatch.

    python a1111_extras_client.py --base-url http://127.0.0.1:7860 --user alice --password pw
"""

import argparse
import json
import sys

import piexif
import piexif.helper
import requests
import webuiapi


def exif_infotext(image) -> str:
    """The infotext of a JPEG or WebP, as A1111's `read_info_from_image` reads it."""
    exif = piexif.load(image.info["exif"])
    return piexif.helper.UserComment.load(exif["Exif"][piexif.ExifIFD.UserComment])


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--base-url", required=True)
    parser.add_argument("--user", required=True)
    parser.add_argument("--password", required=True)
    args = parser.parse_args()
    host, port = args.base_url.removeprefix("http://").rsplit(":", 1)

    # Without credentials: a JSON 401 with a Basic challenge (what makes browsers and clients ask).
    r = requests.get(f"{args.base_url}/sdapi/v1/memory")
    assert r.status_code == 401 and "Basic" in r.headers.get("WWW-Authenticate", ""), (r.status_code, r.headers)
    assert "error" in r.json(), r.text

    api = webuiapi.WebUIApi(host=host, port=int(port), username=args.user, password=args.password)

    memory = api.get_memory()
    assert set(memory) == {"ram", "cuda"}, memory
    assert memory["ram"]["total"] >= memory["ram"]["used"] > 0, memory

    flags = api.get_cmd_flags()
    assert flags["api"] is True and flags["api_auth"] == "<redacted>", flags
    assert args.password not in json.dumps(flags), "the password leaked into cmd-flags"

    assert api.get_face_restorers() == []
    assert api.get_realesrgan_models() == []
    assert api.get_hypernetworks() == []
    assert api.get_scripts() == {"txt2img": [], "img2img": []}
    assert api.custom_get("sdapi/v1/script-info") == []
    assert api.custom_get("sdapi/v1/extensions") == []

    styles = api.get_prompt_styles()
    assert [s["name"] for s in styles] == ["film", "tail"], styles
    assert styles[0] == {"name": "film", "prompt": "{prompt}, film grain, 35mm", "negative_prompt": "cartoon"}

    result = api.txt2img(
        prompt="a cat", negative_prompt="blurry", styles=["film", "tail"], steps=2, width=8, height=8, seed=5
    )
    assert len(result.images) == 1, result.images
    assert result.info["prompt"] == "a cat, film grain, 35mm, masterpiece", result.info
    assert result.info["negative_prompt"] == "blurry, cartoon, lowres, bad hands", result.info
    assert result.info["styles"] == ["film", "tail"], result.info

    # png_info sends the PIL image back as a PNG with its text chunks.
    parsed = api.png_info(result.image)
    assert parsed.info == result.info["infotexts"][0], (parsed.info, result.info)
    p = parsed.parameters
    assert p["Prompt"] == "a cat" and p["Negative prompt"] == "blurry", p
    assert p["Styles array"] == ["film", "tail"], p
    assert (p["Steps"], p["Seed"], p["Size-1"], p["Size-2"]) == ("2", "5", "8", "8"), p

    # webuiapi raises RuntimeError(status, body) on anything but 200: an unknown style is a 400 naming `styles`.
    try:
        api.txt2img(prompt="a cat", styles=["flim"], steps=1, width=8, height=8)
        raise AssertionError("an unknown style was accepted")
    except RuntimeError as e:
        status, text = e.args
        assert status == 400 and json.loads(text)["field"] == "styles", (status, text)

    # samples_format: the images' format, from the options or a request's override_settings.
    options = api.get_options()
    assert (options["samples_format"], options["jpeg_quality"]) == ("png", 80), options
    api.set_options({"samples_format": "jpg", "jpeg_quality": 90})
    assert api.get_options()["samples_format"] == "jpg"
    fox = dict(prompt="a fox", steps=2, width=8, height=8, seed=9)
    result = api.txt2img(**fox)
    assert result.image.format == "JPEG", result.image.format
    assert result.image.size == (8, 8), result.image.size
    assert exif_infotext(result.image) == result.info["infotexts"][0], result.info
    result = api.txt2img(**fox, override_settings={"samples_format": "webp"})
    assert result.image.format == "WEBP", result.image.format
    assert exif_infotext(result.image) == result.info["infotexts"][0], result.info
    assert api.get_options()["samples_format"] == "jpg", "an override lasts its request"
    api.set_options({"samples_format": "png"})
    result = api.txt2img(**fox)
    assert result.image.format == "PNG" and result.image.info["parameters"] == result.info["infotexts"][0]
    # set_options returns the body whatever the status: check the status itself.
    auth = (args.user, args.password)
    r = requests.post(f"{args.base_url}/sdapi/v1/options", json={"samples_format": "gif"}, auth=auth)
    assert r.status_code == 400 and r.json()["field"] == "samples_format", r.text
    try:
        api.txt2img(**fox, override_settings={"samples_format": "bmp"})
        raise AssertionError("samples_format bmp was accepted")
    except RuntimeError as e:
        status, text = e.args
        assert status == 400 and json.loads(text)["field"] == "override_settings.samples_format", (status, text)

    print("webuiapi: auth, png_info, memory, cmd-flags, listings, styles, samples_format OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
