//! Each kernel against the plain candle ops it replaces, on GPU 0, in every dtype it takes. These run on a
//! machine with a CUDA GPU (the test binary built by `cargo xtask build-cuda --tests`).

use super::*;
use crate::attention::Kernels;
use candle_core::{DType, Device, D};

fn gpu() -> Device {
    Device::new_cuda(0).expect("the sdhive-cuda-kernels tests need a CUDA GPU")
}

/// Max |a − b| relative to b's largest magnitude (at least 1), in f32, on the host: a NaN anywhere gives NaN
/// (a GPU max reduction may skip it), which every `d <= tol` check then rejects.
fn rel_diff(a: &Tensor, b: &Tensor) -> f32 {
    let host = |t: &Tensor| t.to_dtype(DType::F32).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
    let (a, b) = (host(a), host(b));
    assert_eq!(a.len(), b.len());
    let mut diff = 0f32;
    for (x, y) in a.iter().zip(&b) {
        let d = (x - y).abs();
        if d.is_nan() && !(x.is_infinite() && x == y) {
            return f32::NAN;
        }
        diff = diff.max(if x == y { 0.0 } else { d });
    }
    diff / b.iter().fold(1f32, |m, v| m.max(v.abs()))
}

/// The largest absolute difference between two tensors of one shape, in f32: 0 when they agree to the bit.
fn max_abs_diff(a: &Tensor, b: &Tensor) -> f32 {
    let d = (a.to_dtype(DType::F32).unwrap() - b.to_dtype(DType::F32).unwrap()).unwrap();
    d.abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap()
}

/// Of two f16 or bf16 tensors' elements, how many there are and how many differ; asserts that none differs by more
/// than one unit in the last place (adjacent bit patterns, or the two zeros) or else by more than `abs`.
fn ulps_apart(a: &Tensor, b: &Tensor, abs: f32) -> (usize, usize) {
    let bits = |t: &Tensor| -> Vec<(u16, f32)> {
        let t = t.flatten_all().unwrap();
        match t.dtype() {
            DType::F16 => {
                t.to_vec1::<half::f16>().unwrap().iter().map(|v| (v.to_bits(), v.to_f32())).collect()
            }
            DType::BF16 => {
                t.to_vec1::<half::bf16>().unwrap().iter().map(|v| (v.to_bits(), v.to_f32())).collect()
            }
            other => panic!("ulps_apart: {other:?} is not a 16-bit float"),
        }
    };
    let (a, b) = (bits(a), bits(b));
    assert_eq!(a.len(), b.len());
    let mut differ = 0;
    for (i, (&(x, xv), &(y, yv))) in a.iter().zip(&b).enumerate() {
        if x != y {
            differ += 1;
            let zeros = x & 0x7fff == 0 && y & 0x7fff == 0;
            let adjacent = (x ^ y) & 0x8000 == 0 && x.abs_diff(y) == 1;
            assert!(
                zeros || adjacent || (xv - yv).abs() <= abs,
                "element {i}: {xv} ({x:#06x}) against {yv} ({y:#06x})"
            );
        }
    }
    (a.len(), differ)
}

/// Each dtype's tolerance: its rounding of the output.
fn tol(dtype: DType) -> f32 {
    match dtype {
        DType::F32 => 1e-5,
        DType::F16 => 2e-3,
        _ => 1.6e-2,
    }
}

const DTYPES: [DType; 3] = [DType::F32, DType::F16, DType::BF16];

fn group_norm_reference(x: &Tensor, w: &Tensor, b: &Tensor, groups: usize, eps: f64, silu: bool) -> Tensor {
    let dims = x.dims().to_vec();
    let xf = x.to_dtype(DType::F64).unwrap().reshape((dims[0], groups, ())).unwrap();
    let mean = xf.mean_keepdim(2).unwrap();
    let c = xf.broadcast_sub(&mean).unwrap();
    let var = c.sqr().unwrap().mean_keepdim(2).unwrap();
    let mut shape = vec![1usize; dims.len()];
    shape[1] = dims[1];
    let wf = w.to_dtype(DType::F64).unwrap().reshape(shape.clone()).unwrap();
    let bf = b.to_dtype(DType::F64).unwrap().reshape(shape).unwrap();
    let y = c
        .broadcast_div(&(var + eps).unwrap().sqrt().unwrap())
        .unwrap()
        .reshape(dims)
        .unwrap()
        .broadcast_mul(&wf)
        .unwrap()
        .broadcast_add(&bf)
        .unwrap();
    if silu {
        y.silu().unwrap()
    } else {
        y
    }
}

#[test]
fn group_norm_matches_the_reference() {
    let dev = gpu();
    // Odd spatial sizes, one chunk and many chunks per group, and a large offset that E[x²] − E[x]² would lose.
    for (shape, groups, offset) in
        [((2, 64, 9, 7), 32, 0.0), ((1, 32, 96, 96), 8, 0.0), ((2, 16, 40, 40), 4, 300.0)]
    {
        let x = (Tensor::randn(0f32, 1.0, shape, &dev).unwrap() + offset).unwrap();
        let w = Tensor::randn(1f32, 0.2, shape.1, &dev).unwrap();
        let b = Tensor::randn(0f32, 0.2, shape.1, &dev).unwrap();
        for dtype in DTYPES {
            let (xd, wd, bd) =
                (x.to_dtype(dtype).unwrap(), w.to_dtype(dtype).unwrap(), b.to_dtype(dtype).unwrap());
            assert!(applies(&[&xd, &wd, &bd]));
            for silu in [false, true] {
                let ours = group_norm(&xd, &wd, &bd, groups, 1e-5, silu).unwrap();
                assert_eq!(ours.dtype(), dtype);
                let want = group_norm_reference(&xd, &wd, &bd, groups, 1e-5, silu);
                let d = rel_diff(&ours, &want);
                eprintln!("group_norm {shape:?}/{groups} +{offset} {dtype:?} silu={silu}: rel diff {d:.2e}");
                assert!(d <= tol(dtype), "group_norm {shape:?} {dtype:?} silu={silu}: {d}");
            }
        }
    }
}

/// Odd sizes take the element-wise path; whole 16-byte groups per channel (NCHW) or per row of channels
/// (channels-last) take the vectorised one.
#[test]
fn channel_adds_match_broadcast_adds() {
    let dev = gpu();
    for ((hh, ww), cols) in [((5, 3), 10), ((8, 4), 16)] {
        let y = Tensor::randn(0f32, 1.0, (2, 6, hh, ww), &dev).unwrap();
        let bias = Tensor::randn(0f32, 1.0, (1, 6), &dev).unwrap();
        let per_sample = Tensor::randn(0f32, 1.0, (2, 6), &dev).unwrap();
        let residual = Tensor::randn(0f32, 1.0, (2, 6, hh, ww), &dev).unwrap();
        let tokens = Tensor::randn(0f32, 1.0, (4, 7, cols), &dev).unwrap();
        let last_bias = Tensor::randn(0f32, 1.0, cols, &dev).unwrap();
        let token_res = Tensor::randn(0f32, 1.0, (4, 7, cols), &dev).unwrap();
        for dtype in DTYPES {
            let c = |t: &Tensor| t.to_dtype(dtype).unwrap();
            let (y, r) = (c(&y), c(&residual));
            for add in [c(&bias), c(&per_sample)] {
                let want = y.broadcast_add(&add.reshape((add.dim(0).unwrap(), 6, 1, 1)).unwrap()).unwrap();
                let d = rel_diff(&add_channel(&y, &add, None).unwrap(), &want);
                assert!(d <= tol(dtype), "add_channel {:?} {:?} {dtype:?}: {d}", y.dims(), add.dims());
                let d = rel_diff(&add_channel(&y, &add, Some(&r)).unwrap(), &(&want + &r).unwrap());
                assert!(d <= 2.0 * tol(dtype), "add_channel + residual {:?} {dtype:?}: {d}", add.dims());
            }
            let (t, tb, tr) = (c(&tokens), c(&last_bias), c(&token_res));
            let want = t.broadcast_add(&tb).unwrap();
            assert!(rel_diff(&add_bias_last(&t, &tb, None).unwrap(), &want) <= tol(dtype));
            let d = rel_diff(&add_bias_last(&t, &tb, Some(&tr)).unwrap(), &(&want + &tr).unwrap());
            assert!(d <= 2.0 * tol(dtype), "add_bias_last + residual {cols} {dtype:?}: {d}");
        }
    }
    // A per-sample term whose batch does not match is refused, not read out of bounds.
    let y = Tensor::zeros((2, 6, 5, 3), DType::F32, &dev).unwrap();
    let wrong = Tensor::zeros((3, 6), DType::F32, &dev).unwrap();
    assert!(add_channel(&y, &wrong, None).is_err());
}

/// Softmax over the last dimension with candle's ops, in f32.
fn softmax_reference(x: &Tensor) -> Tensor {
    let xf = x.to_dtype(DType::F32).unwrap();
    let e = xf.broadcast_sub(&xf.max_keepdim(D::Minus1).unwrap()).unwrap().exp().unwrap();
    e.broadcast_div(&e.sum_keepdim(D::Minus1).unwrap()).unwrap()
}

#[test]
fn softmax_matches_the_reference() {
    let dev = gpu();
    let shapes: [(&[usize], f64); 3] = [(&[3, 5, 4096], 4.0), (&[7, 77], 30.0), (&[2, 3, 33], 1.0)];
    for (shape, scale) in shapes {
        let x = (Tensor::randn(0f32, 1.0, shape, &dev).unwrap() * scale).unwrap();
        for dtype in DTYPES {
            let xd = x.to_dtype(dtype).unwrap();
            let want = softmax_reference(&xd);
            let ours = softmax_last_dim(&xd).unwrap();
            let sums = ours.to_dtype(DType::F32).unwrap().sum(D::Minus1).unwrap();
            let d = rel_diff(&ours, &want);
            eprintln!("softmax {shape:?} ×{scale} {dtype:?}: rel diff {d:.2e}");
            assert!(d <= tol(dtype), "softmax {shape:?} {dtype:?}: {d}");
            assert!(rel_diff(&sums, &sums.ones_like().unwrap()) <= 50.0 * tol(dtype));
        }
    }
}

/// Half queries and keys give the f32 scores of their f32 conversions (the VAE's one head of 512), also for a run
/// of queries narrowed out of a longer one, as the chunked attention passes them; f32 operands are refused.
#[test]
fn attention_scores_match_the_upcast_product() {
    let dev = gpu();
    let scale = 512f64.powf(-0.5);
    for dtype in [DType::F16, DType::BF16] {
        let q = Tensor::randn(0f32, 1.0, (2, 350, 512), &dev).unwrap().to_dtype(dtype).unwrap();
        let k = Tensor::randn(0f32, 1.0, (2, 257, 512), &dev).unwrap().to_dtype(dtype).unwrap();
        let upcast = |q: &Tensor, k: &Tensor| {
            let q = (q.to_dtype(DType::F32).unwrap() * scale).unwrap();
            q.matmul(&k.to_dtype(DType::F32).unwrap().t().unwrap()).unwrap()
        };
        let ours = attention_scores(&q, &k, scale).unwrap();
        assert_eq!((ours.dtype(), ours.dims()), (DType::F32, &[2, 350, 257][..]));
        let d = rel_diff(&ours, &upcast(&q, &k));
        eprintln!("attention scores {dtype:?}: rel diff {d:.2e}");
        assert!(d <= 1e-5, "attention scores {dtype:?}: {d}");
        let (qn, kn) = (q.narrow(0, 1, 1).unwrap().narrow(1, 90, 200).unwrap(), k.narrow(0, 1, 1).unwrap());
        assert!(qn.is_contiguous());
        let d = rel_diff(&attention_scores(&qn, &kn, scale).unwrap(), &upcast(&qn, &kn));
        assert!(d <= 1e-5, "narrowed attention scores {dtype:?}: {d}");
    }
    let q = Tensor::zeros((1, 4, 8), DType::F32, &dev).unwrap();
    assert!(attention_scores(&q, &q, 1.0).is_err());
}

/// A causal mask's −∞ scores (CLIP's attention) give zero weight, also at the start of a row.
#[test]
fn softmax_of_masked_rows() {
    let dev = gpu();
    // 77 columns take the element-wise path, 128 the 16-byte one.
    for n in [77usize, 128] {
        let mask: Vec<f32> =
            (0..n * n).map(|i| if i % n > i / n { f32::NEG_INFINITY } else { 0.0 }).collect();
        let mask = Tensor::from_vec(mask, (n, n), &dev).unwrap();
        let x = Tensor::randn(0f32, 3.0, (4, n, n), &dev).unwrap().broadcast_add(&mask).unwrap();
        // Rows whose first values are masked, as in a row-reversed causal mask.
        let flipped = x.flip(&[2]).unwrap().contiguous().unwrap();
        for scores in [x, flipped] {
            for dtype in DTYPES {
                let xd = scores.to_dtype(dtype).unwrap();
                let want = softmax_reference(&xd);
                let ours = softmax_last_dim(&xd).unwrap();
                let d = rel_diff(&ours, &want);
                assert!(d.is_finite() && d <= tol(dtype), "masked softmax {n} {dtype:?}: {d}");
            }
        }
    }
}

/// Halves of 48 and 1280 take the 16-byte path (1280 over several blocks of a grid sized per vector), 45 the
/// element-wise one; with and without the projection's bias.
#[test]
fn geglu_matches_the_reference() {
    let dev = gpu();
    for half in [48, 45, 1280] {
        let x = Tensor::randn(0f32, 2.0, (2, 5, 2 * half), &dev).unwrap();
        let bias = Tensor::randn(0f32, 1.0, 2 * half, &dev).unwrap();
        for dtype in DTYPES {
            let (xd, bd) = (x.to_dtype(dtype).unwrap(), bias.to_dtype(dtype).unwrap());
            for with_bias in [false, true] {
                let input = xd.to_dtype(DType::F32).unwrap();
                let input = if with_bias {
                    input.broadcast_add(&bd.to_dtype(DType::F32).unwrap()).unwrap()
                } else {
                    input
                };
                let hidden = input.narrow(D::Minus1, 0, half).unwrap();
                let gate = input.narrow(D::Minus1, half, half).unwrap();
                let want = hidden.mul(&gate.gelu_erf().unwrap()).unwrap();
                let ours = if with_bias { geglu_bias(&xd, Some(&bd)).unwrap() } else { geglu(&xd).unwrap() };
                assert_eq!(ours.dims(), &[2, 5, half]);
                let d = rel_diff(&ours, &want);
                assert!(d <= tol(dtype), "geglu {half} bias {with_bias} {dtype:?}: {d}");
            }
        }
    }
}

/// Whether this device and build run the fused GEGLU product (compute capability 9.0, built for it).
fn geglu_product_here(dev: &Device) -> bool {
    let Device::Cuda(cuda) = dev else { return false };
    crate::cuda::built_for() == 90 && cuda.cuda_stream().context().compute_capability().unwrap() == (9, 0)
}

