//! Each CPU kernel against candle's generic ops (`crate::ops::*_reference` and friends) on shapes
//! that reach every code path: odd sizes, tails shorter than a SIMD lane, sliced and merged
//! convolution products, query blocks in attention.

use super::*;
use crate::layers::Conv2d;
use crate::ops::{self, ConvExtras, PreNorm};
use candle_core::{Device, Module, Tensor};
use candle_nn::Linear;

fn randn(shape: &[usize], seed: u64) -> Tensor {
    // Deterministic values without touching candle's global RNG.
    let n: usize = shape.iter().product();
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let data: Vec<f32> = (0..n)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            ((state >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 3.0
        })
        .collect();
    Tensor::from_vec(data, shape, &Device::Cpu).expect("test tensor")
}

/// Largest difference relative to the reference's largest magnitude.
fn rel_diff(got: &Tensor, want: &Tensor) -> f32 {
    assert_eq!(got.dims(), want.dims());
    let diff = (got - want).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
    let scale = want.abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap().max(1e-6);
    diff / scale
}

#[test]
fn group_norm_matches_reference() {
    for (shape, groups) in [(vec![2, 64, 9, 7], 32), (vec![1, 32, 4, 4], 8), (vec![2, 6, 33], 3)] {
        let c = shape[1];
        let x = ((randn(&shape, 1) * 4.0).unwrap() + 3.0).unwrap();
        let (w, b) = (randn(&[c], 2), randn(&[c], 3));
        let want = ops::group_norm_reference(&x, &w, &b, groups, 1e-5).unwrap();
        let got = group_norm(&x, &w, &b, groups, 1e-5, false).unwrap();
        assert!(rel_diff(&got, &want) < 2e-6, "{shape:?}: {}", rel_diff(&got, &want));
        let got = group_norm(&x, &w, &b, groups, 1e-5, true).unwrap();
        let want = want.silu().unwrap();
        assert!(rel_diff(&got, &want) < 2e-6, "{shape:?} silu: {}", rel_diff(&got, &want));
    }
}

#[test]
fn layer_norm_matches_reference() {
    let x = ((randn(&[3, 5, 67], 4) * 10.0).unwrap() + 50.0).unwrap();
    let (w, b) = (randn(&[67], 5), randn(&[67], 6));
    let want = ops::layer_norm_reference(&x, &w, &b, 1e-5).unwrap();
    let got = layer_norm(&x, &w, &b, 1e-5).unwrap();
    assert!(rel_diff(&got, &want) < 2e-6, "{}", rel_diff(&got, &want));
}

#[test]
fn silu_and_geglu_match_reference() {
    let x = (randn(&[2, 7, 38], 7) * 4.0).unwrap();
    assert!(rel_diff(&silu(&x).unwrap(), &x.silu().unwrap()) < 1e-6);
    let want = ops::geglu_reference(&x).unwrap();
    let got = geglu(&x).unwrap();
    assert!(rel_diff(&got, &want) < 1e-6, "{}", rel_diff(&got, &want));
}

