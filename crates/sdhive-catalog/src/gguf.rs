//! GGUF checkpoints (stable-diffusion.cpp's quantised single files) read from their header alone: the tensor
//! table (names, ggml shapes, types, offsets), checked to lie inside the file so that a truncated download is
//! reported when the library is scanned, and what the tensors say the file is — a Stable Diffusion 1.x, 2.x or
//! XL checkpoint (its family, whether it is an inpainting model), or something else, said in words. The header
//! is read through a byte budget, so a corrupt count or length cannot make a scan allocate or read gigabytes.

use std::fs::File;
use std::io::{BufReader, Read};
use std::path::Path;

/// A real header is at most a few MB (the tensor table; a language model's vocabulary in its metadata); the cap
/// stops a corrupt count or length from reading or allocating more.
pub const MAX_HEADER_BYTES: u64 = 100 * 1024 * 1024;

/// ggml's tensors have at most four dimensions.
const MAX_DIMS: u32 = 4;

/// The alignment of the data section when `general.alignment` does not say.
const DEFAULT_ALIGNMENT: u64 = 32;

/// One tensor of the table. `dims` are ggml's, innermost first: a torch `[out, in]` weight is `[in, out]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GgufTensor {
    pub name: String,
    pub dims: Vec<u64>,
    /// ggml's type id (`0` f32, `1` f16, `8` q8_0, …).
    pub ggml_type: u32,
    /// From the start of the data section.
    pub offset: u64,
}

impl GgufTensor {
    /// ggml's name for the type (`q8_0`), or `type N` for one this reader does not know.
    pub fn type_name(&self) -> String {
        type_info(self.ggml_type).map_or_else(|| format!("type {}", self.ggml_type), |t| t.0.to_string())
    }

    /// Bytes of data, for the types this reader knows.
    pub fn data_bytes(&self) -> Option<u64> {
        let (_, block, block_bytes) = type_info(self.ggml_type)?;
        let elements = self.dims.iter().try_fold(1u64, |n, d| n.checked_mul(*d))?;
        elements.div_ceil(block).checked_mul(block_bytes)
    }
}

/// A GGUF file's header.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct GgufHeader {
    pub version: u32,
    pub tensors: Vec<GgufTensor>,
    /// `general.architecture`, which llama.cpp-style files carry (`llama`, `flux`, …).
    pub architecture: Option<String>,
    /// Sum of the tensors' data bytes (those of known types).
    pub data_bytes: u64,
}

/// ggml types: name, elements per block, bytes per block (ggml-common.h).
fn type_info(id: u32) -> Option<(&'static str, u64, u64)> {
    Some(match id {
        0 => ("f32", 1, 4),
        1 => ("f16", 1, 2),
        2 => ("q4_0", 32, 18),
        3 => ("q4_1", 32, 20),
        6 => ("q5_0", 32, 22),
        7 => ("q5_1", 32, 24),
        8 => ("q8_0", 32, 34),
        9 => ("q8_1", 32, 36),
        10 => ("q2_K", 256, 84),
        11 => ("q3_K", 256, 110),
        12 => ("q4_K", 256, 144),
        13 => ("q5_K", 256, 176),
        14 => ("q6_K", 256, 210),
        15 => ("q8_K", 256, 292),
        16 => ("iq2_xxs", 256, 66),
        17 => ("iq2_xs", 256, 74),
        18 => ("iq3_xxs", 256, 98),
        19 => ("iq1_s", 256, 50),
        20 => ("iq4_nl", 32, 18),
        21 => ("iq3_s", 256, 110),
        22 => ("iq2_s", 256, 82),
        23 => ("iq4_xs", 256, 136),
        24 => ("i8", 1, 1),
        25 => ("i16", 1, 2),
        26 => ("i32", 1, 4),
        27 => ("i64", 1, 8),
        28 => ("f64", 1, 8),
        29 => ("iq1_m", 256, 56),
        30 => ("bf16", 1, 2),
        34 => ("tq1_0", 256, 54),
        35 => ("tq2_0", 256, 66),
        39 => ("mxfp4", 32, 17),
        40 => ("nvfp4", 64, 36),
        41 => ("q1_0", 128, 18),
        _ => return None,
    })
}