/// The fused first feed-forward product with GEGLU against the f32 product of the same (rounded) inputs, bias and
/// exact-erf GEGLU: the SD1.5 UNet's four shapes (batch 2, each taking its own tiling or the persistent form),
/// row counts off every tile (77, 1000, 1, 3000; through 3-D and 2-D inputs), f16 and bf16. The persistent form
/// (above 256 rows) must also agree with the tiled kernels to one unit, or to 1e-6 of the largest output where
/// the two erfs differ.
/// On other devices and builds it must say it is off.
#[test]
fn fused_geglu_product_matches_the_reference() {
    let dev = gpu();
    let here = geglu_product_here(&dev);
    for dtype in [DType::F16, DType::BF16] {
        assert_eq!(geglu_product_on(&dev, dtype, 320, 1280), here, "{dtype:?}");
    }
    if !here {
        eprintln!("not a compute capability 9.0 device with a build for it: the fused GEGLU product is off");
        return;
    }
    let shapes = [
        (&[2, 4096][..], 320, 1280),
        (&[2, 1024][..], 640, 2560),
        (&[2, 256][..], 1280, 5120),
        (&[2, 64][..], 1280, 5120),
        (&[77][..], 320, 1280),
        (&[2, 500][..], 640, 2560),
        (&[1, 1][..], 1280, 5120),
        (&[3, 1000][..], 640, 2560),
        (&[2, 1024][..], 1280, 5120),
    ];
    for (rows, k, h) in shapes {
        let mut x_shape = rows.to_vec();
        x_shape.push(k);
        let x = Tensor::randn(0f32, 1.0, x_shape, &dev).unwrap();
        let w = Tensor::randn(0f32, 1.0 / (k as f32).sqrt(), (2 * h, k), &dev).unwrap();
        let b = Tensor::randn(0f32, 0.5, 2 * h, &dev).unwrap();
        for dtype in [DType::F16, DType::BF16] {
            let cast = |t: &Tensor| t.to_dtype(dtype).unwrap();
            let f32_of = |t: &Tensor| t.to_dtype(DType::F32).unwrap();
            let (xd, wd, bd) = (cast(&x), cast(&w), cast(&b));
            let y = f32_of(&xd).broadcast_matmul(&f32_of(&wd).t().unwrap()).unwrap();
            let y = y.broadcast_add(&f32_of(&bd)).unwrap();
            let gate = y.narrow(D::Minus1, h, h).unwrap().gelu_erf().unwrap();
            let want = y.narrow(D::Minus1, 0, h).unwrap().mul(&gate).unwrap();
            let (wi, bi) = interleave_geglu(&wd, &bd).unwrap();
            let ours = linear_geglu_interleaved(&xd, &wi, &bi).unwrap();
            assert_eq!(ours.dims(), want.dims());
            assert_eq!(ours.dtype(), dtype);
            let d = rel_diff(&ours, &want);
            eprintln!("fused GEGLU product {rows:?} k{k} h{h} {dtype:?}: rel diff {d:.2e}");
            assert!(d <= tol(dtype), "fused GEGLU product {rows:?} k{k} h{h} {dtype:?}: {d}");
            // The two erfs differ by up to 1.5e-7 absolute; where 1 + erf is tiny (large negative gates), that is
            // a few units of a tiny output, never more than 1e-6 of the largest.
            let tiled = crate::geglu::product_with(&xd, &wi, &bi, false).unwrap();
            let scale = tiled.abs().unwrap().max_all().unwrap().to_dtype(DType::F32).unwrap();
            let (n, differ) = ulps_apart(&ours, &tiled, 1e-6 * scale.to_scalar::<f32>().unwrap());
            eprintln!("  against the tiled kernel: {differ} of {n} outputs differ");
            assert!(differ * 100 <= n, "{rows:?} k{k} h{h} {dtype:?}: {differ} of {n} outputs differ");
        }
    }
}

/// What the fused GEGLU product refuses, on any device: K off whole steps of 64, H off the interleave block of 64,
/// f32, the CPU, operands that do not fit each other, a non-contiguous input; and an interleave of a W1 whose
/// halves are off the block.
#[test]
fn fused_geglu_product_refuses_what_it_cannot_take() {
    let dev = gpu();
    let here = geglu_product_here(&dev);
    assert!(!geglu_product_on(&dev, DType::F16, 320 + 32, 1280));
    assert!(!geglu_product_on(&dev, DType::F16, 320, 1280 + 32));
    assert!(!geglu_product_on(&dev, DType::F32, 320, 1280));
    assert!(!geglu_product_on(&Device::Cpu, DType::F16, 320, 1280));
    let t = |shape: &[usize], dtype| Tensor::zeros(shape, dtype, &dev).unwrap();
    assert!(interleave_geglu(&t(&[2 * 96, 64], DType::F16), &t(&[2 * 96], DType::F16)).is_err());
    assert!(interleave_geglu(&t(&[2 * 64, 64], DType::F16), &t(&[64], DType::F16)).is_err());
    let (w, b) = (t(&[2 * 128, 128], DType::F16), t(&[2 * 128], DType::F16));
    let (wi, bi) = interleave_geglu(&w, &b).unwrap();
    let x = t(&[3, 128], DType::F16);
    assert_eq!(linear_geglu_interleaved(&x, &wi, &bi).is_ok(), here);
    // K 96 is not whole steps of 64; the input's K differs from the weight's; f32; the weight's H 96.
    let w96 = t(&[2 * 128, 96], DType::F16);
    assert!(linear_geglu_interleaved(&t(&[3, 96], DType::F16), &w96, &bi).is_err());
    assert!(linear_geglu_interleaved(&t(&[3, 64], DType::F16), &wi, &bi).is_err());
    let f = |t: &Tensor| t.to_dtype(DType::F32).unwrap();
    assert!(linear_geglu_interleaved(&f(&x), &f(&wi), &f(&bi)).is_err());
    assert!(linear_geglu_interleaved(&x, &t(&[2 * 96, 128], DType::F16), &t(&[2 * 96], DType::F16)).is_err());
    let wide = t(&[128, 3], DType::F16).t().unwrap();
    assert!(linear_geglu_interleaved(&wide, &wi, &bi).is_err(), "a transposed input is not contiguous");
    let cpu = |t: &Tensor| t.to_device(&Device::Cpu).unwrap();
    assert!(linear_geglu_interleaved(&cpu(&x), &cpu(&wi), &cpu(&bi)).is_err());
}

/// The narrow product with its LayerNorm against the f32 product of the same (rounded) inputs plus bias and
/// residual, rounded to the storage type as the unfused product stores it, then LayerNorm in f32: the SD1.5 UNet's
/// 64² shapes (proj_in without a residual, the attentions' to_out with one, the feed-forward's second product at K
/// 1280; batch 2), K 640 and row counts off the 64-row block (77, 1000, 1; 3-D and 2-D inputs), f16 and bf16; and
/// the kernel without the norm ([`linear_rows`]: each row over two blocks, unless `SDHIVE_LINEAR_SPLIT=0`) giving the
/// same h bit for bit. The residual carries a large offset per row, as
/// the residual stream does, so that the LayerNorm's mean matters. On other devices and builds it must say it is
/// off.
#[test]
fn fused_linear_norm_matches_the_reference() {
    let dev = gpu();
    let here = geglu_product_here(&dev);
    for dtype in [DType::F16, DType::BF16] {
        assert_eq!(linear_norm_on(&dev, dtype, 320, 320), here, "{dtype:?}");
    }
    if !here {
        eprintln!(
            "not a compute capability 9.0 device with a build for it: the fused product and LayerNorm is off"
        );
        return;
    }
    let shapes = [
        (&[2, 4096][..], 320, false),
        (&[2, 4096][..], 320, true),
        (&[2, 4096][..], 1280, true),
        (&[77][..], 320, true),
        (&[2, 500][..], 640, true),
        (&[1, 1][..], 320, false),
    ];
    let n = 320;
    for (rows, k, with_residual) in shapes {
        let mut x_shape = rows.to_vec();
        x_shape.push(k);
        let mut o_shape = rows.to_vec();
        o_shape.push(n);
        let x = Tensor::randn(0f32, 1.0, x_shape, &dev).unwrap();
        let w = Tensor::randn(0f32, 1.0 / (k as f32).sqrt(), (n, k), &dev).unwrap();
        let b = Tensor::randn(0f32, 0.5, n, &dev).unwrap();
        let offset = Tensor::randn(0f32, 4.0, &o_shape[..o_shape.len() - 1], &dev)
            .unwrap()
            .unsqueeze(D::Minus1)
            .unwrap();
        let r = Tensor::randn(0f32, 2.0, o_shape.as_slice(), &dev).unwrap().broadcast_add(&offset).unwrap();
        let g = (Tensor::randn(0f32, 0.3, n, &dev).unwrap() + 1.0).unwrap();
        let be = Tensor::randn(0f32, 0.2, n, &dev).unwrap();
        for dtype in [DType::F16, DType::BF16] {
            let cast = |t: &Tensor| t.to_dtype(dtype).unwrap();
            let f32_of = |t: &Tensor| t.to_dtype(DType::F32).unwrap();
            let (xd, wd, bd, rd, gd, bed) = (cast(&x), cast(&w), cast(&b), cast(&r), cast(&g), cast(&be));
            let mut h = f32_of(&xd).broadcast_matmul(&f32_of(&wd).t().unwrap()).unwrap();
            h = h.broadcast_add(&f32_of(&bd)).unwrap();
            if with_residual {
                h = (h + f32_of(&rd)).unwrap();
            }
            let h = f32_of(&cast(&h));
            let mean = h.mean_keepdim(D::Minus1).unwrap();
            let centered = h.broadcast_sub(&mean).unwrap();
            let var = centered.sqr().unwrap().mean_keepdim(D::Minus1).unwrap();
            let normed = centered.broadcast_div(&(var + 1e-5).unwrap().sqrt().unwrap()).unwrap();
            let want_n = normed.broadcast_mul(&f32_of(&gd)).unwrap().broadcast_add(&f32_of(&bed)).unwrap();
            let residual = with_residual.then_some(&rd);
            let (ours_h, ours_n) = linear_norm(&xd, &wd, &bd, residual, &gd, &bed, 1e-5).unwrap();
            assert_eq!(ours_h.dims(), h.dims());
            assert_eq!(ours_n.dims(), h.dims());
            assert_eq!((ours_h.dtype(), ours_n.dtype()), (dtype, dtype));
            let (dh, dn) = (rel_diff(&ours_h, &h), rel_diff(&ours_n, &want_n));
            // The same kernel without the norm makes the same h.
            let rows_only = linear_rows(&xd, &wd, &bd, residual).unwrap();
            assert_eq!(rows_only.dims(), h.dims());
            let dr = rel_diff(&rows_only, &ours_h);
            eprintln!(
                "fused product and LayerNorm {rows:?} k{k} residual {with_residual} {dtype:?}: h {dh:.2e}, n {dn:.2e}, \
                 h without the norm against h {dr:.2e}"
            );
            assert!(dh <= tol(dtype), "product {rows:?} k{k} residual {with_residual} {dtype:?}: {dh}");
            assert!(dn <= tol(dtype), "LayerNorm {rows:?} k{k} residual {with_residual} {dtype:?}: {dn}");
            assert!(dr == 0.0, "h without the norm {rows:?} k{k} residual {with_residual} {dtype:?}: {dr}");
        }
    }
}

/// What the fused product and LayerNorm refuses, on any device: N without an instantiation, K off whole steps of
/// 64, f32, the CPU, a residual or LayerNorm parameters that do not fit the output, mixed dtypes.
#[test]
fn fused_linear_norm_refuses_what_it_cannot_take() {
    let dev = gpu();
    let here = geglu_product_here(&dev);
    assert!(!linear_norm_on(&dev, DType::F16, 320, 640));
    assert!(!linear_norm_on(&dev, DType::F16, 320 + 32, 320));
    assert!(!linear_norm_on(&dev, DType::F32, 320, 320));
    assert!(!linear_norm_on(&Device::Cpu, DType::F16, 320, 320));
    let t = |shape: &[usize], dtype| Tensor::zeros(shape, dtype, &dev).unwrap();
    let (x, w, v) = (t(&[3, 128], DType::F16), t(&[320, 128], DType::F16), t(&[320], DType::F16));
    assert_eq!(linear_norm(&x, &w, &v, Some(&t(&[3, 320], DType::F16)), &v, &v, 1e-5).is_ok(), here);
    assert!(linear_norm(
        &x,
        &t(&[640, 128], DType::F16),
        &t(&[640], DType::F16),
        None,
        &t(&[640], DType::F16),
        &t(&[640], DType::F16),
        1e-5
    )
    .is_err());
    assert!(
        linear_norm(&t(&[3, 96], DType::F16), &t(&[320, 96], DType::F16), &v, None, &v, &v, 1e-5).is_err()
    );
    assert!(linear_norm(&t(&[3, 64], DType::F16), &w, &v, None, &v, &v, 1e-5).is_err());
    assert!(linear_norm(&x, &w, &v, Some(&t(&[4, 320], DType::F16)), &v, &v, 1e-5).is_err());
    assert!(linear_norm(&x, &w, &v, None, &t(&[160], DType::F16), &v, 1e-5).is_err());
    assert!(linear_norm(&x, &w, &v, None, &v, &t(&[320], DType::BF16), 1e-5).is_err());
    let f = |t: &Tensor| t.to_dtype(DType::F32).unwrap();
    assert!(linear_norm(&f(&x), &f(&w), &f(&v), None, &f(&v), &f(&v), 1e-5).is_err());
    let cpu = |t: &Tensor| t.to_device(&Device::Cpu).unwrap();
    assert!(linear_norm(&cpu(&x), &cpu(&w), &cpu(&v), None, &cpu(&v), &cpu(&v), 1e-5).is_err());
}

#[test]
fn other_devices_and_layouts_do_not_apply() {
    let cpu = Tensor::zeros((2, 4), DType::F32, &Device::Cpu).unwrap();
    assert!(!applies(&[&cpu]));
    let g = Tensor::zeros((4, 6), DType::F32, &gpu()).unwrap();
    assert!(applies(&[&g]));
    assert!(!applies(&[&g.t().unwrap()]), "a transposed view is not contiguous");
    assert!(!applies(&[&g.to_dtype(DType::F64).unwrap()]));
}