#[allow(clippy::too_many_arguments)]
fn conv_case(
    batch: usize,
    c_in: usize,
    hw: (usize, usize),
    c_out: usize,
    k: usize,
    stride: usize,
    pad: usize,
    upsample: bool,
) {
    let x = randn(&[batch, c_in, hw.0, hw.1], 8);
    let weight = randn(&[c_out, c_in, k, k], 9);
    let bias = randn(&[c_out], 10);
    let conv =
        Conv2d::new(weight.clone(), Some(bias.clone()), stride, pad, ops::MapLayout::ChannelsFirst).unwrap();
    let plain = ops::conv2d_reference(&conv, &x, ConvExtras { upsample, ..Default::default() }).unwrap();
    let per_sample = randn(&[batch, c_out], 11);
    let residual = randn(plain.dims(), 12);
    let groups = if c_in.is_multiple_of(2) { 2 } else { 1 };
    let (nw, nb) = (randn(&[c_in], 13), randn(&[c_in], 14));
    let pre_norm = PreNorm { weight: &nw, bias: &nb, groups, eps: 1e-5, shift: None };
    let extras =
        ConvExtras { per_sample: Some(&per_sample), residual: Some(&residual), upsample, pre_norm: None };
    let want = ops::conv2d_reference(&conv, &x, extras).unwrap();
    let extras_pre = ConvExtras { pre_norm: Some(pre_norm), ..extras };
    let want_pre = ops::conv2d_reference(&conv, &x, extras_pre).unwrap();

    // The tensor entry point (default budget) with and without extras.
    let label = format!("{batch}×{c_in}×{hw:?} k{k} s{stride} p{pad} up{upsample}");
    let got =
        conv2d(&x, &weight, Some(&bias), stride, pad, ConvExtras { upsample, ..Default::default() }).unwrap();
    assert!(rel_diff(&got, &plain) < 1e-5, "plain {label}");
    let got = conv2d(&x, &weight, Some(&bias), stride, pad, extras).unwrap();
    assert!(rel_diff(&got, &want) < 1e-5, "extras {label}");
    let got = conv2d(&x, &weight, Some(&bias), stride, pad, extras_pre).unwrap();
    assert!(rel_diff(&got, &want_pre) < 1e-5, "pre-norm {label}: {}", rel_diff(&got, &want_pre));

    // Every internal path, with and without the pre-activation: Winograd, and patch matrices
    // with tiny budgets (one output row per slice, no merged samples) or roomy ones.
    let (h, w) = if upsample { (2 * hw.0, 2 * hw.1) } else { hw };
    let s = conv::ConvShape { batch, c_in, h, w, c_out, kh: k, kw: k, stride, pad, upsample };
    let (xd, wd) = (F32::new(&x).unwrap(), F32::new(&weight).unwrap());
    let (bd, pd, rd) =
        (F32::new(&bias).unwrap(), F32::new(&per_sample).unwrap(), F32::new(&residual).unwrap());
    let (nwd, nbd) = (F32::new(&nw).unwrap(), F32::new(&nb).unwrap());
    let coef =
        norm::group_norm_coefficients(xd.slice(), c_in, hw.0 * hw.1, groups, 1e-5, nwd.slice(), nbd.slice());
    let epi =
        conv::Epilogue { bias: Some(bd.slice()), per_sample: Some(pd.slice()), residual: Some(rd.slice()) };
    for (pre, want) in [(None, &want), (Some(&coef[..]), &want_pre)] {
        if k == 3 && stride == 1 {
            for tile in [winograd::Tile::F2, winograd::Tile::F4] {
                let out = winograd::conv3x3(xd.slice(), pre, wd.slice(), &s, &epi, tile);
                let got = Tensor::from_vec(out, want.dims(), &Device::Cpu).unwrap();
                assert!(rel_diff(&got, want) < 1e-5, "winograd {tile:?} {label}: {}", rel_diff(&got, want));
            }
        }
        for budget in [1, c_in * k * k * s.w_out() * 2 + 1, usize::MAX / 2] {
            for threads in [1, 2] {
                let out = conv::conv2d_with_budget(xd.slice(), pre, wd.slice(), &s, &epi, threads, budget);
                let got = Tensor::from_vec(out, want.dims(), &Device::Cpu).unwrap();
                assert!(rel_diff(&got, want) < 1e-5, "budget {budget} {label}");
            }
        }
    }
}

#[test]
fn conv2d_matches_reference() {
    conv_case(2, 5, (9, 11), 7, 3, 1, 1, false);
    conv_case(1, 3, (8, 8), 4, 3, 2, 1, false);
    conv_case(2, 4, (9, 9), 6, 3, 2, 0, false);
    conv_case(2, 6, (5, 7), 3, 1, 1, 0, false);
    conv_case(1, 6, (40, 30), 5, 1, 1, 0, false);
    conv_case(2, 4, (5, 6), 3, 3, 1, 1, true);
    conv_case(1, 2, (30, 24), 3, 3, 1, 1, false);
    // Enough tiles for the Winograd path through the tensor entry point, odd sizes, padding 0.
    conv_case(2, 8, (37, 29), 5, 3, 1, 1, false);
    conv_case(1, 4, (33, 34), 3, 3, 1, 0, false);
    conv_case(1, 3, (17, 19), 4, 3, 1, 1, true);
}

