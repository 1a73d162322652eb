//! ggml's devices as the stable-diffusion.cpp engine sees them: enumeration (name such as `Vulkan0`, description,
//! memory), opening one by backend prefix and index, and the start-up check that the device really computes — a
//! matrix product on it compared with the same product on the CPU — so a broken driver or a silent CPU device
//! never passes for a GPU.

use diffusion_rs_sys as sys;
use std::ffi::CStr;
use thiserror::Error;

/// The kind ggml reports for a device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceKind {
    Cpu,
    Gpu,
    IntegratedGpu,
    Accelerator,
}

/// One device of ggml's registry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GgmlDevice {
    /// ggml's name, which stable-diffusion.cpp's backend assignment takes (`Vulkan0`, `ROCm1`, `CPU`).
    pub name: String,
    /// The device's own name (`NVIDIA H100 80GB HBM3`, `llvmpipe (LLVM 15.0.7, 256 bits)`).
    pub description: String,
    pub kind: DeviceKind,
    pub memory_total_bytes: u64,
    pub memory_free_bytes: u64,
}

#[derive(Debug, Error)]
pub enum GgmlDeviceError {
    #[error("there is no {prefix} device {index}; ggml found: {found}")]
    NoSuchDevice { prefix: String, index: usize, found: String },
    #[error("{device}: ggml could not start it")]
    Init { device: String },
    #[error("{device}: the start-up matrix product failed: {message}")]
    Verification { device: String, message: String },
}

fn kind_of(t: sys::ggml_backend_dev_type) -> DeviceKind {
    match t {
        sys::ggml_backend_dev_type::GGML_BACKEND_DEVICE_TYPE_CPU => DeviceKind::Cpu,
        sys::ggml_backend_dev_type::GGML_BACKEND_DEVICE_TYPE_GPU => DeviceKind::Gpu,
        sys::ggml_backend_dev_type::GGML_BACKEND_DEVICE_TYPE_IGPU => DeviceKind::IntegratedGpu,
        _ => DeviceKind::Accelerator,
    }
}

fn describe(dev: sys::ggml_backend_dev_t) -> GgmlDevice {
    // SAFETY: `dev` comes from ggml's registry, which lives for the whole process; the strings it returns are
    // owned by the device and NUL-terminated.
    unsafe {
        let text = |p: *const std::os::raw::c_char| {
            if p.is_null() {
                String::new()
            } else {
                CStr::from_ptr(p).to_string_lossy().into_owned()
            }
        };
        let (mut free, mut total) = (0usize, 0usize);
        sys::ggml_backend_dev_memory(dev, &mut free, &mut total);
        GgmlDevice {
            name: text(sys::ggml_backend_dev_name(dev)),
            description: text(sys::ggml_backend_dev_description(dev)),
            kind: kind_of(sys::ggml_backend_dev_type(dev)),
            memory_total_bytes: total as u64,
            memory_free_bytes: free as u64,
        }
    }
}

fn registry() -> Vec<(sys::ggml_backend_dev_t, GgmlDevice)> {
    // SAFETY: plain registry queries; indexes stay below the count ggml reports.
    unsafe {
        (0..sys::ggml_backend_dev_count())
            .map(|i| sys::ggml_backend_dev_get(i))
            .filter(|d| !d.is_null())
            .map(|d| (d, describe(d)))
            .collect()
    }
}

/// Every device compiled into this build that ggml can see (the CPU always among them).
pub fn list() -> Vec<GgmlDevice> {
    registry().into_iter().map(|(_, d)| d).collect()
}

/// The device ggml calls `name` (`Vulkan0`), as it is now (free memory changes).
pub fn find(name: &str) -> Option<GgmlDevice> {
    list().into_iter().find(|d| d.name.eq_ignore_ascii_case(name))
}

/// Device `index` of the backend whose ggml names start with `prefix` (`Vulkan`, `ROCm`), checked with a
/// matrix product. Never returns a CPU device.
pub fn open(prefix: &str, index: usize) -> Result<GgmlDevice, GgmlDeviceError> {
    let wanted = format!("{prefix}{index}");
    let all = registry();
    let Some((dev, info)) =
        all.iter().find(|(_, d)| d.name.eq_ignore_ascii_case(&wanted) && d.kind != DeviceKind::Cpu)
    else {
        let found = all.iter().map(|(_, d)| format!("{} ({})", d.name, d.description)).collect::<Vec<_>>();
        return Err(GgmlDeviceError::NoSuchDevice {
            prefix: prefix.to_string(),
            index,
            found: if found.is_empty() { "nothing".into() } else { found.join(", ") },
        });
    };
    verify(*dev, &info.name)?;
    Ok(info.clone())
}

/// Dimensions of the check: odd sizes, so no kernel gets by on a tile-multiple fast path alone.
const K: usize = 257;
const M: usize = 193;
const N: usize = 161;

/// Deterministic inputs in [-1, 1).
fn inputs() -> (Vec<f32>, Vec<f32>) {
    let mut state = 0x2545_F491_4F6C_DD1Du64;
    let mut next = || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        ((state >> 40) as f32) / (1u64 << 23) as f32 - 1.0
    };
    let a = (0..K * M).map(|_| next()).collect();
    let b = (0..K * N).map(|_| next()).collect();
    (a, b)
}