#[test]
fn layer_norm_matches_the_reference() {
    let dev = gpu();
    // Rows of 768, 320 and 1280 values stay in `layer_norm`'s registers (1280 f32 values in `layer_norm_wide`'s);
    // 33 values are no whole 16-byte vectors; 2568 f16 values stay in `layer_norm_wide`'s registers (2568 f32
    // values do not); 4104 f16 values are more than either kernel's registers take.
    for (shape, offset) in [
        ((2, 77, 768), 0.0),
        ((3, 4096, 320), 0.0),
        ((1, 5, 1280), 200.0),
        ((2, 3, 33), 1.0),
        ((1, 3, 2568), 0.5),
        ((2, 3, 4104), 0.5),
    ] {
        let x = (Tensor::randn(0f32, 1.0, shape, &dev).unwrap() + offset).unwrap();
        let cols = x.dims()[x.rank() - 1];
        let w = Tensor::randn(1f32, 0.2, cols, &dev).unwrap();
        let b = Tensor::randn(0f32, 0.2, cols, &dev).unwrap();
        for dtype in DTYPES {
            let c = |t: &Tensor| t.to_dtype(dtype).unwrap();
            let xf = c(&x).to_dtype(DType::F64).unwrap();
            let mean = xf.mean_keepdim(D::Minus1).unwrap();
            let centered = xf.broadcast_sub(&mean).unwrap();
            let var = centered.sqr().unwrap().mean_keepdim(D::Minus1).unwrap();
            let want = centered
                .broadcast_div(&(var + 1e-5).unwrap().sqrt().unwrap())
                .unwrap()
                .broadcast_mul(&c(&w).to_dtype(DType::F64).unwrap())
                .unwrap()
                .broadcast_add(&c(&b).to_dtype(DType::F64).unwrap())
                .unwrap();
            let d = rel_diff(&layer_norm(&c(&x), &c(&w), &c(&b), 1e-5).unwrap(), &want);
            eprintln!("layer_norm {shape:?} +{offset} {dtype:?}: rel diff {d:.2e}");
            assert!(d <= tol(dtype), "layer_norm {shape:?} {dtype:?}: {d}");
        }
    }
}

#[test]
fn modulated_layer_norm_matches_the_modulation_it_replaces() {
    let dev = gpu();
    // SD3.5-medium's and -large's widths (1536 in `layer_norm`'s registers, 2432 f16 in `layer_norm_wide`'s, 2432
    // f32 past them), and a row that is no whole vector.
    for (b, s, d) in [(2, 333, 1536), (2, 64, 2432), (3, 5, 33)] {
        let x = Tensor::randn(0f32, 2.0, (b, s, d), &dev).unwrap();
        let scale = Tensor::randn(0f32, 0.5, (b, d), &dev).unwrap();
        let shift = Tensor::randn(0f32, 0.5, (b, d), &dev).unwrap();
        for dtype in DTYPES {
            let c = |t: &Tensor| t.to_dtype(dtype).unwrap();
            let weight = (c(&scale) + 1.0).unwrap();
            let f = |t: &Tensor| t.to_dtype(DType::F64).unwrap();
            let xf = f(&c(&x));
            let mean = xf.mean_keepdim(D::Minus1).unwrap();
            let centered = xf.broadcast_sub(&mean).unwrap();
            let var = centered.sqr().unwrap().mean_keepdim(D::Minus1).unwrap();
            let want = centered
                .broadcast_div(&(var + 1e-6).unwrap().sqrt().unwrap())
                .unwrap()
                .broadcast_mul(&f(&weight).unsqueeze(1).unwrap())
                .unwrap()
                .broadcast_add(&f(&c(&shift)).unsqueeze(1).unwrap())
                .unwrap();
            // shift and scale as the chunks of one modulation table they are in the network, read in place.
            let table = Tensor::cat(&[&c(&shift), &c(&scale), &c(&shift)], 1).unwrap();
            let (shift_rows, scale_rows) = (table.narrow(1, 0, d).unwrap(), table.narrow(1, d, d).unwrap());
            let got = modulated_layer_norm(&c(&x), &shift_rows, &scale_rows, 1e-6).unwrap();
            let diff = rel_diff(&got, &want);
            eprintln!("modulated_layer_norm ({b}, {s}, {d}) {dtype:?}: rel diff {diff:.2e}");
            assert!(diff <= tol(dtype), "modulated_layer_norm {dtype:?}: {diff}");
            let contiguous_rows = modulated_layer_norm(&c(&x), &c(&shift), &c(&scale), 1e-6).unwrap();
            assert_eq!(max_abs_diff(&got, &contiguous_rows), 0.0, "chunk rows {dtype:?}");
            // Each sample takes its own row: the second sample alone with its row gives the same values.
            let one = layer_norm(
                &c(&x).narrow(0, 1, 1).unwrap().contiguous().unwrap(),
                &weight.get(1).unwrap(),
                &c(&shift).get(1).unwrap(),
                1e-6,
            )
            .unwrap();
            assert_eq!(max_abs_diff(&got.narrow(0, 1, 1).unwrap(), &one), 0.0, "sample 1 {dtype:?}");
        }
    }
}

#[test]
fn rms_norm_per_head_rounds_as_diffusers() {
    let dev = gpu();
    for (shape, d) in [((2, 4429, 24 * 64), 64), ((1, 7, 3 * 40), 40), ((2, 3, 128), 128)] {
        let x = Tensor::randn(0f32, 3.0, shape, &dev).unwrap();
        let w = Tensor::randn(1f32, 0.3, d, &dev).unwrap();
        for dtype in DTYPES {
            let c = |t: &Tensor| t.to_dtype(dtype).unwrap();
            let (b, s, hd) = shape;
            // diffusers' RMSNorm: statistics and the division in f32, cast back, then the weight in `dtype`.
            let xf = c(&x).reshape((b, s, hd / d, d)).unwrap().to_dtype(DType::F32).unwrap();
            let var = xf.sqr().unwrap().mean_keepdim(D::Minus1).unwrap();
            let want = xf
                .broadcast_div(&(var + 1e-6).unwrap().sqrt().unwrap())
                .unwrap()
                .to_dtype(dtype)
                .unwrap()
                .broadcast_mul(&c(&w))
                .unwrap()
                .reshape(shape)
                .unwrap();
            let got = rms_norm(&c(&x), &c(&w), 1e-6).unwrap();
            let diff = rel_diff(&got, &want);
            eprintln!("rms_norm {shape:?} d{d} {dtype:?}: rel diff {diff:.2e}");
            // rsqrt against sqrt-then-divide: one rounding step of `dtype` at most.
            assert!(diff <= tol(dtype), "rms_norm {shape:?} {dtype:?}: {diff}");
        }
    }
    assert!(rms_norm(
        &Tensor::zeros((2, 3, 10), DType::F32, &dev).unwrap(),
        &Tensor::ones(4, DType::F32, &dev).unwrap(),
        1e-6
    )
    .is_err());
}

/// The joint query/key/value of an MMDiT attention: each sample's image rows then its context rows, exactly the
/// concatenation without norms, and each stream's rows through its own RMSNorm (as `rms_norm_per_head_rounds_as_
/// diffusers` checks it) with them.
#[test]
fn joint_rows_concatenate_and_normalise_each_stream() {
    let dev = gpu();
    for (sa, sb, heads, d) in [(4096, 333, 24, 64), (5, 7, 2, 128), (9, 1, 4, 32)] {
        let a = Tensor::randn(0f32, 3.0, (2, sa, heads * d), &dev).unwrap();
        let b = Tensor::randn(0f32, 3.0, (2, sb, heads * d), &dev).unwrap();
        let wa = Tensor::randn(1f32, 0.3, d, &dev).unwrap();
        let wb = Tensor::randn(1f32, 0.3, d, &dev).unwrap();
        for dtype in DTYPES {
            let c = |t: &Tensor| t.to_dtype(dtype).unwrap();
            let plain = joint_rows(&c(&a), &c(&b), None, d, 1e-6).unwrap().expect("the kernel takes these");
            let cat = Tensor::cat(&[&c(&a), &c(&b)], 1).unwrap();
            assert_eq!(max_abs_diff(&plain, &cat), 0.0, "joint rows ({sa}+{sb}, {heads}x{d}) {dtype:?}");
            let reference = |x: &Tensor, w: &Tensor, s: usize| {
                let xf = c(x).reshape((2, s, heads, d)).unwrap().to_dtype(DType::F32).unwrap();
                let var = xf.sqr().unwrap().mean_keepdim(D::Minus1).unwrap();
                xf.broadcast_div(&(var + 1e-6).unwrap().sqrt().unwrap())
                    .unwrap()
                    .to_dtype(dtype)
                    .unwrap()
                    .broadcast_mul(&c(w))
                    .unwrap()
                    .reshape((2, s, heads * d))
                    .unwrap()
            };
            let want = Tensor::cat(&[&reference(&a, &wa, sa), &reference(&b, &wb, sb)], 1).unwrap();
            let normed = joint_rows(&c(&a), &c(&b), Some((&c(&wa), &c(&wb))), d, 1e-6).unwrap().unwrap();
            let diff = rel_diff(&normed, &want);
            eprintln!("joint rows normed ({sa}+{sb}, {heads}x{d}) {dtype:?}: rel diff {diff:.2e}");
            assert!(diff <= tol(dtype), "joint rows normed {dtype:?}: {diff}");
            // Read in place as the middle third of stacked q/k/v rows: the same bits, with and without norms
            // (the plain per-head RMSNorm too).
            let stacked =
                |x: &Tensor| Tensor::cat(&[&c(x).affine(0.5, 1.0).unwrap(), &c(x), &c(x)], 2).unwrap();
            let (sa_rows, sb_rows) = (stacked(&a), stacked(&b));
            let middle = |t: &Tensor| t.narrow(2, heads * d, heads * d).unwrap();
            let (am, bm) = (middle(&sa_rows), middle(&sb_rows));
            let plain_in_place = joint_rows(&am, &bm, None, d, 1e-6).unwrap().expect("strided rows");
            assert_eq!(max_abs_diff(&plain_in_place, &plain), 0.0, "joint rows in place {dtype:?}");
            let normed_in_place = joint_rows(&am, &bm, Some((&c(&wa), &c(&wb))), d, 1e-6).unwrap().unwrap();
            assert_eq!(max_abs_diff(&normed_in_place, &normed), 0.0, "normed joint rows in place {dtype:?}");
            let alone = rms_norm(&am, &c(&wa), 1e-6).unwrap();
            assert_eq!(max_abs_diff(&alone, &rms_norm(&c(&a), &c(&wa), 1e-6).unwrap()), 0.0);
        }
    }
    // A head of 40 values is no power-of-two count of vectors: the caller composes it.
    let x = Tensor::zeros((2, 3, 80), DType::F16, &dev).unwrap();
    assert!(joint_rows(&x, &x, None, 40, 1e-6).unwrap().is_none());
}

#[test]
fn gated_add_matches_the_broadcast_ops() {
    let dev = gpu();
    for (b, s, d) in [(2, 4096, 1536), (2, 333, 2432), (3, 5, 7)] {
        let x = Tensor::randn(0f32, 1.0, (b, s, d), &dev).unwrap();
        let y = Tensor::randn(0f32, 1.0, (b, s, d), &dev).unwrap();
        let g = Tensor::randn(0f32, 1.0, (b, d), &dev).unwrap();
        for dtype in DTYPES {
            let c = |t: &Tensor| t.to_dtype(dtype).unwrap();
            let f = |t: &Tensor| t.to_dtype(DType::F64).unwrap();
            let want =
                (f(&c(&x)) + f(&c(&y)).broadcast_mul(&f(&c(&g)).unsqueeze(1).unwrap()).unwrap()).unwrap();
            let got = gated_add(&c(&x), &c(&g), &c(&y)).unwrap();
            let diff = rel_diff(&got, &want);
            eprintln!("gated_add ({b}, {s}, {d}) {dtype:?}: rel diff {diff:.2e}");
            assert!(diff <= tol(dtype), "gated_add {dtype:?}: {diff}");
            // The gate as the chunk of a modulation table it is in the network, read in place: the same values.
            let table = Tensor::cat(&[&c(&g), &c(&g), &c(&g)], 1).unwrap();
            let chunk = gated_add(&c(&x), &table.narrow(1, d, d).unwrap(), &c(&y)).unwrap();
            assert_eq!(max_abs_diff(&chunk, &got), 0.0, "gate chunk {dtype:?}");
        }
    }
    let dev_x = Tensor::zeros((2, 3, 4), DType::F32, &dev).unwrap();
    assert!(gated_add(&dev_x, &Tensor::zeros((2, 5), DType::F32, &dev).unwrap(), &dev_x).is_err());
}

type Dims4 = (usize, usize, usize, usize);

/// `ours(x, filter, stride, padding)` (NCHW in and out) against candle's f32 convolution of the same rounded values,
/// in every dtype: within 4× the dtype's tolerance.
fn check_conv(
    label: &str,
    cases: &[(Dims4, Dims4, usize, usize)],
    filter_std: f32,
    ours: impl Fn(&Tensor, &Tensor, usize, usize) -> Tensor,
) {
    let dev = gpu();
    for &(x_shape, w_shape, stride, pad) in cases {
        let x = Tensor::randn(0f32, 1.0, x_shape, &dev).unwrap();
        let w = Tensor::randn(0f32, filter_std, w_shape, &dev).unwrap();
        for dtype in DTYPES {
            let (xd, wd) = (x.to_dtype(dtype).unwrap(), w.to_dtype(dtype).unwrap());
            let want = xd
                .to_dtype(DType::F32)
                .unwrap()
                .conv2d(&wd.to_dtype(DType::F32).unwrap(), pad, stride, 1, 1)
                .unwrap();
            let got = ours(&xd, &wd, stride, pad);
            assert_eq!(got.dims(), want.dims());
            let d = rel_diff(&got, &want);
            eprintln!("{label} {x_shape:?} * {w_shape:?} s{stride} p{pad} {dtype:?}: rel diff {d:.2e}");
            assert!(d <= 4.0 * tol(dtype), "{label} {x_shape:?} {dtype:?}: {d}");
        }
    }
}

/// Every convolution shape of the networks: 3×3 padded, strided downsampling, 1×1, odd sizes.
#[test]
fn conv2d_matches_candle() {
    let cases = [
        ((2, 8, 17, 13), (16, 8, 3, 3), 1, 1),
        ((1, 6, 16, 16), (6, 6, 3, 3), 2, 1),
        ((2, 12, 9, 7), (5, 12, 1, 1), 1, 0),
        ((1, 4, 8, 8), (3, 4, 3, 3), 1, 0),
    ];
    check_conv("conv2d", &cases, 0.2, |x, w, stride, pad| conv2d(x, w, stride, pad).unwrap());
}

fn nhwc(x: &Tensor) -> Tensor {
    x.permute((0, 2, 3, 1)).unwrap().contiguous().unwrap()
}