/// A norm's shift (the time embedding handed to the norm after a ResNet's first convolution) is added to the
/// input before its statistics, on every path that cannot fuse it: here the CPU one and the reference.
#[test]
fn pre_norm_shift_is_added_before_the_norm() {
    let (batch, c_in, c_out) = (2, 6, 5);
    let x = randn(&[batch, c_in, 7, 9], 21);
    let shift = (randn(&[batch, c_in], 22) * 3.0).unwrap();
    let conv = Conv2d::new(
        randn(&[c_out, c_in, 3, 3], 23),
        Some(randn(&[c_out], 24)),
        1,
        1,
        ops::MapLayout::ChannelsFirst,
    )
    .unwrap();
    let (nw, nb) = (randn(&[c_in], 25), randn(&[c_in], 26));
    let plain = PreNorm { weight: &nw, bias: &nb, groups: 3, eps: 1e-5, shift: None };
    let shifted_x = x.broadcast_add(&shift.reshape((batch, c_in, 1, 1)).unwrap()).unwrap();
    let want =
        ops::conv2d_reference(&conv, &shifted_x, ConvExtras { pre_norm: Some(plain), ..Default::default() })
            .unwrap();
    let extras =
        ConvExtras { pre_norm: Some(PreNorm { shift: Some(&shift), ..plain }), ..Default::default() };
    let unshifted =
        ops::conv2d(&conv, &x, ConvExtras { pre_norm: Some(plain), ..Default::default() }).unwrap();
    assert!(rel_diff(&unshifted, &want) > 1e-2, "the shift must change the result");
    for (path, got) in [
        ("cpu", ops::conv2d(&conv, &x, extras).unwrap()),
        ("reference", ops::conv2d_reference(&conv, &x, extras).unwrap()),
    ] {
        assert!(rel_diff(&got, &want) < 1e-5, "{path}: {}", rel_diff(&got, &want));
    }
}

#[test]
fn linear_and_projections_match_reference() {
    let x = randn(&[2, 13, 24], 13);
    let w = randn(&[20, 24], 14);
    let b = randn(&[20], 15);
    let res = randn(&[2, 13, 20], 16);
    let l = Linear::new(w.clone(), Some(b.clone()));
    let want = (l.forward(&x).unwrap() + &res).unwrap();
    let got = linear(&x, &w, Some(&b), Some(&res)).unwrap();
    assert!(rel_diff(&got, &want) < 1e-5);
    let nb = Linear::new(w.clone(), None);
    assert!(rel_diff(&linear(&x, &w, None, None).unwrap(), &nb.forward(&x).unwrap()) < 1e-5);

    // NCHW → tokens → NCHW against the permute + matmul formulation.
    let img = randn(&[2, 24, 3, 5], 17);
    let w4 = w.reshape((20, 24, 1, 1)).unwrap();
    let tokens_want = img.flatten_from(2).unwrap().transpose(1, 2).unwrap().contiguous().unwrap();
    let tokens_want = l.forward(&tokens_want).unwrap();
    let tokens = image_to_tokens(&img, &w4, Some(&b)).unwrap();
    assert!(rel_diff(&tokens, &tokens_want) < 1e-5);

    let back_w = randn(&[24, 20], 18);
    let back_b = randn(&[24], 19);
    let back = Linear::new(back_w.clone(), Some(back_b.clone()));
    let want = back.forward(&tokens).unwrap().transpose(1, 2).unwrap().reshape((2, 24, 3, 5)).unwrap();
    let want = (want + &img).unwrap();
    let got = tokens_to_image(&tokens, &back_w, Some(&back_b), (3, 5), Some(&img)).unwrap();
    assert!(rel_diff(&got, &want) < 1e-5);
}

#[test]
fn attention_matches_reference() {
    // (batch, q_len, kv_len, heads, head_dim); the second needs several query blocks.
    for (b, sq, sk, heads, d) in [(2, 19, 7, 3, 8), (1, 300, 2048, 2, 5), (2, 33, 33, 1, 16)] {
        let q = randn(&[b, sq, heads * d], 20);
        let k = randn(&[b, sk, heads * d], 21);
        let v = randn(&[b, sk, heads * d], 22);
        let scale = (d as f64).powf(-0.5);
        let split = |t: &Tensor| ops::split_heads(t, heads).unwrap();
        let o = ops::attention(
            &split(&q).to_dtype(candle_core::DType::F64).unwrap(),
            &split(&k).to_dtype(candle_core::DType::F64).unwrap(),
            &split(&v).to_dtype(candle_core::DType::F64).unwrap(),
            scale,
            None,
            false,
        )
        .unwrap();
        let want = ops::merge_heads(&o, heads).unwrap().to_dtype(candle_core::DType::F32).unwrap();
        let got = attention(&q, &k, &v, heads, scale).unwrap();
        assert!(rel_diff(&got, &want) < 1e-5, "{b} {sq} {sk} {heads} {d}: {}", rel_diff(&got, &want));
    }
}