/// ggml's `mul_mat(a, b)` with `a` of M rows and `b` of N rows, both of length K: out[n][m] = a[m] · b[n].
fn reference(a: &[f32], b: &[f32]) -> Vec<f32> {
    let mut out = vec![0f32; M * N];
    for n in 0..N {
        for m in 0..M {
            let (ra, rb) = (&a[m * K..(m + 1) * K], &b[n * K..(n + 1) * K]);
            out[n * M + m] =
                ra.iter().zip(rb).map(|(x, y)| f64::from(*x) * f64::from(*y)).sum::<f64>() as f32;
        }
    }
    out
}

/// Largest error relative to the result's RMS; GPU kernels may round through f16, so 1e-2 is the bar — a
/// wrong or all-zero result is off by ~1.
const TOLERANCE: f32 = 1e-2;

fn verify(dev: sys::ggml_backend_dev_t, name: &str) -> Result<(), GgmlDeviceError> {
    let (a, b) = inputs();
    let got = run_matmul(dev, name, &a, &b)?;
    let want = reference(&a, &b);
    let rms = (want.iter().map(|v| f64::from(*v).powi(2)).sum::<f64>() / want.len() as f64).sqrt() as f32;
    let worst = got.iter().zip(&want).map(|(g, w)| (g - w).abs()).fold(0f32, f32::max);
    // A NaN anywhere (fold's max skips it) must fail too.
    if got.iter().any(|v| !v.is_finite()) || worst > TOLERANCE * rms {
        return Err(GgmlDeviceError::Verification {
            device: name.to_string(),
            message: format!("largest error {worst} against a result RMS of {rms} (allowed {TOLERANCE}×RMS)"),
        });
    }
    Ok(())
}

fn run_matmul(
    dev: sys::ggml_backend_dev_t,
    name: &str,
    a: &[f32],
    b: &[f32],
) -> Result<Vec<f32>, GgmlDeviceError> {
    let fail = |message: &str| GgmlDeviceError::Verification { device: name.into(), message: message.into() };
    // SAFETY: a self-contained ggml session: the context only holds tensor metadata (no_alloc), the tensors'
    // memory is one backend buffer, every object is freed below in reverse order, and the host slices passed
    // to tensor_set/get have exactly the tensors' sizes.
    unsafe {
        let backend = sys::ggml_backend_dev_init(dev, std::ptr::null());
        if backend.is_null() {
            return Err(GgmlDeviceError::Init { device: name.into() });
        }
        let params = sys::ggml_init_params {
            mem_size: 8 * sys::ggml_tensor_overhead() + sys::ggml_graph_overhead(),
            mem_buffer: std::ptr::null_mut(),
            no_alloc: true,
        };
        let ctx = sys::ggml_init(params);
        if ctx.is_null() {
            sys::ggml_backend_free(backend);
            return Err(fail("ggml_init returned null"));
        }
        let ta = sys::ggml_new_tensor_2d(ctx, sys::ggml_type::GGML_TYPE_F32, K as i64, M as i64);
        let tb = sys::ggml_new_tensor_2d(ctx, sys::ggml_type::GGML_TYPE_F32, K as i64, N as i64);
        let tc = sys::ggml_mul_mat(ctx, ta, tb);
        let graph = sys::ggml_new_graph(ctx);
        sys::ggml_build_forward_expand(graph, tc);
        let buffer = sys::ggml_backend_alloc_ctx_tensors(ctx, backend);
        let result = if buffer.is_null() {
            Err(fail("could not allocate device memory for the check"))
        } else {
            sys::ggml_backend_tensor_set(ta, a.as_ptr().cast(), 0, std::mem::size_of_val(a));
            sys::ggml_backend_tensor_set(tb, b.as_ptr().cast(), 0, std::mem::size_of_val(b));
            let status = sys::ggml_backend_graph_compute(backend, graph);
            if status != sys::ggml_status::GGML_STATUS_SUCCESS {
                Err(fail(&format!("graph compute returned {status:?}")))
            } else {
                let mut out = vec![0f32; M * N];
                sys::ggml_backend_tensor_get(tc, out.as_mut_ptr().cast(), 0, std::mem::size_of_val(&out[..]));
                Ok(out)
            }
        };
        if !buffer.is_null() {
            sys::ggml_backend_buffer_free(buffer);
        }
        sys::ggml_free(ctx);
        sys::ggml_backend_free(backend);
        result
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_device_is_listed_and_computes_the_check() {
        let all = registry();
        let (cpu, info) = all.iter().find(|(_, d)| d.kind == DeviceKind::Cpu).expect("ggml always has a CPU");
        assert!(!info.name.is_empty());
        // The check itself, on the CPU device: a correct backend passes it.
        verify(*cpu, &info.name).unwrap();
    }

    #[test]
    fn cpu_is_never_opened_as_a_gpu() {
        let err = open("CPU", 0).unwrap_err();
        assert!(matches!(err, GgmlDeviceError::NoSuchDevice { .. }), "{err}");
        let err = open("Vulkan", 99).unwrap_err().to_string();
        assert!(err.contains("no Vulkan device 99") && err.contains("CPU"), "{err}");
    }

    #[test]
    fn reference_product_is_what_ggml_means() {
        let (a, b) = inputs();
        let out = reference(&a, &b);
        let dot: f32 = a[..K].iter().zip(&b[K..2 * K]).map(|(x, y)| x * y).sum();
        assert!((out[M] - dot).abs() < 1e-4, "out[n=1][m=0]");
    }
}