/// Channels-last GroupNorm against the NCHW reference on the same values: groups of 4, 10, 40 and 80 channels
/// (runs shorter and longer than one 16-byte vector), many chunks per sample, an up block's 2560-channel input (one
/// pixel lane per block), and a large offset.
#[test]
fn channels_last_group_norm_matches_the_reference() {
    let dev = gpu();
    // Which of the two paths each case takes: every dtype must see both.
    let mut paths = std::collections::HashSet::new();
    for (shape, groups, offset) in [
        ((2, 320, 9, 7), 32, 0.0),
        ((1, 128, 64, 48), 32, 0.0),
        ((2, 1280, 4, 4), 32, 0.0),
        ((2, 2560, 8, 8), 32, 0.0),
        ((2, 64, 40, 40), 16, 300.0),
        // Two blocks per group in f16/bf16 (a cluster summing through distributed shared memory), the two
        // launches in f32.
        ((2, 1280, 32, 32), 32, 0.0),
        // The two launches in every dtype: a 64² map, SDXL's 128² map of two samples (16 slabs of 1024 pixels
        // per sample in f16), and the VAE's 4-channel groups (chunks of eight groups).
        ((2, 640, 64, 64), 32, 0.0),
        ((2, 320, 128, 128), 32, 0.0),
        ((1, 128, 96, 96), 32, 0.0),
        // Three channels per group: no whole 4-byte units in f16/bf16 (two launches), one launch in f32.
        ((1, 96, 6, 6), 32, 1.0),
    ] {
        let x = (Tensor::randn(0f32, 1.0, shape, &dev).unwrap() + offset).unwrap();
        let w = Tensor::randn(1f32, 0.2, shape.1, &dev).unwrap();
        let b = Tensor::randn(0f32, 0.2, shape.1, &dev).unwrap();
        for dtype in DTYPES {
            let (xd, wd, bd) =
                (x.to_dtype(dtype).unwrap(), w.to_dtype(dtype).unwrap(), b.to_dtype(dtype).unwrap());
            let xl = nhwc(&xd);
            assert!(channels_last_fits(&xl), "{shape:?} {dtype:?}");
            let one_launch = crate::cuda::group_norm_one_launch(
                shape.2 * shape.3,
                shape.1,
                groups,
                dtype.size_in_bytes(),
                crate::cuda::clusters_built(),
            );
            paths.insert((dtype, one_launch.is_some()));
            // With an offset of 300 one f32 input ulp is 3e-5 of the output's unit scale.
            let tol = tol(dtype) * if offset > 0.0 { 2.0 } else { 1.0 };
            for silu in [false, true] {
                let ours = group_norm_channels_last(&xl, None, &wd, &bd, groups, 1e-5, silu).unwrap();
                assert_eq!(ours.dims(), xl.dims());
                let want = nhwc(&group_norm_reference(&xd, &wd, &bd, groups, 1e-5, silu));
                let d = rel_diff(&ours, &want);
                eprintln!(
                    "group_norm channels-last {shape:?}/{groups} +{offset} {dtype:?} silu={silu}: rel diff {d:.2e}"
                );
                assert!(d <= tol, "group_norm channels-last {shape:?} {dtype:?} silu={silu}: {d}");
            }
        }
    }
    for dtype in DTYPES {
        assert!(paths.contains(&(dtype, true)) && paths.contains(&(dtype, false)), "{dtype:?}: {paths:?}");
    }
    // Wider than the shared-memory moments allow: refused, not run out of bounds.
    let wide = Tensor::zeros((1, 2, 2, 4104), DType::F16, &dev).unwrap();
    let ones = Tensor::ones(4104, DType::F16, &dev).unwrap();
    assert!(!channels_last_fits(&wide));
    assert!(group_norm_channels_last(&wide, None, &ones, &ones, 8, 1e-5, false).is_err());
}

/// The channels-last GroupNorm of `x + shift` (a per-sample, per-channel term: the time embedding), against the
/// reference on the sum, with a shift large against the values (it moves every group's mean).
#[test]
fn channels_last_group_norm_adds_its_shift_first() {
    let dev = gpu();
    // One launch each but the last two: the slab launches, then (21 MB in f16) the streaming ones.
    for (shape, groups) in [
        ((2, 320, 9, 7), 32),
        ((2, 640, 16, 16), 32),
        ((1, 1280, 4, 4), 32),
        ((2, 640, 64, 64), 32),
        ((2, 320, 128, 128), 32),
    ] {
        let x = Tensor::randn(0f32, 1.0, shape, &dev).unwrap();
        let shift = Tensor::randn(0f32, 3.0, (shape.0, shape.1), &dev).unwrap();
        let w = Tensor::randn(1f32, 0.2, shape.1, &dev).unwrap();
        let b = Tensor::randn(0f32, 0.2, shape.1, &dev).unwrap();
        for dtype in DTYPES {
            let c = |t: &Tensor| t.to_dtype(dtype).unwrap();
            let (xd, sd, wd, bd) = (c(&x), c(&shift), c(&w), c(&b));
            let sum = xd.broadcast_add(&sd.reshape((shape.0, shape.1, 1, 1)).unwrap()).unwrap();
            let want = nhwc(&group_norm_reference(&sum, &wd, &bd, groups, 1e-5, true));
            let ours = group_norm_channels_last(&nhwc(&xd), Some(&sd), &wd, &bd, groups, 1e-5, true).unwrap();
            let d = rel_diff(&ours, &want);
            eprintln!("group_norm channels-last + shift {shape:?} {dtype:?}: rel diff {d:.2e}");
            // The reference rounds x + shift to the storage type first; the kernel adds in f32.
            assert!(d <= 2.0 * tol(dtype), "group_norm + shift {shape:?} {dtype:?}: {d}");
            let unshifted = group_norm_channels_last(&nhwc(&xd), None, &wd, &bd, groups, 1e-5, true).unwrap();
            assert!(rel_diff(&unshifted, &want) > 0.05, "the shift must change {shape:?} {dtype:?}");
            // The same shift as columns of a wider table (the UNet's table of every ResNet's time projection):
            // rows 24 + C + 40 values apart, read in place, the same result to the bit.
            let pad = |n: usize| Tensor::zeros((shape.0, n), dtype, &dev).unwrap();
            let table = Tensor::cat(&[&pad(24), &sd, &pad(40)], 1).unwrap();
            let columns = table.narrow(1, 24, shape.1).unwrap();
            let strided =
                group_norm_channels_last(&nhwc(&xd), Some(&columns), &wd, &bd, groups, 1e-5, true).unwrap();
            assert_eq!(
                max_abs_diff(&strided, &ours),
                0.0,
                "group_norm + shift read from a table {shape:?} {dtype:?}"
            );
        }
    }
    // Weight, bias and shift that do not start on a 16-byte boundary (views into larger tensors).
    let x = Tensor::randn(0f32, 1.0, (2, 64, 5, 5), &dev).unwrap().to_dtype(DType::F16).unwrap();
    let wide = Tensor::randn(1f32, 0.2, 3 * 64 + 3, &dev).unwrap().to_dtype(DType::F16).unwrap();
    let (w, b) = (wide.narrow(0, 3, 64).unwrap(), wide.narrow(0, 67, 64).unwrap());
    let shifts = Tensor::randn(0f32, 1.0, (2, 65), &dev).unwrap().to_dtype(DType::F16).unwrap();
    let shift = shifts.narrow(1, 1, 64).unwrap();
    let sum = x.broadcast_add(&shift.reshape((2, 64, 1, 1)).unwrap()).unwrap();
    let want = nhwc(&group_norm_reference(&sum, &w, &b, 8, 1e-5, false));
    let ours = group_norm_channels_last(&nhwc(&x), Some(&shift), &w, &b, 8, 1e-5, false).unwrap();
    let d = rel_diff(&ours, &want);
    assert!(d <= 2.0 * tol(DType::F16), "group_norm + shift, unaligned operands: {d}");

    let x = Tensor::zeros((2, 4, 4, 64), DType::F16, &dev).unwrap();
    let ones = Tensor::ones(64, DType::F16, &dev).unwrap();
    let wrong = Tensor::zeros((1, 64), DType::F16, &dev).unwrap();
    assert!(group_norm_channels_last(&x, Some(&wrong), &ones, &ones, 8, 1e-5, false).is_err());
}

/// The NCHW ↔ channels-last transpose against candle's permute, on tile-aligned and ragged sizes.
#[test]
fn transpose_matches_permute() {
    let dev = gpu();
    for shape in [(2, 64, 96), (3, 37, 45), (1, 4, 4096)] {
        let x = Tensor::randn(0f32, 1.0, shape, &dev).unwrap();
        for dtype in DTYPES {
            let xd = x.to_dtype(dtype).unwrap();
            let ours = transpose_last2(&xd).unwrap();
            let want = xd.transpose(1, 2).unwrap().contiguous().unwrap();
            assert_eq!(ours.dims(), want.dims());
            assert_eq!(rel_diff(&ours, &want), 0.0, "transpose {shape:?} {dtype:?}");
        }
    }
}

/// The transposes at a network's edges: NCHW with a few channels to channels-last padded with zero channels, and
/// back taking the first channels of a wider map; against candle's pad, narrow and permute, exactly.
#[test]
fn padded_and_narrowed_transposes_match_candle() {
    let dev = gpu();
    for (b, c, hw, width) in [(2, 4, 4096, 8), (1, 3, 1000, 8), (2, 4, 33, 40)] {
        let x = Tensor::randn(0f32, 1.0, (b, c, hw), &dev).unwrap();
        for dtype in DTYPES {
            let xd = x.to_dtype(dtype).unwrap();
            let ours = transpose_last2_padded(&xd, width).unwrap();
            let want =
                xd.pad_with_zeros(1, 0, width - c).unwrap().transpose(1, 2).unwrap().contiguous().unwrap();
            assert_eq!(ours.dims(), want.dims());
            assert_eq!(rel_diff(&ours, &want), 0.0, "padded transpose {:?} to {width} {dtype:?}", (b, c, hw));
            let back = transpose_last2_narrow(&ours, c).unwrap();
            assert_eq!(back.dims(), xd.dims());
            assert_eq!(rel_diff(&back, &xd), 0.0, "narrowed transpose {:?} {dtype:?}", (b, c, hw));
        }
    }
    let x = Tensor::zeros((1, 8, 16), DType::F16, &dev).unwrap();
    assert!(transpose_last2_padded(&x, 4).is_err(), "padding to fewer rows");
    assert!(transpose_last2_narrow(&x, 17).is_err(), "taking more columns than there are");
}

/// Bias, per-sample term (the time embedding) and residual over channels-last maps; ×2 nearest upsampling.
#[test]
fn channels_last_adds_and_upsampling_match_candle() {
    let dev = gpu();
    let y = Tensor::randn(0f32, 1.0, (2, 5, 3, 64), &dev).unwrap();
    let bias = Tensor::randn(0f32, 1.0, (1, 64), &dev).unwrap();
    let per_sample = Tensor::randn(0f32, 1.0, (2, 64), &dev).unwrap();
    let residual = Tensor::randn(0f32, 1.0, (2, 5, 3, 64), &dev).unwrap();
    let x = Tensor::randn(0f32, 1.0, (2, 32, 5, 3), &dev).unwrap();
    for dtype in DTYPES {
        let c = |t: &Tensor| t.to_dtype(dtype).unwrap();
        let (y, r) = (c(&y), c(&residual));
        for add in [c(&bias), c(&per_sample)] {
            let want = y.broadcast_add(&add.reshape((add.dim(0).unwrap(), 1, 1, 64)).unwrap()).unwrap();
            let d = rel_diff(&add_bias_last(&y, &add, None).unwrap(), &want);
            assert!(d <= tol(dtype), "channels-last add {:?} {dtype:?}: {d}", add.dims());
            let d = rel_diff(&add_bias_last(&y, &add, Some(&r)).unwrap(), &(&want + &r).unwrap());
            assert!(d <= 2.0 * tol(dtype), "channels-last add + residual {:?} {dtype:?}: {d}", add.dims());
        }
        let xd = c(&x);
        let ours = upsample2x_channels_last(&nhwc(&xd)).unwrap();
        let want = nhwc(&xd.upsample_nearest2d(10, 6).unwrap());
        assert_eq!(ours.dims(), &[2, 10, 6, 32]);
        assert_eq!(rel_diff(&ours, &want), 0.0, "upsample channels-last {dtype:?}");
    }
}

/// The skip connections' concatenation moves bytes: exactly `Tensor::cat` on the channels, over one block and
/// over many; inputs that do not suit it are refused.
#[test]
fn channels_last_concat_is_cat() {
    let dev = gpu();
    for ((a, b), dims) in [((16, 8), (2, 3, 5)), ((320, 640), (2, 16, 16)), ((1280, 1280), (2, 8, 8))] {
        let (n, h, w) = dims;
        let x = Tensor::randn(0f32, 1.0, (n, h, w, a), &dev).unwrap();
        let y = Tensor::randn(0f32, 1.0, (n, h, w, b), &dev).unwrap();
        for dtype in DTYPES {
            let (x, y) = (x.to_dtype(dtype).unwrap(), y.to_dtype(dtype).unwrap());
            let ours = concat_channels_last(&x, &y).unwrap();
            assert_eq!(ours.dims(), &[n, h, w, a + b]);
            let want = Tensor::cat(&[&x, &y], 3).unwrap();
            assert_eq!(rel_diff(&ours, &want), 0.0, "concat {a}+{b} {dtype:?}");
        }
    }
    let x = Tensor::zeros((2, 3, 5, 16), DType::F16, &dev).unwrap();
    assert!(concat_channels_last(&x, &Tensor::zeros((2, 3, 4, 16), DType::F16, &dev).unwrap()).is_err());
    assert!(concat_channels_last(&x, &Tensor::zeros((2, 3, 5, 12), DType::F16, &dev).unwrap()).is_err());
    assert!(concat_channels_last(&x, &Tensor::zeros((2, 3, 5, 16), DType::F32, &dev).unwrap()).is_err());
}

/// A batch repeated whole moves bytes: exactly `Tensor::cat` of the copies, over one block and over many, from one
/// sample and from eight (the guided batch's shared latents); a batch that is no multiple of the input's and a
/// tail that is no whole vector are refused.
#[test]
fn repeat_batch_is_cat() {
    let dev = gpu();
    for (dims, batch) in
        [((1, 3, 8), 2), ((1, 4096, 320), 2), ((1, 77, 1280), 3), ((2, 3, 8), 4), ((8, 4096, 40), 16)]
    {
        let x = Tensor::randn(0f32, 1.0, dims, &dev).unwrap();
        for dtype in DTYPES {
            let x = x.to_dtype(dtype).unwrap();
            let ours = repeat_batch(&x, batch).unwrap();
            assert_eq!(ours.dims(), &[batch, dims.1, dims.2]);
            let want = Tensor::cat(&vec![&x; batch / dims.0], 0).unwrap();
            assert_eq!(rel_diff(&ours, &want), 0.0, "repeat {dims:?} to {batch} {dtype:?}");
        }
    }
    let odd = Tensor::zeros((1, 3, 5), DType::F16, &dev).unwrap();
    assert!(!repeat_fits(&odd));
    assert!(repeat_batch(&odd, 2).is_err());
    let two = Tensor::zeros((2, 3, 8), DType::F16, &dev).unwrap();
    assert!(repeat_fits(&two));
    assert!(repeat_batch(&two, 3).is_err(), "three is no whole number of copies of two");
    assert!(repeat_fits(&Tensor::zeros((1, 3, 8), DType::F16, &dev).unwrap()));
}