/// Reads the header of the GGUF file at `path`, or says why it is unusable (not GGUF, an unsupported version,
/// a header past the cap, a tensor beyond the end of the file).
pub fn read_header(path: &Path) -> Result<GgufHeader, String> {
    let file = File::open(path).map_err(|e| format!("cannot open it: {e}"))?;
    let file_len = file.metadata().map_err(|e| format!("cannot stat it: {e}"))?.len();
    let mut r = Budgeted { inner: BufReader::new(file), left: MAX_HEADER_BYTES.min(file_len), read: 0 };
    let magic: [u8; 4] = r.array().map_err(|_| format!("the file is only {file_len} bytes long"))?;
    if &magic != b"GGUF" {
        return Err(format!("not a GGUF file: it starts with {magic:02x?}, not `GGUF`"));
    }
    let version = r.u32()?;
    if !(2..=3).contains(&version) {
        return Err(format!("GGUF version {version} is not supported (versions 2 and 3 are)"));
    }
    let tensor_count = r.u64()?;
    let kv_count = r.u64()?;
    let mut alignment = DEFAULT_ALIGNMENT;
    let mut architecture = None;
    for _ in 0..kv_count {
        let key = r.string()?;
        let value_type = r.u32()?;
        match (key.as_str(), value_type) {
            ("general.alignment", 4) => alignment = u64::from(r.u32()?),
            ("general.architecture", 8) => architecture = Some(r.string()?),
            _ => r.skip_value(value_type)?,
        }
    }
    if alignment == 0 || !alignment.is_power_of_two() {
        return Err(format!("general.alignment {alignment} is not a power of two"));
    }
    // Bounded by what the budget lets the loop read; the capacity only avoids regrowth.
    let mut tensors = Vec::with_capacity(tensor_count.min(1 << 16) as usize);
    for _ in 0..tensor_count {
        let name = r.string()?;
        let n_dims = r.u32()?;
        if n_dims == 0 || n_dims > MAX_DIMS {
            return Err(format!("tensor `{name}` has {n_dims} dimensions (ggml has 1 to {MAX_DIMS})"));
        }
        let dims = (0..n_dims).map(|_| r.u64()).collect::<Result<Vec<_>, _>>()?;
        let ggml_type = r.u32()?;
        let offset = r.u64()?;
        tensors.push(GgufTensor { name, dims, ggml_type, offset });
    }
    let data_start = r.read.div_ceil(alignment) * alignment;
    let data_len = file_len.saturating_sub(data_start);
    let mut data_bytes = 0u64;
    for t in &tensors {
        let Some(bytes) = t.data_bytes() else { continue };
        if t.offset.checked_add(bytes).is_none_or(|end| end > data_len) {
            return Err(format!(
                "tensor `{}` ({} {:?}) spans bytes {}..{} of a {data_len}-byte data section (truncated?)",
                t.name,
                t.type_name(),
                t.dims,
                t.offset,
                t.offset.saturating_add(bytes)
            ));
        }
        data_bytes += bytes;
    }
    Ok(GgufHeader { version, tensors, architecture, data_bytes })
}

/// A reader that fails once it has consumed its budget, counting what it read.
struct Budgeted<R> {
    inner: R,
    left: u64,
    read: u64,
}

impl<R: Read> Budgeted<R> {
    fn take(&mut self, n: u64) -> Result<(), String> {
        if n > self.left {
            return Err(if self.read + n > MAX_HEADER_BYTES {
                "the header exceeds the 100 MB cap (corrupt counts or lengths?)".to_string()
            } else {
                "the header runs past the end of the file (truncated?)".to_string()
            });
        }
        self.left -= n;
        self.read += n;
        Ok(())
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N], String> {
        self.take(N as u64)?;
        let mut buf = [0u8; N];
        self.inner.read_exact(&mut buf).map_err(|e| format!("cannot read the header: {e}"))?;
        Ok(buf)
    }

    fn u32(&mut self) -> Result<u32, String> {
        self.array().map(u32::from_le_bytes)
    }

    fn u64(&mut self) -> Result<u64, String> {
        self.array().map(u64::from_le_bytes)
    }

    fn bytes(&mut self, n: u64) -> Result<Vec<u8>, String> {
        self.take(n)?;
        // `take` bounded n by the budget, itself at most MAX_HEADER_BYTES.
        let mut buf = vec![0u8; n as usize];
        self.inner.read_exact(&mut buf).map_err(|e| format!("cannot read the header: {e}"))?;
        Ok(buf)
    }

