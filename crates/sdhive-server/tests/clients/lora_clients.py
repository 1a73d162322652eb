#!/usr/bin/env python3
"""Drives a running sdhive worker's LoRA and textual-inversion support with the clients people script it with:
`webuiapi` (PyPI, the A1111 client) and the official `openai` SDK.

The checks that need the fixtures' goldens and hashes are made by the Rust test (lora_e2e.rs); this script only
makes the calls exactly as the clients make them, asserts what the clients themselves parse, and writes into
--dir:

    webuiapi-loras.json, webuiapi-embeddings.json   what get_loras() / get_embeddings() returned
    webuiapi-lora.png, webuiapi-lora-info.json      txt2img with <lora:sd1_kohya:1> (image, parsed info)
    webuiapi-ti.png                                 txt2img with the sd1_emb embedding
    openai-plain.png, openai-structured.png, openai-tag.png
                                                    images.generate without a LoRA, with extra_body loras, with the tag

    python lora_clients.py --base-url http://127.0.0.1:7860 --dir /tmp/client
"""

import argparse
import base64
import json
import os
import sys

import openai
import webuiapi

PROMPT = "a photo of an astronaut riding a horse"
# The goldens' settings (tests/fixtures/golden/lora.json): Euler, 8 steps, cfg 7.5, seed 42, 64×64.
GOLDEN = dict(steps=8, cfg_scale=7.5, seed=42, width=64, height=64)


def webuiapi_calls(base: str, out: str) -> None:
    host, port = base.removeprefix("http://").rsplit(":", 1)
    # The client's defaults (sampler "Euler a", scheduler "automatic") are what its users get unless they say
    # otherwise; keep them, so txt2img sends sampler_index "Euler a" beside sampler_name "Euler" as it does.
    api = webuiapi.WebUIApi(host=host, port=int(port))

    loras = api.get_loras()
    assert isinstance(loras, list), loras
    by_name = {entry["name"]: entry for entry in loras}
    for name in ["sd1_kohya", "sd1_peft", "sd1_locon", "sd1_loha", "sd1_lokr", "sdxl_kohya"]:
        assert name in by_name, f"{name} not in {sorted(by_name)}"
    for key in ["name", "alias", "path", "metadata"]:
        assert key in by_name["sd1_kohya"], f"get_loras() entry lacks {key}: {by_name['sd1_kohya']}"
    with open(os.path.join(out, "webuiapi-loras.json"), "w") as f:
        json.dump(loras, f)
    with open(os.path.join(out, "webuiapi-embeddings.json"), "w") as f:
        json.dump(api.get_embeddings(), f)

    result = api.txt2img(
        prompt=f"{PROMPT} <lora:sd1_kohya:1>", negative_prompt="", sampler_name="Euler", **GOLDEN
    )
    assert len(result.images) == 1, result.images
    assert result.image.size == (64, 64), result.image.size
    assert isinstance(result.info, dict), f"info did not parse as JSON: {result.info!r}"
    result.image.save(os.path.join(out, "webuiapi-lora.png"))
    with open(os.path.join(out, "webuiapi-lora-info.json"), "w") as f:
        json.dump(result.info, f)

    result = api.txt2img(prompt=f"sd1_emb, {PROMPT}", negative_prompt="", sampler_name="Euler", **GOLDEN)
    result.image.save(os.path.join(out, "webuiapi-ti.png"))

    # The scheduler field as webuiapi users set it (A1111's names), with a LoRA: accepted and reported back.
    result = api.txt2img(
        prompt=f"{PROMPT} <lora:sd1_locon:0.5>",
        sampler_name="DPM++ 2M",
        scheduler="karras",
        steps=2,
        seed=1,
        width=64,
        height=64,
    )
    assert result.info["sampler_name"] == "DPM++ 2M" and result.info["scheduler"] == "karras", result.info

    # webuiapi raises RuntimeError(status, body) on anything but 200: an unknown LoRA must be a 400 naming it.
    try:
        api.txt2img(prompt=f"{PROMPT} <lora:nope:1>", steps=1, width=64, height=64)
        raise AssertionError("an unknown LoRA was accepted")
    except RuntimeError as e:
        status, text = e.args
        body = json.loads(text)
        assert status == 400 and body["field"] == "prompt" and "nope" in body["detail"], (status, body)


def save_b64(response, path: str) -> None:
    assert len(response.data) == 1, response.data
    data = base64.b64decode(response.data[0].b64_json)
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    with open(path, "wb") as f:
        f.write(data)


def openai_calls(base: str, out: str) -> None:
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=300)
    extra = {"steps": 8, "seed": 42, "cfg_scale": 7.5, "sampler": "Euler"}

    def generate(prompt: str, **more):
        return client.images.generate(
            prompt=prompt,
            size="64x64",
            response_format="b64_json",
            extra_body={**extra, **more},
        )

    save_b64(generate(PROMPT), os.path.join(out, "openai-plain.png"))
    structured = generate(PROMPT, loras=[{"name": "sd1_kohya", "weight": 1.0}])
    save_b64(structured, os.path.join(out, "openai-structured.png"))
    save_b64(generate(f"{PROMPT} <lora:sd1_kohya:1>"), os.path.join(out, "openai-tag.png"))

    try:
        generate(PROMPT, loras=[{"name": "nope", "weight": 1.0}])
        raise AssertionError("an unknown structured LoRA was accepted")
    except openai.BadRequestError as e:
        assert e.status_code == 400 and e.body["param"] == "loras" and "nope" in e.body["message"], e.body


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--base-url", required=True)
    parser.add_argument("--dir", required=True)
    args = parser.parse_args()
    base = args.base_url.rstrip("/")
    webuiapi_calls(base, args.dir)
    openai_calls(base, args.dir)
    print(f"webuiapi and openai {openai.__version__}: LoRA listings, tags, structured loras, errors OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