/// cuDNN in NHWC with KRSC filters against candle's NCHW convolution in f32: padded, strided, odd sizes, and the
/// channel counts of the networks' first layers.
#[cfg(feature = "cudnn")]
#[test]
fn channels_last_conv2d_matches_candle() {
    let cases = [
        ((2, 8, 17, 13), (16, 8, 3, 3), 1, 1),
        ((1, 32, 16, 16), (32, 32, 3, 3), 2, 1),
        ((1, 32, 17, 15), (32, 32, 3, 3), 2, 0),
        ((2, 320, 8, 8), (640, 320, 3, 3), 1, 1),
        ((1, 64, 7, 5), (32, 64, 3, 3), 1, 1),
    ];
    // The output back to NCHW for the comparison: the same values, so the same differences.
    let nchw = |t: Tensor| t.permute((0, 3, 1, 2)).unwrap().contiguous().unwrap();
    check_conv("conv2d channels-last", &cases, 0.1, |x, w, stride, pad| {
        nchw(conv2d_channels_last(&nhwc(x), &nhwc(w), stride, pad).unwrap())
    });
}

/// cuDNN's convolution with bias, and skip, in its epilogue against candle's NCHW convolution plus the adds in
/// f32: the networks' 3×3 convolutions (a ResNet's conv2 with its skip, conv_in's channels padded to 8, a strided
/// downsampler, odd sizes, SD1.5's 8² maps).
#[cfg(feature = "cudnn")]
#[test]
fn channels_last_conv2d_epilogue_matches_candle() {
    let dev = gpu();
    let nchw = |t: Tensor| t.permute((0, 3, 1, 2)).unwrap().contiguous().unwrap();
    for (x_shape, w_shape, stride, pad) in [
        ((2, 320, 16, 16), (320, 320, 3, 3), 1, 1),
        ((2, 8, 17, 13), (320, 8, 3, 3), 1, 1),
        ((2, 640, 9, 7), (640, 640, 3, 3), 2, 1),
        ((1, 32, 17, 15), (64, 32, 3, 3), 1, 0),
        ((2, 1280, 8, 8), (1280, 1280, 3, 3), 1, 1),
        ((1, 64, 5, 7), (32, 64, 3, 3), 1, 1),
    ] {
        let x = Tensor::randn(0f32, 1.0, x_shape, &dev).unwrap();
        let w = Tensor::randn(0f32, 0.05, w_shape, &dev).unwrap();
        let bias = Tensor::randn(0f32, 1.0, w_shape.0, &dev).unwrap();
        for dtype in DTYPES {
            let c = |t: &Tensor| t.to_dtype(dtype).unwrap();
            let (xd, wd, bd) = (c(&x), c(&w), c(&bias));
            let f = |t: &Tensor| t.to_dtype(DType::F32).unwrap();
            let conv = f(&xd).conv2d(&f(&wd), pad, stride, 1, 1).unwrap();
            let with_bias = conv.broadcast_add(&f(&bd).reshape((1, w_shape.0, 1, 1)).unwrap()).unwrap();
            let skip = c(&Tensor::randn(0f32, 1.0, with_bias.dims(), &dev).unwrap());
            let (xl, wl) = (nhwc(&xd), nhwc(&wd));
            for with_skip in [false, true] {
                let skip_l = with_skip.then(|| nhwc(&skip));
                let want = if with_skip { (&with_bias + f(&skip)).unwrap() } else { with_bias.clone() };
                let got =
                    nchw(conv2d_channels_last_epilogue(&xl, &wl, stride, pad, &bd, skip_l.as_ref()).unwrap());
                assert_eq!(got.dims(), want.dims());
                let d = rel_diff(&got, &want);
                eprintln!("conv2d epilogue {x_shape:?} * {w_shape:?} s{stride} p{pad} skip={with_skip} {dtype:?}: rel diff {d:.2e}");
                assert!(d <= 4.0 * tol(dtype), "conv2d epilogue {x_shape:?} skip={with_skip} {dtype:?}: {d}");
            }
        }
    }
}

/// Random q `(b, sq, c)`, k and v `(b, sk, c)` in f32, q and k times `amplitude` (6: logits large enough that
/// the running max must keep exp from overflowing).
fn random_qkv(
    dev: &Device,
    (b, sq, sk, c): (usize, usize, usize, usize),
    amplitude: f64,
) -> (Tensor, Tensor, Tensor) {
    let randn = |rows: usize| Tensor::randn(0f32, 1.0, (b, rows, c), dev).unwrap();
    ((randn(sq) * amplitude).unwrap(), (randn(sk) * amplitude).unwrap(), randn(sk))
}

/// q, k and v in `dtype`; `packed`: read in place as the thirds of one `(B, S, 3C)` projection (self-attention).
fn in_dtype((q, k, v): (&Tensor, &Tensor, &Tensor), dtype: DType, packed: bool) -> (Tensor, Tensor, Tensor) {
    let cv = |t: &Tensor| t.to_dtype(dtype).unwrap();
    if !packed {
        return (cv(q), cv(k), cv(v));
    }
    let c = q.dim(2).unwrap();
    let qkv = Tensor::cat(&[cv(q), cv(k), cv(v)], 2).unwrap();
    (qkv.narrow(2, 0, c).unwrap(), qkv.narrow(2, c, c).unwrap(), qkv.narrow(2, 2 * c, c).unwrap())
}

/// Plain attention in f32 from the same (rounded) inputs: split heads, scores, softmax, product, merge.
fn attention_reference(q: &Tensor, k: &Tensor, v: &Tensor, heads: usize, scale: f64) -> Tensor {
    let split = |t: &Tensor| {
        let (b, s, c) = t.dims3().unwrap();
        t.to_dtype(DType::F32)
            .unwrap()
            .reshape((b, s, heads, c / heads))
            .unwrap()
            .transpose(1, 2)
            .unwrap()
            .contiguous()
            .unwrap()
    };
    let (qh, kh, vh) = (split(q), split(k), split(v));
    let scores = (qh.matmul(&kh.t().unwrap()).unwrap() * scale).unwrap();
    let probs = candle_nn_free_softmax(&scores);
    let o = probs.matmul(&vh).unwrap();
    let (b, h, s, d) = o.dims4().unwrap();
    o.transpose(1, 2).unwrap().contiguous().unwrap().reshape((b, s, h * d)).unwrap()
}

fn candle_nn_free_softmax(x: &Tensor) -> Tensor {
    let max = x.max_keepdim(D::Minus1).unwrap();
    let e = x.broadcast_sub(&max).unwrap().exp().unwrap();
    e.broadcast_div(&e.sum_keepdim(D::Minus1).unwrap()).unwrap()
}

/// The networks' head layouts (SD1.5's 40/80/160, SDXL's 64) and the rest of the instantiations, query and key
/// counts off the blocks' row (64; 128 and 192 for the Hopper kernels, 32 for the key-split one that small grids
/// at heads of 160 take) and key-tile boundaries, cross-attention to 77 tokens, a single key, large logits (the
/// running max must keep exp from overflowing), and q/k/v read in place from one packed projection. On Hopper the
/// kernels' TMA instantiations (taken by default) must give exactly what their cp.async ones do: the same
/// products over the same values, the tiles only laid out otherwise.
#[test]
fn attention_matches_the_reference() {
    let dev = gpu();
    for (b, sq, sk, heads, d, amplitude, packed) in [
        (2, 300, 300, 8, 40, 1.0, false),
        (2, 200, 77, 8, 80, 1.0, false),
        (1, 130, 100, 2, 160, 1.0, false),
        (1, 64, 300, 2, 160, 1.0, true),
        (2, 300, 300, 8, 160, 1.0, false),
        (2, 257, 257, 10, 64, 1.0, true),
        (1, 64, 64, 3, 8, 1.0, false),
        (1, 70, 33, 2, 32, 1.0, false),
        (1, 65, 129, 4, 96, 1.0, true),
        (1, 100, 70, 2, 128, 1.0, false),
        (1, 90, 1, 2, 40, 1.0, false),
        (2, 128, 200, 2, 64, 6.0, false),
        (1, 129, 77, 8, 40, 6.0, true),
        (1, 300, 150, 4, 80, 6.0, true),
        (2, 50, 1, 2, 64, 1.0, false),
        (1, 129, 1000, 3, 40, 6.0, false),
        (1, 777, 1000, 3, 80, 6.0, false),
        (2, 1024, 1024, 8, 40, 1.0, true),
    ] {
        let c = heads * d;
        let (q, k, v) = if packed {
            // Self-attention on one (B, S, 3C) projection: three strided views.
            let qkv = Tensor::randn(0f32, 1.0, (b, sq, 3 * c), &dev).unwrap();
            (qkv.narrow(2, 0, c).unwrap(), qkv.narrow(2, c, c).unwrap(), qkv.narrow(2, 2 * c, c).unwrap())
        } else {
            (
                (Tensor::randn(0f32, 1.0, (b, sq, c), &dev).unwrap() * amplitude).unwrap(),
                (Tensor::randn(0f32, 1.0, (b, sk, c), &dev).unwrap() * amplitude).unwrap(),
                Tensor::randn(0f32, 1.0, (b, sk, c), &dev).unwrap(),
            )
        };
        let scale = 1.0 / (d as f64).sqrt();
        for dtype in [DType::F16, DType::BF16] {
            let (qd, kd, vd) = in_dtype((&q, &k, &v), dtype, packed);
            assert!(attention_applies(&qd, &kd, &vd, heads), "{b}x{sq}x{sk} h{heads} d{d} {dtype:?}");
            let want = attention_reference(&qd, &kd, &vd, heads, scale);
            // Our kernels alone, then whatever `attention` picks (cuDNN's for some shapes).
            let ours_only = Kernels { tma: crate::attention::tma_on(), cudnn: false };
            let ours = crate::attention::attention_with(&qd, &kd, &vd, heads, scale, ours_only).unwrap();
            let picked = attention(&qd, &kd, &vd, heads, scale).unwrap();
            assert_eq!(ours.dims(), &[b, sq, c]);
            assert_eq!(picked.dims(), &[b, sq, c]);
            let diff = rel_diff(&ours, &want);
            eprintln!(
                "attention b{b} sq{sq} sk{sk} h{heads} d{d} x{amplitude} packed {packed} {dtype:?}: rel diff {diff:.2e}"
            );
            assert!(diff <= tol(dtype), "attention d{d} sq{sq} sk{sk} {dtype:?}: {diff}");
            let diff = rel_diff(&picked, &want);
            assert!(diff <= tol(dtype), "attention as picked, d{d} sq{sq} sk{sk} {dtype:?}: {diff}");
            let cp_async_only = Kernels { tma: false, cudnn: false };
            let cp_async =
                crate::attention::attention_with(&qd, &kd, &vd, heads, scale, cp_async_only).unwrap();
            assert_eq!(
                max_abs_diff(&ours, &cp_async),
                0.0,
                "attention d{d} sq{sq} sk{sk} {dtype:?}: TMA and cp.async tiles differ"
            );
        }
    }
}

/// Up to 128 keys heads of 40, 64, 80 and 160 take the short-key kernel (all keys in shared memory, each warp
/// looping over query chunks): key counts around its 80-key tile (one, 77, 80, 81, 113, 128), query counts off its
/// 16- and 32-row chunks, large logits, and q strided (a third of a packed projection) with k and v the halves of
/// one (B, Sk, 2·H·D) projection, as the text context's k/v table.
#[test]
fn short_keys_take_the_cross_kernel_and_match_the_reference() {
    let dev = gpu();
    for (b, sq, sk, heads, d, amplitude, strided) in [
        (2, 333, 77, 8, 40, 1.0, false),
        (1, 1000, 128, 2, 40, 6.0, true),
        (1, 31, 1, 3, 40, 1.0, false),
        (2, 77, 1, 3, 64, 1.0, true),
        (1, 513, 81, 10, 64, 1.0, false),
        (2, 100, 80, 8, 80, 6.0, true),
        (1, 17, 77, 2, 80, 1.0, false),
        (2, 65, 77, 8, 160, 1.0, true),
        (1, 250, 113, 2, 160, 6.0, false),
    ] {
        let c = heads * d;
        let (q, k, v) = random_qkv(&dev, (b, sq, sk, c), amplitude);
        let scale = 1.0 / (d as f64).sqrt();
        for dtype in [DType::F16, DType::BF16] {
            let cv = |t: &Tensor| t.to_dtype(dtype).unwrap();
            let (qd, kd, vd) = if strided {
                let qp = Tensor::cat(&[cv(&q), cv(&q), cv(&q)], 2).unwrap();
                let kv = Tensor::cat(&[cv(&k), cv(&v)], 2).unwrap();
                (qp.narrow(2, c, c).unwrap(), kv.narrow(2, 0, c).unwrap(), kv.narrow(2, c, c).unwrap())
            } else {
                (cv(&q), cv(&k), cv(&v))
            };
            assert!(attention_applies(&qd, &kd, &vd, heads), "{b}x{sq}x{sk} h{heads} d{d} {dtype:?}");
            let stride = kd.layout().stride()[1];
            let kernel = attention_kernel_for_keys(&dev, d, sk, dtype, stride).unwrap();
            let sfx = if dtype == DType::F16 { "f16" } else { "bf16" };
            // Up to 80 keys its shared memory fits any device of compute capability 8.x.
            if sk <= 80 {
                assert_eq!(kernel, format!("cross_attention_d{d}_{sfx}"));
            }
            let want = attention_reference(&qd, &kd, &vd, heads, scale);
            let ours = attention(&qd, &kd, &vd, heads, scale).unwrap();
            assert_eq!(ours.dims(), &[b, sq, c]);
            let diff = rel_diff(&ours, &want);
            eprintln!(
                "{kernel} b{b} sq{sq} sk{sk} h{heads} x{amplitude} strided {strided}: rel diff {diff:.2e}"
            );
            assert!(diff <= tol(dtype), "short keys d{d} sq{sq} sk{sk} {dtype:?}: {diff}");
        }
    }
}