    fn string(&mut self) -> Result<String, String> {
        let len = self.u64()?;
        let bytes = self.bytes(len)?;
        String::from_utf8(bytes).map_err(|_| "a name in the header is not UTF-8".to_string())
    }

    /// Skips a metadata value of `value_type` (GGUF's `gguf_type`).
    fn skip_value(&mut self, value_type: u32) -> Result<(), String> {
        match value_type {
            // u8, i8, bool
            0 | 1 | 7 => self.skip(1),
            // u16, i16
            2 | 3 => self.skip(2),
            // u32, i32, f32
            4..=6 => self.skip(4),
            // u64, i64, f64
            10..=12 => self.skip(8),
            8 => {
                let len = self.u64()?;
                self.skip(len)
            }
            9 => {
                let elem = self.u32()?;
                let count = self.u64()?;
                match elem {
                    0 | 1 | 7 => self.skip(count.saturating_mul(1)),
                    2 | 3 => self.skip(count.saturating_mul(2)),
                    4..=6 => self.skip(count.saturating_mul(4)),
                    10..=12 => self.skip(count.saturating_mul(8)),
                    // Strings and nested arrays have their own lengths; the budget bounds the loop.
                    8 | 9 => (0..count).try_for_each(|_| self.skip_value(elem)),
                    other => Err(format!("unknown metadata array type {other}")),
                }
            }
            other => Err(format!("unknown metadata value type {other}")),
        }
    }

    fn skip(&mut self, n: u64) -> Result<(), String> {
        self.take(n)?;
        std::io::copy(&mut (&mut self.inner).take(n), &mut std::io::sink())
            .map_err(|e| format!("cannot read the header: {e}"))
            .and_then(|copied| {
                if copied == n {
                    Ok(())
                } else {
                    Err("the header runs past the end of the file (truncated?)".into())
                }
            })
    }
}

/// What a GGUF checkpoint is, as far as serving it goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SdCheckpoint {
    /// `sd1`, `sd2` or `sdxl`, the names the engines use.
    pub family: &'static str,
    /// A 9-channel (inpainting) UNet.
    pub inpainting: bool,
    /// The ggml types of the weights, most bytes first, joined by `+` (`f16+q8_0`: sd.cpp's q8_0 conversion
    /// quantises the linear layers and keeps the 3×3 convolutions, whose rows do not fill a block, in f16).
    pub weight_types: String,
}

/// The prefixes under which a full checkpoint keeps its UNet: stable-diffusion.cpp's own names (the LDM ones,
/// what `sd --mode convert` writes) and the component prefixes it gives a converted diffusers folder.
const UNET_PREFIXES: [&str; 2] = ["model.diffusion_model.", "unet."];
const VAE_PREFIXES: [&str; 2] = ["first_stage_model.", "vae."];
const TEXT_PREFIXES: [&str; 4] = ["cond_stage_model.", "conditioner.", "te.", "text_encoders."];

impl GgufHeader {
    fn has_prefix(&self, prefixes: &[&str]) -> bool {
        self.tensors.iter().any(|t| prefixes.iter().any(|p| t.name.starts_with(p)))
    }

    fn unet_tensor(&self, ldm: &str, diffusers: &str) -> Option<&GgufTensor> {
        self.tensors.iter().find(|t| {
            t.name.strip_prefix(UNET_PREFIXES[0]).is_some_and(|rest| rest == ldm)
                || t.name.strip_prefix(UNET_PREFIXES[1]).is_some_and(|rest| rest == diffusers)
        })
    }

