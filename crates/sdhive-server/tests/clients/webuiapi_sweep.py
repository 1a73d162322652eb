#!/usr/bin/env python3
"""Calls every A1111 route `webuiapi` (PyPI) has against a running sdhive worker or hive, as its users call them,
and checks what the client itself parses: the listings' shapes, txt2img and img2img (with a mask) images,
hires fix, the extras, png_info of a generated image, options, progress, interrupt, refresh, util_set_model.
Needs a server with the tiny sd1 checkpoint and the fixture upscaler models (`esrgan_x4_new`). Exits non-zero on
the first mismatch.

    python webuiapi_sweep.py --base-url http://127.0.0.1:7860 [--user U --password P]
"""

import argparse

import webuiapi
from PIL import Image

SMALL = dict(steps=2, width=64, height=64, seed=5, sampler_name="Euler")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--base-url", required=True)
    parser.add_argument("--user")
    parser.add_argument("--password")
    args = parser.parse_args()
    host, port = args.base_url.removeprefix("http://").rsplit(":", 1)
    api = webuiapi.WebUIApi(host=host, port=int(port), username=args.user, password=args.password)

    models = api.get_sd_models()
    assert models and {"title", "model_name", "hash", "filename"} <= set(models[0]), models
    assert isinstance(api.get_sd_vae(), list)
    assert [s["name"] for s in api.get_samplers()][:2] == ["Euler", "Euler a"], api.get_samplers()
    assert {"automatic", "karras"} <= {s["name"] for s in api.get_schedulers()}
    upscalers = [u["name"] for u in api.get_upscalers()]
    assert upscalers[:3] == ["None", "Lanczos", "Nearest"] and "esrgan_x4_new" in upscalers, upscalers
    assert [m["name"] for m in api.get_latent_upscale_modes()][0] == "Latent"
    assert any(m["name"] == "esrgan_x4_new" for m in api.get_realesrgan_models())
    for listing in (api.get_loras(), api.get_hypernetworks(), api.get_face_restorers(), api.get_prompt_styles()):
        assert isinstance(listing, list), listing
    assert set(api.get_embeddings()) == {"loaded", "skipped"}
    assert set(api.get_scripts()) == {"txt2img", "img2img"}
    assert set(api.get_memory()) == {"ram", "cuda"}
    assert isinstance(api.get_cmd_flags(), dict)
    options = api.get_options()
    assert "sd_model_checkpoint" in options, options
    api.set_options({"sd_model_checkpoint": options["sd_model_checkpoint"]})
    api.util_set_model(models[0]["title"])
    assert api.refresh_checkpoints() is None
    assert "progress" in api.get_progress()
    assert api.interrupt() == {}
    assert "error" in api.skip()  # a JSON 501: skipping one image of a batch is not supported

    result = api.txt2img(prompt="a red cube", negative_prompt="", **SMALL)
    assert result.image.size == (64, 64), result.image.size
    hires = api.txt2img(prompt="a red cube", enable_hr=True, hr_upscaler="Latent", hr_scale=2,
                        denoising_strength=0.5, **SMALL)
    assert hires.image.size == (128, 128), hires.image.size
    mask = Image.new("L", (64, 64), 0)
    mask.paste(255, (16, 16, 48, 48))
    edited = api.img2img(images=[result.image], mask_image=mask, prompt="a blue cube", denoising_strength=0.6,
                         **SMALL)
    assert edited.image.size == (64, 64), edited.image.size
    info = api.png_info(result.image)
    assert info.info.startswith("a red cube"), info.info
    extras = api.extra_single_image(image=result.image, upscaler_1="esrgan_x4_new", upscaling_resize=2)
    assert extras.image.size == (128, 128), extras.image.size
    batch = api.extra_batch_images(images=[result.image, edited.image], upscaler_1="Lanczos", upscaling_resize=1.5)
    assert [i.size for i in batch.images] == [(96, 96), (96, 96)], [i.size for i in batch.images]
    print("webuiapi sweep: every route answered as the client expects")


if __name__ == "__main__":
    main()
