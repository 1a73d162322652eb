//! SD3's CLIP encoders and 16-channel VAE against diffusers (tiny random `tests/fixtures/models/sd3`, float32,
//! CPU; `xtask/fixtures/gen_sd3.py`): both CLIP towers with their projection heads read as SD3 reads them (the
//! penultimate hidden state, the projected pooled output; CLIP-L's projection is the identity SAI files imply),
//! the tokenizers' ids for SD3's prompts, and the VAE decode of `latents / scaling_factor + shift_factor`.

mod common;

use candle_core::{DType, Device, Tensor};
use common::{fixtures, get, golden, max_diff, sd3_prompts};
use sdhive_models::{AutoencoderKL, AutoencoderKLConfig, ClipTextModel};
use sdhive_tokenizer::ClipTokenizer;

const TOL: f32 = 1e-4;

fn checked(what: &str, ours: &Tensor, want: &Tensor) -> f32 {
    let d = max_diff(what, ours, want);
    assert!(d <= TOL && d.is_finite(), "{what}: max abs diff {d} > {TOL}");
    d
}

#[test]
fn both_clip_towers_give_the_penultimate_states_and_projected_pooled_outputs_sd3_reads() {
    let g = golden("sd3_text.safetensors");
    let model = fixtures().join("models/sd3");
    let prompts = sd3_prompts();
    assert_eq!(prompts.len(), 4);
    for (tower, encoder, tokenizer) in
        [("l", "text_encoder", "tokenizer"), ("g", "text_encoder_2", "tokenizer_2")]
    {
        let clip = ClipTextModel::from_dir(&model.join(encoder), true, DType::F32, &Device::Cpu)
            .unwrap_or_else(|e| panic!("{encoder}: {e}"));
        let tok =
            ClipTokenizer::from_dir(&model.join(tokenizer)).unwrap_or_else(|e| panic!("{tokenizer}: {e}"));
        for (i, prompt) in prompts.iter().enumerate() {
            let want_ids = get(&g, &format!("clip_{tower}_ids_{i}"));
            let pad = tok.pad_id();
            let ids: Vec<i64> = tok.encode_padded(prompt).into_iter().map(i64::from).collect();
            let ours_ids = Tensor::from_vec(ids, (1, 77), &Device::Cpu).unwrap();
            let want: Vec<i64> = want_ids.flatten_all().unwrap().to_vec1().unwrap();
            assert_eq!(
                ours_ids.flatten_all().unwrap().to_vec1::<i64>().unwrap(),
                want,
                "{tokenizer} (pad {pad}) {prompt:?}"
            );
            let out = clip.forward(&want_ids.to_dtype(DType::U32).unwrap()).unwrap();
            let n = out.hidden_states.len();
            max_diff(
                &format!("clip_{tower} penultimate {i}"),
                &out.hidden_states[n - 2],
                get(&g, &format!("clip_{tower}_penult_{i}")),
            );
            let pooled = out.text_embeds.expect("projection head");
            max_diff(
                &format!("clip_{tower} pooled {i}"),
                &pooled,
                get(&g, &format!("clip_{tower}_pooled_{i}")),
            );
        }
    }
}

#[test]
fn the_16_channel_vae_decodes_as_diffusers_with_scaling_and_shift() {
    let g = golden("sd3_vae.safetensors");
    let dir = fixtures().join("models/sd3/vae");
    let config = AutoencoderKLConfig::from_file(&dir.join("config.json")).unwrap();
    assert_eq!(
        (config.latent_channels, config.use_quant_conv, config.use_post_quant_conv),
        (16, false, false)
    );
    let (scale, shift) = (config.scaling_factor, config.shift_factor.expect("SD3's VAE has a shift factor"));
    assert_eq!((scale, shift), (1.5305, 0.0609));
    let vae = AutoencoderKL::from_dir(&dir, DType::F32, &Device::Cpu).unwrap();
    let z = get(&g, "latents").affine(1.0 / scale, shift).unwrap();
    checked("sd3 vae decode", &vae.decode(&z).unwrap(), get(&g, "image"));
}