    /// The Stable Diffusion checkpoint this file holds (UNet, text encoder and VAE in one file), recognised from
    /// its tensors: the UNet's cross-attention width tells the family (768: SD1.x, 1024: SD2.x, 2048: SDXL),
    /// the width of its first convolution an inpainting model. Anything else is refused with what it seems to be.
    pub fn sd_checkpoint(&self) -> Result<SdCheckpoint, String> {
        let any = |needle: &str| self.tensors.iter().any(|t| t.name.contains(needle));
        if self.tensors.is_empty() {
            return Err("it holds no tensors".into());
        }
        if !self.has_prefix(&UNET_PREFIXES) {
            let what = if let Some(arch) = self.architecture.as_deref().filter(|a| !a.is_empty()) {
                format!("a `{arch}` model (general.architecture), not a Stable Diffusion checkpoint")
            } else if any("double_blocks.") || any("joint_blocks.") || any("single_blocks.") {
                "a transformer (Flux/SD3-style) model, not a Stable Diffusion 1/2/XL checkpoint".into()
            } else if self.tensors.iter().any(|t| {
                ["input_blocks.", "down_blocks.", "time_embed.", "middle_block."]
                    .iter()
                    .any(|p| t.name.starts_with(p))
            }) {
                "a UNet alone (no text encoder or VAE): serve the full checkpoint".into()
            } else if any("lora_") || any(".lora_down") || any(".lora_up") {
                "a LoRA, not a checkpoint".into()
            } else {
                "no Stable Diffusion UNet (`model.diffusion_model.*`) in it".into()
            };
            return Err(what);
        }
        if !self.has_prefix(&VAE_PREFIXES) {
            return Err("it holds no VAE (`first_stage_model.*`): serve the full checkpoint".into());
        }
        if !self.has_prefix(&TEXT_PREFIXES) {
            return Err("it holds no text encoder (`cond_stage_model.*`): serve the full checkpoint".into());
        }
        // The first cross-attention key projection: torch [inner, context], ggml [context, inner].
        let context = self
            .tensors
            .iter()
            .filter(|t| UNET_PREFIXES.iter().any(|p| t.name.starts_with(p)))
            .find(|t| t.name.ends_with("attn2.to_k.weight"))
            .and_then(|t| t.dims.first().copied())
            .ok_or("its UNet has no cross-attention (`attn2.to_k.weight`)")?;
        let family = match context {
            768 => "sd1",
            1024 => "sd2",
            2048 => "sdxl",
            1280 => return Err("an SDXL refiner (cross-attention width 1280), which is not served".into()),
            other => {
                return Err(format!(
                    "its UNet's cross-attention width is {other}; Stable Diffusion 1.x, 2.x and XL have 768, \
                     1024 and 2048"
                ))
            }
        };
        // torch [out, in, kh, kw], ggml [kw, kh, in, out].
        let inpainting = self
            .unet_tensor("input_blocks.0.0.weight", "conv_in.weight")
            .is_some_and(|t| t.dims.get(2) == Some(&9));
        let mut by_type: Vec<(u32, u64)> = Vec::new();
        for t in &self.tensors {
            let bytes = t.data_bytes().unwrap_or(0);
            match by_type.iter_mut().find(|(id, _)| *id == t.ggml_type) {
                Some((_, total)) => *total += bytes,
                None => by_type.push((t.ggml_type, bytes)),
            }
        }
        by_type.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
        let names: Vec<String> = by_type
            .iter()
            .map(|(id, _)| type_info(*id).map_or_else(|| format!("type {id}"), |t| t.0.to_string()))
            .collect();
        Ok(SdCheckpoint { family, inpainting, weight_types: names.join("+") })
    }
}

/// Test support: writes a GGUF file of `tensors` (name, ggml dims, ggml type id), each tensor's data zeros, with
/// `general.architecture` when given.
#[doc(hidden)]
pub fn write_for_tests(
    path: &Path,
    kv_architecture: Option<&str>,
    tensors: &[(&str, &[u64], u32)],
) -> std::io::Result<()> {
    let mut out = b"GGUF".to_vec();
    out.extend_from_slice(&3u32.to_le_bytes());
    out.extend_from_slice(&(tensors.len() as u64).to_le_bytes());
    out.extend_from_slice(&u64::from(kv_architecture.is_some()).to_le_bytes());
    let string = |out: &mut Vec<u8>, s: &str| {
        out.extend_from_slice(&(s.len() as u64).to_le_bytes());
        out.extend_from_slice(s.as_bytes());
    };
    if let Some(arch) = kv_architecture {
        string(&mut out, "general.architecture");
        out.extend_from_slice(&8u32.to_le_bytes());
        string(&mut out, arch);
    }
    let mut offset = 0u64;
    let mut sizes = Vec::new();
    for (name, dims, ty) in tensors {
        string(&mut out, name);
        out.extend_from_slice(&(dims.len() as u32).to_le_bytes());
        for d in *dims {
            out.extend_from_slice(&d.to_le_bytes());
        }
        out.extend_from_slice(&ty.to_le_bytes());
        out.extend_from_slice(&offset.to_le_bytes());
        let t = GgufTensor { name: name.to_string(), dims: dims.to_vec(), ggml_type: *ty, offset };
        let bytes = t.data_bytes().unwrap_or(0).div_ceil(DEFAULT_ALIGNMENT) * DEFAULT_ALIGNMENT;
        sizes.push(bytes);
        offset += bytes;
    }
    out.resize(out.len().div_ceil(DEFAULT_ALIGNMENT as usize) * DEFAULT_ALIGNMENT as usize, 0);
    out.resize(out.len() + sizes.iter().sum::<u64>() as usize, 0);
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    std::fs::write(path, out)
}