/// cuDNN's attention (cuDNN 9.13.1 and later) takes heads of 64 over more than 128 keys: SD3's joint attention
/// (q, k and v rows of the joint sequence read in place from wider rows, a key count off every tile), the MMDiT-X
/// image attention and SDXL's self-attention shapes, scaled down; within the kernels' tolerance of the reference,
/// and with `SDHIVE_CUDNN_ATTENTION` left on it must have planned them (an older cuDNN says so and is skipped).
#[cfg(feature = "cudnn")]
#[test]
fn cudnn_attention_takes_heads_of_64_and_matches_the_reference() {
    let dev = gpu();
    let before = crate::cudnn_attention::plans().0;
    for (b, sq, sk, heads, d, amplitude, strided) in [
        (2, 1029, 1029, 3, 64, 1.0, true),
        (2, 1024, 1024, 4, 64, 6.0, false),
        (1, 333, 700, 2, 64, 1.0, false),
        (2, 129, 129, 2, 64, 1.0, true),
    ] {
        let c = heads * d;
        let (q, k, v) = random_qkv(&dev, (b, sq, sk, c), amplitude);
        let scale = 1.0 / (d as f64).sqrt();
        for dtype in [DType::F16, DType::BF16] {
            let (qd, kd, vd) = in_dtype((&q, &k, &v), dtype, strided);
            assert!(crate::cudnn_attention::chosen(d, sk) || std::env::var("SDHIVE_CUDNN_ATTENTION").is_ok());
            let want = attention_reference(&qd, &kd, &vd, heads, scale);
            let got = attention(&qd, &kd, &vd, heads, scale).unwrap();
            let diff = rel_diff(&got, &want);
            eprintln!("cuDNN attention b{b} sq{sq} sk{sk} h{heads} strided {strided} {dtype:?}: rel diff {diff:.2e}");
            assert!(diff <= tol(dtype), "cuDNN attention sq{sq} sk{sk} {dtype:?}: {diff}");
        }
    }
    let (planned, refused) = crate::cudnn_attention::plans();
    eprintln!("cuDNN planned {} shapes; refused: {refused:?}", planned - before);
    if std::env::var("SDHIVE_CUDNN_ATTENTION").is_err() && refused.iter().all(|r| !r.contains("has no SDPA"))
    {
        assert_eq!(planned - before, 8, "cuDNN refused: {refused:?}");
    }
}

/// On a compute capability 9.0 device a build for 9.0 runs heads of 40, 64 and 80 on the Hopper (wgmma) kernels,
/// which the test above then checked against the reference at those heads; other heads, builds and devices, and
/// key rows too far apart for the Hopper kernels' 32-bit tile offsets, keep the mma.sync kernels.
#[test]
fn heads_of_40_64_and_80_take_the_hopper_kernels_on_hopper() {
    let dev = gpu();
    let Device::Cuda(cuda) = &dev else { panic!("not a CUDA device") };
    let hopper = crate::cuda::built_for() == 90
        && cuda.cuda_stream().context().compute_capability().unwrap() == (9, 0);
    for dtype in [DType::F16, DType::BF16] {
        let sfx = if dtype == DType::F16 { "f16" } else { "bf16" };
        // The TMA instantiations unless SDHIVE_ATTENTION_TMA=0.
        let tma = crate::attention::tma_on();
        for (d, padded) in [(40, 48), (64, 64), (80, 80)] {
            let want = if hopper && tma {
                format!("attention_wgmma_d{d}_tma_{sfx}")
            } else if hopper {
                format!("attention_wgmma_d{d}_{sfx}")
            } else {
                format!("flash_attention_d{padded}_{sfx}")
            };
            assert_eq!(attention_kernel(&dev, d, dtype, 3 * 8 * d).unwrap(), want);
            // Rows 2^26 elements apart overflow the Hopper tile loader's 32-bit offsets: mma.sync.
            let far = attention_kernel(&dev, d, dtype, 1 << 26).unwrap();
            assert_eq!(far, format!("flash_attention_d{padded}_{sfx}"));
        }
        let d160 = attention_kernel(&dev, 160, dtype, 3 * 8 * 160).unwrap();
        assert_eq!(d160, format!("flash_attention_d160_{sfx}"));
    }
    eprintln!("heads of 40 run {}", attention_kernel(&dev, 40, DType::F16, 3 * 320).unwrap());
}

/// Keys and values shared by the batch (a batch stride of 0, as a broadcast view has): the kernels read them in
/// place, the Hopper ones whether or not the driver takes such a stride in a tensor map (else their cp.async
/// twins run), heads of 40, 64 and 80.
#[test]
fn attention_reads_keys_shared_by_the_batch() {
    let dev = gpu();
    for (sq, sk, heads, d) in [(300, 300, 8, 40), (257, 200, 5, 64), (150, 300, 4, 80)] {
        let c = heads * d;
        let scale = 1.0 / (d as f64).sqrt();
        for dtype in [DType::F16, DType::BF16] {
            let r = |shape: (usize, usize, usize)| {
                Tensor::randn(0f32, 1.0, shape, &dev).unwrap().to_dtype(dtype).unwrap()
            };
            let q = r((2, sq, c));
            let (k1, v1) = (r((1, sk, c)), r((1, sk, c)));
            let (k, v) = (k1.broadcast_as((2, sk, c)).unwrap(), v1.broadcast_as((2, sk, c)).unwrap());
            assert_eq!(k.stride()[0], 0);
            assert!(attention_applies(&q, &k, &v, heads), "sq{sq} sk{sk} d{d} {dtype:?}");
            let want =
                attention_reference(&q, &k.contiguous().unwrap(), &v.contiguous().unwrap(), heads, scale);
            let ours = attention(&q, &k, &v, heads, scale).unwrap();
            let diff = rel_diff(&ours, &want);
            eprintln!(
                "attention with shared keys sq{sq} sk{sk} h{heads} d{d} {dtype:?}: rel diff {diff:.2e}"
            );
            assert!(diff <= tol(dtype), "shared keys d{d} {dtype:?}: {diff}");
        }
    }
}

/// The causal short-key kernel against the reference with its mask (scores above the diagonal at −∞): the CLIP
/// text encoders' (1, 77, 12·64) and SDXL's second encoder's 20 heads, a batch of two, a single token, 128 tokens
/// and large logits; and what it declines (cross-attention's unequal counts, more than 128 keys, heads of 40).
#[test]
fn causal_attention_matches_the_reference() {
    let dev = gpu();
    for (b, s, heads, amplitude) in
        [(1, 77, 12, 1.0), (2, 77, 20, 1.0), (1, 1, 12, 1.0), (1, 128, 4, 6.0), (2, 40, 2, 6.0)]
    {
        let c = heads * 64;
        let qkv = (Tensor::randn(0f32, 1.0, (b, s, 3 * c), &dev).unwrap() * amplitude).unwrap();
        let (q, k, v) =
            (qkv.narrow(2, 0, c).unwrap(), qkv.narrow(2, c, c).unwrap(), qkv.narrow(2, 2 * c, c).unwrap());
        let scale = 0.125;
        let mask: Vec<f32> =
            (0..s).flat_map(|i| (0..s).map(move |j| if j > i { f32::NEG_INFINITY } else { 0.0 })).collect();
        let mask = Tensor::from_vec(mask, (s, s), &dev).unwrap();
        for dtype in [DType::F16, DType::BF16] {
            let (qd, kd, vd) = in_dtype((&q, &k, &v), dtype, true);
            assert!(causal_attention_applies(&qd, &kd, &vd, heads), "b{b} s{s} h{heads} {dtype:?}");
            let split = |t: &Tensor| {
                t.to_dtype(DType::F32)
                    .unwrap()
                    .reshape((b, s, heads, 64))
                    .unwrap()
                    .transpose(1, 2)
                    .unwrap()
                    .contiguous()
                    .unwrap()
            };
            let scores = (split(&qd).matmul(&split(&kd).t().unwrap()).unwrap() * scale).unwrap();
            let probs = candle_nn_free_softmax(&scores.broadcast_add(&mask).unwrap());
            let want = probs.matmul(&split(&vd)).unwrap().transpose(1, 2).unwrap().contiguous().unwrap();
            let want = want.reshape((b, s, c)).unwrap();
            let got = causal_attention(&qd, &kd, &vd, heads, scale).unwrap();
            let diff = rel_diff(&got, &want);
            eprintln!("causal attention b{b} s{s} h{heads} x{amplitude} {dtype:?}: rel diff {diff:.2e}");
            assert!(diff <= tol(dtype), "causal attention b{b} s{s} {dtype:?}: {diff}");
            // Unmasked, the first row would see every key: the mask must have changed it.
            let plain = attention(&qd, &kd, &vd, heads, scale).unwrap();
            if s > 1 {
                assert!(max_abs_diff(&plain, &got) > 0.0, "the causal mask changed nothing");
            }
        }
    }
    let t = |shape: (usize, usize, usize)| Tensor::zeros(shape, DType::F16, &dev).unwrap();
    let (q, kv) = (t((1, 64, 768)), t((1, 77, 768)));
    assert!(!causal_attention_applies(&q, &kv, &kv, 12), "unequal query and key counts");
    let long = t((1, 200, 768));
    assert!(!causal_attention_applies(&long, &long, &long, 12), "more keys than the short-key kernel holds");
    let forty = t((1, 77, 320));
    assert!(!causal_attention_applies(&forty, &forty, &forty, 8), "heads of 40");
    assert!(causal_attention(&forty, &forty, &forty, 8, 1.0).is_err());
}

#[test]
fn attention_declines_what_it_cannot_take() {
    let dev = gpu();
    let t = |shape: (usize, usize, usize), dtype| Tensor::zeros(shape, dtype, &dev).unwrap();
    let x = t((1, 16, 512), DType::F16);
    // The VAE's single 512-wide head, f32, a head dimension that is not a multiple of 8, rows off 8-alignment.
    assert!(!attention_applies(&x, &x, &x, 1));
    let f = t((1, 16, 64), DType::F32);
    assert!(!attention_applies(&f, &f, &f, 1));
    let odd = t((1, 16, 60), DType::F16);
    assert!(!attention_applies(&odd, &odd, &odd, 6));
    let wide = t((1, 16, 70), DType::F16);
    let shifted = wide.narrow(2, 3, 64).unwrap();
    assert!(!attention_applies(&shifted, &shifted, &shifted, 1));
    assert!(attention(&shifted, &shifted, &shifted, 1, 1.0).is_err());
    let ok = t((1, 16, 64), DType::F16);
    assert!(attention_applies(&ok, &ok, &ok, 1));
    let cpu = Tensor::zeros((1, 16, 64), DType::F16, &Device::Cpu).unwrap();
    assert!(!attention_applies(&cpu, &cpu, &cpu, 1));
}

/// The cuBLASLt linear in every layout pair it takes, with and without bias and residual, against the f32
/// product of the same (rounded) inputs; sizes off every tile boundary, batch 1 and 2.
#[test]
fn linear_matches_the_reference() {
    let dev = gpu();
    for (b, s, k, n) in [(2, 37, 24, 40), (1, 5, 16, 8), (2, 64, 320, 320), (2, 77, 768, 320)] {
        let x = Tensor::randn(0f32, 1.0, (b, s, k), &dev).unwrap();
        let w = Tensor::randn(0f32, 0.1, (n, k), &dev).unwrap();
        let bias = Tensor::randn(0f32, 1.0, n, &dev).unwrap();
        let res = Tensor::randn(0f32, 1.0, (b, s, n), &dev).unwrap();
        for dtype in DTYPES {
            let cast = |t: &Tensor| t.to_dtype(dtype).unwrap();
            let f32_of = |t: &Tensor| t.to_dtype(DType::F32).unwrap();
            let (xd, wd, bd, rd) = (cast(&x), cast(&w), cast(&bias), cast(&res));
            let product = f32_of(&xd).broadcast_matmul(&f32_of(&wd).t().unwrap()).unwrap();
            for (with_bias, with_res) in [(false, false), (true, false), (false, true), (true, true)] {
                let mut want = product.clone();
                if with_bias {
                    want = want.broadcast_add(&f32_of(&bd)).unwrap();
                }
                if with_res {
                    want = (want + f32_of(&rd)).unwrap();
                }
                let bias = with_bias.then_some(&bd);
                let what =
                    format!("linear b{b} s{s} k{k} n{n} {dtype:?} bias {with_bias} residual {with_res}");
                let check = |ours: Tensor, want: &Tensor, layout: &str| {
                    assert_eq!(ours.dims(), want.dims(), "{what} {layout}");
                    let d = rel_diff(&ours, want);
                    eprintln!("{what} {layout}: rel diff {d:.2e}");
                    assert!(d <= 4.0 * tol(dtype), "{what} {layout}: {d}");
                };
                let r = with_res.then_some(&rd);
                check(linear(&xd, &wd, bias, r, Side::Tokens, Side::Tokens).unwrap(), &want, "tokens→tokens");
                if b == 1 {
                    let r2 = r.map(|r| r.squeeze(0).unwrap());
                    let ours =
                        linear(&xd.squeeze(0).unwrap(), &wd, bias, r2.as_ref(), Side::Tokens, Side::Tokens);
                    check(ours.unwrap(), &want.squeeze(0).unwrap(), "2-D tokens");
                }
                let x_cf = xd.transpose(1, 2).unwrap().contiguous().unwrap();
                let ours = linear(&x_cf, &wd, bias, r, Side::ChannelsFirst, Side::Tokens).unwrap();
                check(ours, &want, "channels-first→tokens");
                let want_cf = want.transpose(1, 2).unwrap().contiguous().unwrap();
                let r_cf = r.map(|r| r.transpose(1, 2).unwrap().contiguous().unwrap());
                let ours = linear(&xd, &wd, bias, r_cf.as_ref(), Side::Tokens, Side::ChannelsFirst).unwrap();
                check(ours, &want_cf, "tokens→channels-first");
            }
        }
    }
    let x = Tensor::zeros((2, 3, 4), DType::F16, &dev).unwrap();
    let w = Tensor::zeros((5, 4), DType::F16, &dev).unwrap();
    assert!(linear(&x, &w, None, None, Side::ChannelsFirst, Side::ChannelsFirst).is_err());
    assert!(
        linear(&x, &w.t().unwrap().contiguous().unwrap(), None, None, Side::Tokens, Side::Tokens).is_err()
    );
}

/// A stretch of each sample's longer token sequence (the joint attention's image or text rows, a narrow) is read in
/// place: the same values as the product of its contiguous copy, with bias and residual.
#[test]
fn linear_reads_a_narrow_of_each_samples_tokens_in_place() {
    let dev = gpu();
    let (b, total, k, n) = (2, 50, 64, 96);
    let x = Tensor::randn(0f32, 1.0, (b, total, k), &dev).unwrap();
    let w = Tensor::randn(0f32, 0.1, (n, k), &dev).unwrap();
    let bias = Tensor::randn(0f32, 1.0, n, &dev).unwrap();
    for dtype in DTYPES {
        let (xd, wd, bd) =
            (x.to_dtype(dtype).unwrap(), w.to_dtype(dtype).unwrap(), bias.to_dtype(dtype).unwrap());
        for (start, len) in [(0, 37), (37, 13)] {
            let part = xd.narrow(1, start, len).unwrap();
            assert!(!part.is_contiguous());
            let res = Tensor::randn(0f32, 1.0, (b, len, n), &dev).unwrap().to_dtype(dtype).unwrap();
            let copy = part.contiguous().unwrap();
            let want = linear(&copy, &wd, Some(&bd), Some(&res), Side::Tokens, Side::Tokens).unwrap();
            let got = linear(&part, &wd, Some(&bd), Some(&res), Side::Tokens, Side::Tokens).unwrap();
            let d = rel_diff(&got, &want);
            eprintln!("linear over rows {start}..{} {dtype:?}: rel diff {d:.2e}", start + len);
            assert!(d <= tol(dtype), "strided input {dtype:?}: {d}");
        }
        // One sample's stretch is one matrix.
        let one = xd.narrow(0, 1, 1).unwrap().narrow(1, 5, 20).unwrap();
        let want =
            linear(&one.contiguous().unwrap(), &wd, Some(&bd), None, Side::Tokens, Side::Tokens).unwrap();
        let got = linear(&one, &wd, Some(&bd), None, Side::Tokens, Side::Tokens).unwrap();
        assert!(rel_diff(&got, &want) <= tol(dtype), "one sample's rows {dtype:?}");
        // Into channels-first a strided input is refused rather than read wrongly.
        let part = xd.narrow(1, 0, 37).unwrap();
        assert!(linear(&part, &wd, None, None, Side::Tokens, Side::ChannelsFirst).is_err());
    }
}