/// Test support: writes a header-sized GGUF SD checkpoint of `family` ([`sd_tensors_for_tests`]) to `path`.
#[doc(hidden)]
pub fn write_sd_for_tests(path: &Path, family: &str, in_channels: u64) -> std::io::Result<()> {
    let tensors = sd_tensors_for_tests(family, in_channels);
    let refs: Vec<(&str, &[u64], u32)> =
        tensors.iter().map(|(n, d, t)| (n.as_str(), d.as_slice(), *t)).collect();
    write_for_tests(path, None, &refs)
}

/// Test support: the tensors that make a GGUF an SD checkpoint of `family` (`sd1`, `sd2`, `sdxl`) to
/// [`GgufHeader::sd_checkpoint`], with sd.cpp's names; `in_channels` 9 for an inpainting UNet.
#[doc(hidden)]
pub fn sd_tensors_for_tests(family: &str, in_channels: u64) -> Vec<(String, Vec<u64>, u32)> {
    let context = match family {
        "sdxl" => 2048,
        "sd2" => 1024,
        _ => 768,
    };
    vec![
        ("model.diffusion_model.input_blocks.0.0.weight".into(), vec![3, 3, in_channels, 320], 1),
        (
            "model.diffusion_model.input_blocks.1.1.transformer_blocks.0.attn2.to_k.weight".into(),
            vec![context, 320],
            8,
        ),
        ("first_stage_model.decoder.conv_in.weight".into(), vec![3, 3, 4, 512], 1),
        ("cond_stage_model.transformer.text_model.final_layer_norm.weight".into(), vec![768], 0),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(
        dir: &Path,
        name: &str,
        arch: Option<&str>,
        tensors: &[(String, Vec<u64>, u32)],
    ) -> std::path::PathBuf {
        let path = dir.join(name);
        let refs: Vec<(&str, &[u64], u32)> =
            tensors.iter().map(|(n, d, t)| (n.as_str(), d.as_slice(), *t)).collect();
        write_for_tests(&path, arch, &refs).unwrap();
        path
    }

    #[test]
    fn reads_the_tensor_table_and_recognises_each_family() {
        let dir = tempfile::tempdir().unwrap();
        for family in ["sd1", "sd2", "sdxl"] {
            let path = write(dir.path(), &format!("{family}.gguf"), None, &sd_tensors_for_tests(family, 4));
            let header = read_header(&path).unwrap();
            assert_eq!(header.version, 3);
            assert_eq!(header.tensors.len(), 4);
            assert_eq!(header.tensors[0].dims, [3, 3, 4, 320]);
            let ckpt = header.sd_checkpoint().unwrap();
            assert_eq!((ckpt.family, ckpt.inpainting), (family, false));
        }
        let path = write(dir.path(), "inpaint.gguf", None, &sd_tensors_for_tests("sd1", 9));
        let ckpt = read_header(&path).unwrap().sd_checkpoint().unwrap();
        assert!(ckpt.inpainting);
        // q8_0's 768·320/32·34 = 261120 bytes outweigh the f16 tensors' (3·3·9·320 + 3·3·4·512)·2 = 88704.
        assert_eq!(ckpt.weight_types, "q8_0+f16+f32");
        let h = read_header(&path).unwrap();
        assert_eq!(h.tensors[1].data_bytes(), Some(768 * 320 / 32 * 34));
        assert_eq!(h.data_bytes, h.tensors.iter().map(|t| t.data_bytes().unwrap()).sum::<u64>());
    }

    #[test]
    fn diffusers_prefixes_count_as_a_checkpoint() {
        let dir = tempfile::tempdir().unwrap();
        let tensors = vec![
            ("unet.conv_in.weight".to_string(), vec![3, 3, 9, 320], 1),
            (
                "unet.down_blocks.0.attentions.0.transformer_blocks.0.attn2.to_k.weight".into(),
                vec![1024, 320],
                1,
            ),
            ("vae.decoder.conv_in.weight".into(), vec![3, 3, 4, 512], 1),
            ("te.text_model.final_layer_norm.weight".into(), vec![1024], 0),
        ];
        let ckpt =
            read_header(&write(dir.path(), "d.gguf", None, &tensors)).unwrap().sd_checkpoint().unwrap();
        assert_eq!((ckpt.family, ckpt.inpainting), ("sd2", true));
    }

    #[test]
    fn other_gguf_files_are_named_for_what_they_are() {
        let dir = tempfile::tempdir().unwrap();
        let why = |name: &str, arch: Option<&str>, tensors: &[(String, Vec<u64>, u32)]| {
            read_header(&write(dir.path(), name, arch, tensors)).unwrap().sd_checkpoint().unwrap_err()
        };
        let t = |name: &str| (name.to_string(), vec![64u64, 64], 1u32);
        assert!(why("llm.gguf", Some("llama"), &[t("blk.0.attn_q.weight")]).contains("`llama`"));
        assert!(why("flux.gguf", None, &[t("double_blocks.0.img_attn.qkv.weight")]).contains("Flux"));
        assert!(why("unet.gguf", None, &[t("input_blocks.0.0.weight")]).contains("UNet alone"));
        assert!(why("empty.gguf", None, &[]).contains("no tensors"));
        let mut no_vae = sd_tensors_for_tests("sd1", 4);
        no_vae.retain(|(n, _, _)| !n.starts_with("first_stage_model."));
        assert!(why("novae.gguf", None, &no_vae).contains("no VAE"));
        let mut refiner = sd_tensors_for_tests("sd1", 4);
        refiner[1].1 = vec![1280, 384];
        assert!(why("refiner.gguf", None, &refiner).contains("refiner"));
    }

    #[test]
    fn broken_files_are_refused_without_reading_past_the_cap() {
        let dir = tempfile::tempdir().unwrap();
        let path = write(dir.path(), "t.gguf", None, &sd_tensors_for_tests("sd1", 4));
        let len = std::fs::metadata(&path).unwrap().len();
        std::fs::File::options().write(true).open(&path).unwrap().set_len(len - 100).unwrap();
        assert!(read_header(&path).unwrap_err().contains("truncated"));

        let not_gguf = dir.path().join("n.gguf");
        std::fs::write(&not_gguf, b"GGML\0\0\0\0").unwrap();
        assert!(read_header(&not_gguf).unwrap_err().contains("not a GGUF file"));
        let v1 = dir.path().join("v1.gguf");
        std::fs::write(&v1, b"GGUF\x01\0\0\0").unwrap();
        assert!(read_header(&v1).unwrap_err().contains("version 1"));
        std::fs::write(&v1, b"GG").unwrap();
        assert!(read_header(&v1).unwrap_err().contains("2 bytes"));

        // A name claiming 2^60 bytes: refused by the budget, nothing allocated.
        let mut huge = b"GGUF".to_vec();
        huge.extend_from_slice(&3u32.to_le_bytes());
        huge.extend_from_slice(&1u64.to_le_bytes());
        huge.extend_from_slice(&0u64.to_le_bytes());
        huge.extend_from_slice(&(1u64 << 60).to_le_bytes());
        huge.extend_from_slice(b"name");
        let p = dir.path().join("huge.gguf");
        std::fs::write(&p, &huge).unwrap();
        assert!(read_header(&p).unwrap_err().contains("100 MB cap"), "{}", read_header(&p).unwrap_err());
        // A tensor count of 2^62 with no table behind it ends at the end of the file, not in an allocation.
        let mut many = huge[..16].to_vec();
        many[8..16].copy_from_slice(&(1u64 << 62).to_le_bytes());
        many.extend_from_slice(&0u64.to_le_bytes());
        std::fs::write(&p, &many).unwrap();
        assert!(read_header(&p).is_err());
    }
}