/// The GELU epilogue is the tanh approximation candle's `gelu` computes (SD3's `gelu-approximate`), after the bias.
#[test]
fn linear_gelu_matches_the_product_then_gelu() {
    let dev = gpu();
    for (b, s, k, n) in [(2, 37, 24, 40), (2, 333, 64, 256)] {
        let x = Tensor::randn(0f32, 1.0, (b, s, k), &dev).unwrap();
        let w = Tensor::randn(0f32, 0.3, (n, k), &dev).unwrap();
        let bias = Tensor::randn(0f32, 1.0, n, &dev).unwrap();
        for dtype in DTYPES {
            let cast = |t: &Tensor| t.to_dtype(dtype).unwrap();
            let f32_of = |t: &Tensor| t.to_dtype(DType::F32).unwrap();
            let (xd, wd, bd) = (cast(&x), cast(&w), cast(&bias));
            let product = f32_of(&xd).broadcast_matmul(&f32_of(&wd).t().unwrap()).unwrap();
            for with_bias in [false, true] {
                let pre =
                    if with_bias { product.broadcast_add(&f32_of(&bd)).unwrap() } else { product.clone() };
                let want = pre.gelu().unwrap();
                let ours = linear_gelu(&xd, &wd, with_bias.then_some(&bd)).unwrap();
                let d = rel_diff(&ours, &want);
                eprintln!("linear_gelu b{b} s{s} k{k} n{n} {dtype:?} bias {with_bias}: rel diff {d:.2e}");
                assert!(d <= 4.0 * tol(dtype), "linear_gelu {dtype:?} bias {with_bias}: {d}");
                // The exact (erf) GELU differs by more than rounding: the check tells the two apart.
                if dtype == DType::F32 {
                    let erf = pre.gelu_erf().unwrap();
                    let apart = (&ours - &erf).unwrap().abs().unwrap().flatten_all().unwrap().max(0).unwrap();
                    assert!(apart.to_scalar::<f32>().unwrap() > 1e-4);
                }
            }
        }
    }
}

/// The cuBLASLt linear at SD1.5 UNet shapes where timing cuBLASLt's offers on the first call picks another
/// algorithm than the heuristic's first (on an H100 the 64² query projection, 320 → 320 over 8192 tokens): the
/// first call (which times the offers, then computes) and later ones give the same bits, and the reference's
/// values.
#[test]
fn tuned_linear_is_stable_and_matches_the_reference() {
    let dev = gpu();
    for (b, s, k, n, with_res) in
        [(2, 4096, 320, 320, false), (2, 256, 1280, 1280, true), (2, 1024, 640, 1920, false)]
    {
        let cast = |t: Tensor| t.to_dtype(DType::F16).unwrap();
        let x = cast(Tensor::randn(0f32, 1.0, (b, s, k), &dev).unwrap());
        let w = cast(Tensor::randn(0f32, 1.0 / (k as f32).sqrt(), (n, k), &dev).unwrap());
        let bias = cast(Tensor::randn(0f32, 0.5, n, &dev).unwrap());
        let res = with_res.then(|| cast(Tensor::randn(0f32, 1.0, (b, s, n), &dev).unwrap()));
        let f32_of = |t: &Tensor| t.to_dtype(DType::F32).unwrap();
        let mut want = f32_of(&x).broadcast_matmul(&f32_of(&w).t().unwrap()).unwrap();
        want = want.broadcast_add(&f32_of(&bias)).unwrap();
        if let Some(r) = &res {
            want = (want + f32_of(r)).unwrap();
        }
        let call = || linear(&x, &w, Some(&bias), res.as_ref(), Side::Tokens, Side::Tokens).unwrap();
        let (first, again) = (call(), call());
        let d = rel_diff(&first, &want);
        eprintln!("tuned linear b{b} s{s} k{k} n{n}: rel diff {d:.2e}");
        assert!(d <= 4.0 * tol(DType::F16), "tuned linear b{b} s{s} k{k} n{n}: {d}");
        assert_eq!(max_abs_diff(&first, &again), 0.0, "tuned linear b{b} s{s} k{k} n{n}: calls differ");
    }
}

/// Which channels-last GroupNorms take one launch, and how: the SD1.5 UNet's maps of 32² and less in f16, 32²·1280
/// as clusters of two blocks; not the 64² maps or SDXL's 128²·320 and 32²·2560 (the two launches are faster
/// there), and no group whose width is not whole 4-byte units.
#[test]
fn one_launch_group_norm_takes_the_groups_its_blocks_hold() {
    use crate::cuda::group_norm_one_launch as rule;
    assert_eq!(rule(4096, 320, 32, 2, true), None);
    assert_eq!(rule(4096, 640, 32, 2, true), None);
    assert_eq!(rule(16384, 320, 32, 2, true), None);
    assert_eq!(rule(1024, 320, 32, 2, true), Some((512, 1)));
    assert_eq!(rule(1024, 640, 32, 2, true), Some((1024, 1)));
    assert_eq!(rule(1024, 1280, 32, 2, true), Some((1024, 2)));
    assert_eq!(rule(1024, 2560, 32, 2, true), None, "21 pixels per thread of two blocks");
    assert_eq!(rule(64, 2560, 32, 2, true), Some((512, 1)));
    // f32 units are single values: twice the units of f16, so two blocks where f16 takes one.
    assert_eq!(rule(1024, 640, 32, 4, true), Some((1024, 2)));
    assert_eq!(rule(4096, 640, 32, 4, true), None);
    assert_eq!(rule(36, 96, 32, 2, true), None, "three f16 channels per group");
    assert_eq!(rule(36, 96, 32, 4, true), Some((512, 1)));
    assert_eq!(rule(4, 4100 * 32, 32, 2, true), None, "more units per pixel than threads");
    // A build for GPUs before sm_90 has no clusters: one block where it holds the group, else two launches.
    assert_eq!(rule(1024, 640, 32, 2, false), Some((1024, 1)));
    assert_eq!(rule(1024, 1280, 32, 2, false), None);
}

/// How the two-launch GroupNorm splits maps: chunks of whole groups at least 64 bytes per pixel where the channels
/// allow, enough slabs that a thread holds at most eight vectors and the moments launch has 256 blocks but at most
/// 64 per sample, and none where a chunk of whole groups needs more vectors than a block has threads.
#[test]
fn slab_group_norm_splits_maps_into_chunks_of_whole_groups() {
    use crate::cuda::{group_norm_slabs as plan, SlabPlan};
    // SD1.5's 64²·320 in f16: chunks of four groups (40 channels, 80 bytes); 16 slabs of 256 pixels.
    let p = SlabPlan { chunk: 40, slabs: 16, threads: 160, apply_blocks: 41, apply_threads: 128 };
    assert_eq!(plan(2, 4096, 320, 32, 2), Some(p));
    // The same map in f32: 20-channel chunks, twice as many, so 8 slabs fill the GPU.
    assert_eq!(plan(2, 4096, 320, 32, 4).map(|p| (p.chunk, p.slabs, p.threads)), Some((20, 8, 320)));
    // The VAE's 512²·128 (4 channels per group): chunks of eight groups (64 bytes); 64 slabs of 4096 pixels, each
    // taken in four steps of 1024.
    let p = SlabPlan { chunk: 32, slabs: 64, threads: 512, apply_blocks: 2048, apply_threads: 128 };
    assert_eq!(plan(1, 512 * 512, 128, 32, 2), Some(p));
    // 513 channels per group: a chunk of 4104 channels is 513 vectors, more than a block's 512 threads.
    assert_eq!(plan(1, 4, 4104, 8, 2), None);
    // A 4096² VAE map: 32768 normalisation blocks of 128 threads would do, 131072 exceed the grid: 512 threads.
    let huge = plan(1, 4096 * 4096, 128, 32, 2).unwrap();
    assert_eq!((huge.apply_threads, huge.apply_blocks), (512, 32768));
}

/// How the streaming GroupNorm takes maps: blocks of whole pixel rows (at least 256 threads' worth, whole warps),
/// about 256 moments blocks in all but at most 256 slabs a sample and a batch of pixels per thread, and nothing
/// where a row has more vectors than a moments block may have threads.
#[test]
fn rows_group_norm_splits_maps_into_slabs_of_whole_rows() {
    use crate::cuda::{group_norm_rows as plan, RowsPlan};
    // SD1.5's 64²·320 at batch 16 in f16: 40 vectors a row, six rows a block (240 threads, 256 launched).
    let p = RowsPlan { threads: 256, slabs: 16, per_block: 48, apply_blocks: 86 };
    assert_eq!(plan(16, 4096, 320, 2), Some(p));
    // The VAE's 512²·128 alone: 16 vectors a row, 256 slabs of 1024 pixels.
    let p = RowsPlan { threads: 256, slabs: 256, per_block: 128, apply_blocks: 2048 };
    assert_eq!(plan(1, 512 * 512, 128, 2), Some(p));
    // A small map: no more slabs than give each thread a batch of eight pixels.
    assert_eq!(plan(1, 64, 320, 2).map(|p| p.slabs), Some(2));
    // SDXL's widest map, 2560 channels: one row a block of 320 threads; f32 rows up to 4096 channels.
    assert_eq!(plan(2, 1024, 2560, 2).map(|p| (p.threads, p.per_block)), Some((320, 8)));
    assert_eq!(plan(2, 1024, 4096, 4).map(|p| p.threads), Some(1024));
    assert_eq!(plan(2, 1024, 4104, 2), None);
    assert_eq!(plan(0, 1024, 320, 2), None);
}

/// The cluster split-K convolution of 8×8 maps against candle's f32 NCHW convolution of the same (rounded) inputs
/// plus bias and skip: SD1.5's 8² shapes (1280 and 2560 input channels, one and two images), the four-split
/// instantiation (256 and 512 input channels), one 64-channel slice per split (320), f16 and bf16; the same call
/// twice gives the same bits (the partial sums are added in split order), and the channels-last epilogue entry
/// point takes this kernel for these shapes. On other devices and builds it must say it is off.
#[cfg(feature = "cudnn")]
#[test]
fn conv_splitk_matches_candle() {
    let dev = gpu();
    let here = geglu_product_here(&dev);
    assert_eq!(conv_splitk::on(&dev), here);
    if !here {
        eprintln!("not a compute capability 9.0 device with a build for it: the 8² convolution is off");
        return;
    }
    let nchw = |t: Tensor| t.permute((0, 3, 1, 2)).unwrap().contiguous().unwrap();
    for (n, c, k) in
        [(2, 1280, 1280), (1, 1280, 1280), (2, 2560, 1280), (2, 256, 64), (1, 512, 192), (2, 320, 128)]
    {
        let x = Tensor::randn(0f32, 1.0, (n, c, 8, 8), &dev).unwrap();
        let w = Tensor::randn(0f32, 1.0 / (9.0 * c as f32).sqrt(), (k, c, 3, 3), &dev).unwrap();
        let bias = Tensor::randn(0f32, 0.5, k, &dev).unwrap();
        let skip = Tensor::randn(0f32, 1.0, (n, k, 8, 8), &dev).unwrap();
        for dtype in [DType::F16, DType::BF16] {
            let cast = |t: &Tensor| t.to_dtype(dtype).unwrap();
            let f = |t: &Tensor| t.to_dtype(DType::F32).unwrap();
            let (xd, wd, bd, sd) = (cast(&x), cast(&w), cast(&bias), cast(&skip));
            let conv = f(&xd).conv2d(&f(&wd), 1, 1, 1, 1).unwrap();
            let with_bias = conv.broadcast_add(&f(&bd).reshape((1, k, 1, 1)).unwrap()).unwrap();
            let (xl, wl, sl) = (nhwc(&xd), nhwc(&wd), nhwc(&sd));
            for with_skip in [false, true] {
                let skip_l = with_skip.then_some(&sl);
                assert!(conv_splitk::takes(&xl, &wl, 1, 1, &bd, skip_l));
                let want = if with_skip { (&with_bias + f(&sd)).unwrap() } else { with_bias.clone() };
                let ours = conv_splitk::conv2d(&xl, &wl, &bd, skip_l).unwrap();
                assert_eq!(ours.dtype(), dtype);
                let d = rel_diff(&nchw(ours.clone()), &want);
                eprintln!("8² convolution n{n} c{c} k{k} skip={with_skip} {dtype:?}: rel diff {d:.2e}");
                assert!(
                    d <= 4.0 * tol(dtype),
                    "8² convolution n{n} c{c} k{k} skip={with_skip} {dtype:?}: {d}"
                );
                let again = conv_splitk::conv2d(&xl, &wl, &bd, skip_l).unwrap();
                assert_eq!(rel_diff(&again, &ours), 0.0, "the same call gives the same bits");
                let entry = conv2d_channels_last_epilogue(&xl, &wl, 1, 1, &bd, skip_l).unwrap();
                assert_eq!(rel_diff(&entry, &ours), 0.0, "the epilogue entry point runs this kernel");
            }
        }
    }
}

/// What the 8² convolution refuses: other map sizes, strides, paddings and filter sizes, three images, channel
/// counts no split divides, output channels off 64, f32, a bias or skip that does not fit, the CPU.
#[cfg(feature = "cudnn")]
#[test]
fn conv_splitk_refuses_what_it_cannot_take() {
    let dev = gpu();
    let here = geglu_product_here(&dev);
    let t = |shape: &[usize], dtype| Tensor::zeros(shape, dtype, &dev).unwrap();
    let h = DType::F16;
    let (x, w, b) = (t(&[2, 8, 8, 320], h), t(&[64, 3, 3, 320], h), t(&[64], h));
    assert_eq!(conv_splitk::takes(&x, &w, 1, 1, &b, None), here);
    assert_eq!(conv_splitk::conv2d(&x, &w, &b, None).is_ok(), here);
    let refused = |x: &Tensor, w: &Tensor, stride, pad, b: &Tensor, skip: Option<&Tensor>| {
        assert!(!conv_splitk::takes(x, w, stride, pad, b, skip), "{:?} * {:?}", x.dims(), w.dims());
        if (stride, pad) == (1, 1) {
            let err = conv_splitk::conv2d(x, w, b, skip).unwrap_err().to_string();
            assert!(err.contains("8² convolution"), "{err}");
        }
    };
    refused(&t(&[2, 16, 16, 320], h), &w, 1, 1, &b, None);
    refused(&x, &w, 2, 1, &b, None);
    refused(&x, &w, 1, 0, &b, None);
    refused(&x, &t(&[64, 1, 1, 320], h), 1, 1, &b, None);
    refused(&t(&[3, 8, 8, 320], h), &w, 1, 1, &b, None);
    refused(&t(&[2, 8, 8, 192], h), &t(&[64, 3, 3, 192], h), 1, 1, &b, None);
    refused(&x, &t(&[96, 3, 3, 320], h), 1, 1, &t(&[96], h), None);
    let f = |t: &Tensor| t.to_dtype(DType::F32).unwrap();
    refused(&f(&x), &f(&w), 1, 1, &f(&b), None);
    refused(&x, &w, 1, 1, &t(&[128], h), None);
    refused(&x, &w, 1, 1, &b, Some(&t(&[2, 8, 8, 128], h)));
    let cpu = |t: &Tensor| t.to_device(&Device::Cpu).unwrap();
    refused(&cpu(&x), &cpu(&w), 1, 1, &cpu(&b), None);
}

/// The edge convolutions against candle's f32 NCHW convolution of the same (rounded) operands plus bias: the last
/// one on SD1.5's UNet (64²·320 → 4, batch 2), the VAE decoder's (128 → 3) and encoder's (512 → 8) shapes and a
/// map one 16-pixel tile wide; the first one on the UNet's (4 → 320, batch 1 and 2) and the VAE decoder's
/// (4 → 512) shapes; f16 and bf16. Both must say they are off where the build is older than sm_80.
#[test]
fn edge_convolutions_match_candle() {
    let dev = gpu();
    let f = |t: &Tensor| t.to_dtype(DType::F32).unwrap();
    // candle's f32 convolution (NCHW, stride 1, padding 1) of the rounded operands, plus the bias.
    let reference = |x: &Tensor, w: &Tensor, b: &Tensor| {
        let k = b.dims()[0];
        f(x).conv2d(&f(w), 1, 1, 1, 1).unwrap().broadcast_add(&f(b).reshape((1, k, 1, 1)).unwrap()).unwrap()
    };
    for (n, c, k, h, w) in [(2, 320, 4, 64, 64), (1, 128, 3, 32, 64), (2, 512, 8, 16, 16), (1, 64, 1, 3, 16)]
    {
        let x = Tensor::randn(0f32, 1.0, (n, c, h, w), &dev).unwrap();
        let wt = Tensor::randn(0f32, 1.0 / (9.0 * c as f32).sqrt(), (k, c, 3, 3), &dev).unwrap();
        let bias = Tensor::randn(0f32, 0.5, k, &dev).unwrap();
        for dtype in [DType::F16, DType::BF16] {
            let cast = |t: &Tensor| t.to_dtype(dtype).unwrap();
            let (xd, wd, bd) = (cast(&x), cast(&wt), cast(&bias));
            let want = reference(&xd, &wd, &bd);
            // The network's padded operands: filter rows and bias past k are zeros.
            let wl = nhwc(&wd.pad_with_zeros(0, 0, 8 - k).unwrap());
            let bl = bd.pad_with_zeros(0, 0, 8 - k).unwrap();
            let xl = nhwc(&xd);
            let here = crate::cuda::built_for() >= 80;
            assert_eq!(edge_conv_out_applies(&xl, &wl, &bl, k), here);
            if !here {
                eprintln!("a build older than sm_80: the last edge convolution is off");
                continue;
            }
            let ours = edge_conv_out(&xl, &wl, &bl, k).unwrap();
            assert_eq!((ours.dims(), ours.dtype()), (&[n, k, h, w][..], dtype));
            let d = rel_diff(&ours, &want);
            eprintln!("last edge convolution n{n} c{c} k{k} {h}x{w} {dtype:?}: rel diff {d:.2e}");
            assert!(d <= 2.0 * tol(dtype), "last edge convolution n{n} c{c} k{k} {h}x{w} {dtype:?}: {d}");
        }
    }
    for (n, k, h, w) in [(1, 320, 64, 64), (2, 320, 64, 64), (1, 512, 32, 32), (1, 64, 5, 16)] {
        let x = Tensor::randn(0f32, 1.0, (n, 4, h, w), &dev).unwrap();
        let wt = Tensor::randn(0f32, 1.0 / 6.0, (k, 4, 3, 3), &dev).unwrap();
        let bias = Tensor::randn(0f32, 0.5, k, &dev).unwrap();
        for dtype in [DType::F16, DType::BF16] {
            let cast = |t: &Tensor| t.to_dtype(dtype).unwrap();
            let (xd, wd, bd) = (cast(&x), cast(&wt), cast(&bias));
            let want = reference(&xd, &wd, &bd);
            let wl = nhwc(&wd.pad_with_zeros(1, 0, 4).unwrap());
            assert!(edge_conv_in_applies(&xd, &wl, &bd));
            let ours = edge_conv_in(&xd, &wl, &bd).unwrap();
            assert_eq!((ours.dims(), ours.dtype()), (&[n, h, w, k][..], dtype));
            let d = rel_diff(&ours, &nhwc(&want));
            eprintln!("first edge convolution n{n} k{k} {h}x{w} {dtype:?}: rel diff {d:.2e}");
            assert!(d <= 2.0 * tol(dtype), "first edge convolution n{n} k{k} {h}x{w} {dtype:?}: {d}");
        }
    }
}

/// What the edge convolutions refuse, with an error naming the shape rather than a launch: other filter sizes,
/// channel counts and widths off their tiles, more than 8 output channels, an input of other than 4 channels,
/// f32, the CPU.
#[test]
fn edge_convolutions_refuse_what_they_cannot_take() {
    let dev = gpu();
    let h = DType::F16;
    let t = |shape: &[usize], dtype: DType, dev: &Device| Tensor::zeros(shape, dtype, dev).unwrap();
    let (x, w, b) = (t(&[1, 16, 16, 64], h, &dev), t(&[8, 3, 3, 64], h, &dev), t(&[8], h, &dev));
    let out_refused = |x: &Tensor, w: &Tensor, b: &Tensor, k: usize| {
        assert!(!edge_conv_out_applies(x, w, b, k), "{:?} * {:?} k {k}", x.dims(), w.dims());
        let err = edge_conv_out(x, w, b, k).unwrap_err().to_string();
        assert!(err.contains("edge convolution"), "{err}");
    };
    out_refused(&x, &t(&[8, 1, 1, 64], h, &dev), &b, 4);
    out_refused(&t(&[1, 16, 16, 48], h, &dev), &t(&[8, 3, 3, 48], h, &dev), &b, 4);
    out_refused(&t(&[1, 16, 24, 64], h, &dev), &w, &b, 4);
    out_refused(&x, &w, &b, 9);
    out_refused(&x, &w, &b, 0);
    out_refused(&x, &t(&[16, 3, 3, 64], h, &dev), &t(&[16], h, &dev), 4);
    let f32s = |t: &Tensor| t.to_dtype(DType::F32).unwrap();
    out_refused(&f32s(&x), &f32s(&w), &f32s(&b), 4);
    out_refused(
        &x.to_device(&Device::Cpu).unwrap(),
        &w.to_device(&Device::Cpu).unwrap(),
        &b.to_device(&Device::Cpu).unwrap(),
        4,
    );

    let (xi, wi, bi) = (t(&[1, 4, 8, 32], h, &dev), t(&[64, 3, 3, 8], h, &dev), t(&[64], h, &dev));
    assert!(edge_conv_in_applies(&xi, &wi, &bi));
    let in_refused = |x: &Tensor, w: &Tensor, b: &Tensor| {
        assert!(!edge_conv_in_applies(x, w, b), "{:?} * {:?}", x.dims(), w.dims());
        let err = edge_conv_in(x, w, b).unwrap_err().to_string();
        assert!(err.contains("edge convolution"), "{err}");
    };
    in_refused(&t(&[1, 3, 8, 32], h, &dev), &wi, &bi);
    in_refused(&t(&[1, 4, 8, 24], h, &dev), &wi, &bi);
    in_refused(&xi, &t(&[63, 3, 3, 8], h, &dev), &t(&[63], h, &dev));
    in_refused(&xi, &wi, &t(&[32], h, &dev));
    in_refused(&f32s(&xi), &f32s(&wi), &f32s(&bi));
}

/// The GroupNorm of two maps joined along their channels, read in place, against the concatenation kernel then
/// the GroupNorm of the join: the same bits for the normalised join and the join itself, on the up path's shapes
/// (8² and 16² maps of 2560 and 1920 channels through the one-launch kernel, groups straddling the seam in the
/// latter; 32² of 1920 through the two-block cluster; 64² of 960 and 640 through the slab launches, SDXL's 128²
/// of 640 through the streaming ones), f16 and bf16; maps that do not match are refused with an error.
#[test]
fn joined_group_norm_matches_concat_then_norm() {
    let dev = gpu();
    for (hw, ca, cb) in [
        (8, 1280, 1280),
        (16, 1280, 640),
        (16, 1280, 1280),
        (32, 1280, 640),
        (64, 640, 320),
        (64, 320, 320),
        (128, 320, 320),
    ] {
        let a = Tensor::randn(0.3f32, 1.5, (2, hw, hw, ca), &dev).unwrap();
        let b = Tensor::randn(-0.2f32, 0.7, (2, hw, hw, cb), &dev).unwrap();
        let w = Tensor::randn(1f32, 0.2, ca + cb, &dev).unwrap();
        let bias = Tensor::randn(0f32, 0.2, ca + cb, &dev).unwrap();
        for dtype in [DType::F16, DType::BF16] {
            let cast = |t: &Tensor| t.to_dtype(dtype).unwrap();
            let (a, b, w, bias) = (cast(&a), cast(&b), cast(&w), cast(&bias));
            assert!(group_norm_joined_applies(&a, &b));
            let cat = concat_channels_last(&a, &b).unwrap();
            let want = group_norm_channels_last(&cat, None, &w, &bias, 32, 1e-5, true).unwrap();
            let (normed, joined) =
                group_norm_channels_last_joined(&a, &b, &w, &bias, 32, 1e-5, true).unwrap();
            assert_eq!(joined.dims(), cat.dims());
            assert_eq!(rel_diff(&joined, &cat), 0.0, "{hw}² {ca}+{cb} {dtype:?}: the join");
            assert_eq!(rel_diff(&normed, &want), 0.0, "{hw}² {ca}+{cb} {dtype:?}: the normalised join");
            assert!(normed.is_contiguous() && joined.is_contiguous());
        }
    }
    let t = |shape: &[usize]| Tensor::zeros(shape, DType::F16, &dev).unwrap();
    let (w, bias) = (t(&[640]), t(&[640]));
    assert!(!group_norm_joined_applies(&t(&[2, 8, 8, 320]), &t(&[2, 8, 16, 320])));
    assert!(!group_norm_joined_applies(&t(&[2, 8, 8, 320]), &t(&[1, 8, 8, 320])));
    let err =
        group_norm_channels_last_joined(&t(&[2, 8, 8, 320]), &t(&[2, 8, 16, 320]), &w, &bias, 32, 1e-5, true)
            .unwrap_err()
            .to_string();
    assert!(err.contains("cannot join"), "{err}");
}

/// As the workers run the GPU: one stream with cudarc's event tracking off (`shared_worker::single_stream`), where a
/// page-locked buffer's own event is never recorded. A copy queued behind long work must still be waited for: read
/// at once, the values are those the tensor has once the work before it is done.
#[test]
fn readbacks_wait_for_their_copy_without_event_tracking() {
    let dev = Device::new_cuda(0).unwrap();
    let Device::Cuda(d) = &dev else { unreachable!() };
    // SAFETY: everything this test does on the device goes through candle's one stream.
    unsafe { d.disable_event_tracking() };
    let big = Tensor::randn(0f32, 1.0, (4096, 4096), &dev).unwrap();
    for round in 0..3 {
        // About 40 ms of products queued before the tensor the copy reads.
        let mut acc = big.clone();
        for _ in 0..30 {
            acc = (acc.matmul(&big).unwrap() * 1e-3).unwrap();
        }
        let late = (acc.narrow(0, 0, 64).unwrap().narrow(1, 0, 64).unwrap().contiguous().unwrap() * 0.0)
            .unwrap()
            .affine(1.0, 7.0 + round as f64)
            .unwrap();
        let bytes = late.clamp(0f32, 255f32).unwrap().to_dtype(DType::U8).unwrap();
        let values = start_readback::<f32>(&late).unwrap().values().unwrap();
        let read = start_readback::<u8>(&bytes).unwrap().values().unwrap();
        assert!(
            values.iter().all(|&v| v == 7.0 + round as f32),
            "round {round}: f32 read before its copy landed"
        );
        assert!(
            read.iter().all(|&v| u32::from(v) == 7 + round),
            "round {round}: bytes read before their copy landed"
        );
    }
}

#[test]
fn readbacks_land_the_values_the_tensor_had_when_queued() {
    let dev = gpu();
    let x = Tensor::randn(0f32, 1.0, (2, 4, 8, 8), &dev).unwrap();
    // A strided view (made contiguous on the device first) and bytes.
    let view = x.get(1).unwrap().transpose(1, 2).unwrap();
    let made =
        ((x.get(0).unwrap() * 40.0).unwrap().clamp(0f32, 255f32).unwrap()).to_dtype(DType::U8).unwrap();
    let want_view = view.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    let want_bytes = made.flatten_all().unwrap().to_vec1::<u8>().unwrap();
    for round in 0..3 {
        let bytes = made.copy().unwrap();
        let queued = start_readback::<f32>(&view).unwrap();
        let queued_bytes = start_readback::<u8>(&bytes).unwrap();
        assert!(queued.is_queued() && queued_bytes.is_queued());
        // Work queued after the copies (a larger product, then the bytes overwritten in place) does not reach
        // what they read: the stream runs the copies first.
        let big = Tensor::randn(0f32, 1.0, (1024, 1024), &dev).unwrap();
        let _ = big.matmul(&big).unwrap();
        bytes.slice_set(&bytes.zeros_like().unwrap(), 0, 0).unwrap();
        assert_eq!(queued.values().unwrap(), want_view, "round {round}");
        assert_eq!(queued_bytes.values().unwrap(), want_bytes, "round {round}");
    }
    // Another size takes another buffer.
    let small = x.narrow(3, 0, 3).unwrap();
    let want = small.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    assert_eq!(start_readback::<f32>(&small).unwrap().values().unwrap(), want);
    // A CPU tensor is read at once.
    let cpu = x.to_device(&Device::Cpu).unwrap();
    let ready = start_readback::<f32>(&cpu).unwrap();
    assert!(!ready.is_queued());
    assert_eq!(ready.values().unwrap(), x.flatten_all().unwrap().to_vec1::<f32>().unwrap());
}
