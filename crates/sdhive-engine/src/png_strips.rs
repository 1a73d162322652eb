//! The zlib stream of a PNG's image data, made in parallel: the rows are cut into strips, and each strip is
//! Sub-filtered, checksummed and deflated on its own thread, as fdeflate codes PNG data (literals, and zeros that
//! run across eight-byte words as copies at distance 1) but with a Huffman code of the strip's own, built from a
//! sample of its rows; a strip whose sample says noise is stored instead. A strip ends on a byte boundary, behind
//! an empty stored block where it is not the last (zlib's sync flush), so the strips' outputs concatenate into one
//! deflate stream; their Adler-32 checksums combine into the stream's. The encode is on every answer's path: one
//! thread deflating a 512² image took 1.3–2.0 ms, eight strips take 0.3–0.9 ms (`docs/benchmarks.md`).

use std::sync::OnceLock;

/// Rows of a strip at least: below this a strip's block header and thread hand-off cost more than they save.
const MIN_STRIP_ROWS: usize = 16;
/// Bytes per pixel (RGB, 8 bits).
const BPP: usize = 3;
const MAX_BITS: usize = 15;
const MAX_CODE_LENGTH_BITS: usize = 7;
/// Literal/length alphabet: 256 literals, end of block, 29 length codes.
const LITLEN: usize = 286;
const END_OF_BLOCK: usize = 256;
/// The code-length alphabet's order in a dynamic block header (RFC 1951, 3.2.7).
const CODE_LENGTH_ORDER: [usize; 19] = [16, 17, 18, 0, 8, 7, 9, 6, 10, 5, 11, 4, 12, 3, 13, 2, 14, 1, 15];
const ADLER_BASE: u64 = 65521;

/// The length codes (RFC 1951, 3.2.5): for each copy length 3..=258, its symbol, extra bits and their value.
struct LengthCode {
    symbol: u16,
    extra_bits: u8,
    extra: u16,
}

fn length_code(len: usize) -> LengthCode {
    const BASE: [u16; 29] = [
        3, 4, 5, 6, 7, 8, 9, 10, 11, 13, 15, 17, 19, 23, 27, 31, 35, 43, 51, 59, 67, 83, 99, 115, 131, 163,
        195, 227, 258,
    ];
    const EXTRA: [u8; 29] =
        [0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3, 4, 4, 4, 4, 5, 5, 5, 5, 0];
    let code = BASE.partition_point(|&b| usize::from(b) <= len) - 1;
    LengthCode {
        symbol: 257 + code as u16,
        extra_bits: EXTRA[code],
        extra: (len - usize::from(BASE[code])) as u16,
    }
}

fn length_codes() -> &'static [LengthCode] {
    static TABLE: OnceLock<Vec<LengthCode>> = OnceLock::new();
    TABLE.get_or_init(|| (0..=258).map(|len| length_code(len.max(3))).collect())
}

/// The encoding threads' pool (PNG strips, base64 chunks): its own, so an encode never waits behind the CPU
/// engine's work on rayon's global pool.
pub(crate) fn pool() -> Option<&'static rayon::ThreadPool> {
    static POOL: OnceLock<Option<rayon::ThreadPool>> = OnceLock::new();
    POOL.get_or_init(|| {
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get()).min(8);
        rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .thread_name(|i| format!("image-encode-{i}"))
            .build()
            .ok()
    })
    .as_ref()
}

/// The zlib stream of `data` (RGB8 rows of `width` pixels), Sub-filtered, in up to `strips` strips deflated in
/// parallel (`None`: one per encoding thread).
pub(crate) fn zlib_image_data(data: &[u8], width: usize, strips: Option<usize>) -> Vec<u8> {
    let stride = width * BPP;
    let rows = data.len().checked_div(stride).unwrap_or(0);
    let pool = pool();
    let wanted = strips.unwrap_or_else(|| pool.map_or(1, |p| p.current_num_threads()));
    let n = wanted.min(rows / MIN_STRIP_ROWS).max(1);
    let per = rows.div_ceil(n).max(1);
    let mut ranges: Vec<(usize, usize)> = (0..rows).step_by(per).map(|r| (r, (r + per).min(rows))).collect();
    if ranges.is_empty() {
        ranges.push((0, 0));
    }
    let encode = |i: usize| {
        let (a, b) = ranges[i];
        deflate_strip(&data[a * stride..b * stride], stride, i + 1 == ranges.len())
    };
    let parts: Vec<Strip> = match pool {
        Some(pool) if ranges.len() > 1 => pool.install(|| {
            use rayon::prelude::*;
            (0..ranges.len()).into_par_iter().map(encode).collect()
        }),
        _ => (0..ranges.len()).map(encode).collect(),
    };
    let mut out = Vec::with_capacity(6 + parts.iter().map(|p| p.deflated.len()).sum::<usize>());
    // CMF: deflate with a 32 KiB window; FLG: fastest level, no dictionary, and the check bits.
    out.extend_from_slice(&[0x78, 0x01]);
    let mut adler = 1u32;
    for part in &parts {
        out.extend_from_slice(&part.deflated);
        adler = adler32_combine(adler, part.adler, part.len);
    }
    out.extend_from_slice(&adler.to_be_bytes());
    out
}

struct Strip {
    deflated: Vec<u8>,
    /// Adler-32 of the filtered bytes, and their count.
    adler: u32,
    len: usize,
}

/// One strip's rows Sub-filtered and deflated, ending on a byte boundary: the stream's final block if `last`, else
/// followed by an empty stored block. One dynamic-Huffman block whose code comes from every fourth row's tokens
/// (every symbol keeps a code, so the other rows need no second pass), or stored blocks where that comes out
/// larger (noise).
fn deflate_strip(rows: &[u8], stride: usize, last: bool) -> Strip {
    let filtered = sub_filter(rows, stride);
    let mut adler = simd_adler32::Adler32::new();
    adler.write(&filtered);
    let (adler, len) = (adler.finish(), filtered.len());

    let mut counts = Histogram { freq: [1; LITLEN] };
    for row in filtered.chunks(stride + 1).step_by(SAMPLED_ROW) {
        scan(row, &mut counts);
    }
    let lit_lengths = code_lengths(&counts.freq, MAX_LITERAL_BITS);
    let sampled: usize = counts.freq.iter().map(|&f| f as usize - 1).sum();
    let sampled_bits: usize =
        counts.freq.iter().zip(&lit_lengths).map(|(&f, &l)| (f as usize - 1) * usize::from(l)).sum();
    // Noise codes at eight bits a token or more, a token per byte: stored at once, with no encode to throw away.
    if sampled > 0 && sampled_bits >= sampled * 8 {
        return Strip { deflated: stored(&filtered, last), adler, len };
    }
    let mut w = BitWriter::with_capacity(filtered.len() + filtered.len() / 2 + 512);
    w.put(u64::from(last), 1);
    w.put(2, 2); // dynamic Huffman codes
    write_code_lengths(&mut w, &lit_lengths);
    let mut enc = Encoder::new(&lit_lengths, w);
    scan(&filtered, &mut enc);
    let mut w = enc.end_block();
    if !last {
        // An empty stored block: not final, stored, then LEN 0 and its complement at the next byte boundary.
        w.put(0, 3);
        w.align();
        w.bytes(&[0x00, 0x00, 0xff, 0xff]);
    }
    w.align();
    let deflated = if w.len() > stored_size(len) { stored(&filtered, last) } else { w.finish() };
    Strip { deflated, adler, len }
}

/// Rows of a strip whose tokens set its code: one in this many.
const SAMPLED_ROW: usize = 4;
/// The literal/length code's longest code: four literals then fit one 64-bit write.
const MAX_LITERAL_BITS: usize = 12;
/// Bytes of a stored block at most.
const STORED_MAX: usize = 65_535;

fn stored_size(len: usize) -> usize {
    len + 5 * len.div_ceil(STORED_MAX).max(1)
}

/// `data` as stored blocks (the last one final if `last`).
fn stored(data: &[u8], last: bool) -> Vec<u8> {
    let mut out = Vec::with_capacity(stored_size(data.len()));
    let mut blocks = data.chunks(STORED_MAX).peekable();
    if blocks.peek().is_none() {
        out.extend_from_slice(&[u8::from(last), 0, 0, 0xff, 0xff]);
    }
    while let Some(block) = blocks.next() {
        let n = block.len() as u16;
        out.push(u8::from(last && blocks.peek().is_none()));
        out.extend_from_slice(&n.to_le_bytes());
        out.extend_from_slice(&(!n).to_le_bytes());
        out.extend_from_slice(block);
    }
    out
}

/// PNG's Sub filter on RGB8 rows: each byte less the same channel of the pixel to its left, behind the row's
/// filter-type byte (1).
fn sub_filter(rows: &[u8], stride: usize) -> Vec<u8> {
    if stride == 0 {
        return Vec::new();
    }
    let mut out = Vec::with_capacity(rows.len() + rows.len() / stride + 1);
    for row in rows.chunks_exact(stride) {
        out.push(1);
        out.extend_from_slice(&row[..BPP.min(stride)]);
        out.extend(row[BPP..].iter().zip(row).map(|(&x, &left)| x.wrapping_sub(left)));
    }
    out
}

/// What [`scan`] hands its tokens to.
trait Sink {
    /// Eight literals.
    fn eight(&mut self, bytes: [u8; 8]);
    fn literal(&mut self, b: u8);
    /// A copy of this many bytes (3..=258) at distance 1.
    fn run(&mut self, len: usize);
}

/// Walks `data` as deflate tokens, eight bytes at a time as fdeflate does: zeros that reach across the boundaries
/// of eight-byte words become a zero and copies of it at distance 1; the rest are literals.
fn scan(data: &[u8], sink: &mut impl Sink) {
    let mut run = 0;
    let mut words = data.chunks_exact(8);
    for chunk in &mut words {
        let bytes: [u8; 8] = chunk.try_into().expect("8 bytes");
        let word = u64::from_le_bytes(bytes);
        if word == 0 {
            run += 8;
            continue;
        }
        // Little-endian: the word's first bytes are its low ones.
        let mut start = 0;
        if run > 0 {
            start = word.trailing_zeros() as usize / 8;
            zero_run(run + start, sink);
        }
        run = word.leading_zeros() as usize / 8;
        if start == 0 && run == 0 {
            sink.eight(bytes);
        } else {
            for &b in &bytes[start..8 - run] {
                sink.literal(b);
            }
        }
    }
    for &b in words.remainder() {
        if b == 0 {
            run += 1;
        } else {
            if run > 0 {
                zero_run(run, sink);
                run = 0;
            }
            sink.literal(b);
        }
    }
    if run > 0 {
        zero_run(run, sink);
    }
}

/// `zeros` zero bytes: a zero and copies of it at distance 1, or literals where the run is too short to gain.
fn zero_run(zeros: usize, sink: &mut impl Sink) {
    const MIN_RUN: usize = 5;
    if zeros < MIN_RUN {
        for _ in 0..zeros {
            sink.literal(0);
        }
        return;
    }
    sink.literal(0);
    let mut left = zeros - 1;
    while left >= 3 {
        // Never leave one or two bytes a copy cannot take, where a shorter copy leaves three.
        let take = if left > 258 && left - 258 < 3 { left - 3 } else { left.min(258) };
        sink.run(take);
        left -= take;
    }
    for _ in 0..left {
        sink.literal(0);
    }
}

/// Symbol counts of the sampled rows, every symbol counted once more (so each gets a code).
struct Histogram {
    freq: [u32; LITLEN],
}

impl Sink for Histogram {
    fn eight(&mut self, bytes: [u8; 8]) {
        for b in bytes {
            self.freq[usize::from(b)] += 1;
        }
    }
    fn literal(&mut self, b: u8) {
        self.freq[usize::from(b)] += 1;
    }
    fn run(&mut self, len: usize) {
        self.freq[usize::from(length_codes()[len].symbol)] += 1;
    }
}

/// Writes tokens with one code: each literal's `(code, length)` packed as `length << 16 | code`, and each copy
/// length's whole token (length code, extra bits, the one-bit distance code) likewise.
struct Encoder {
    lit: [u32; 256],
    runs: Vec<u32>,
    end_of_block: (u16, u8),
    w: BitWriter,
}

impl Encoder {
    fn new(lengths: &[u8], w: BitWriter) -> Self {
        let codes = canonical_codes(lengths);
        let pack = |(code, bits): (u16, u8)| u32::from(bits) << 16 | u32::from(code);
        let lit = std::array::from_fn(|b| pack(codes[b]));
        let runs = length_codes()
            .iter()
            .map(|l| {
                let (code, bits) = codes[usize::from(l.symbol)];
                // Runs copy at distance 1: distance code 0, the only one, a single 0 bit after the extra bits.
                let word = u32::from(code) | u32::from(l.extra) << bits;
                u32::from(bits + l.extra_bits + 1) << 24 | word
            })
            .collect();
        Encoder { lit, runs, end_of_block: codes[END_OF_BLOCK], w }
    }

    /// Writes the end-of-block code and hands the writer back.
    fn end_block(mut self) -> BitWriter {
        let (code, bits) = self.end_of_block;
        self.w.put(u64::from(code), bits);
        self.w
    }
}

impl Sink for Encoder {
    #[inline(always)]
    fn eight(&mut self, bytes: [u8; 8]) {
        for four in bytes.chunks_exact(4) {
            let mut word = 0u64;
            let mut bits = 0u32;
            for &b in four {
                let c = self.lit[usize::from(b)];
                word |= u64::from(c & 0xffff) << bits;
                bits += c >> 16;
            }
            self.w.put_wide(word, bits);
        }
    }
    fn literal(&mut self, b: u8) {
        let c = self.lit[usize::from(b)];
        self.w.put(u64::from(c & 0xffff), (c >> 16) as u8);
    }
    fn run(&mut self, len: usize) {
        let c = self.runs[len];
        self.w.put(u64::from(c & 0xff_ffff), (c >> 24) as u8);
    }
}

/// Huffman code lengths for `freq`, at most `limit` bits, zero for unused symbols; at least two symbols get a
/// code (a single used symbol gets a one-bit code beside an unused one, as zlib does).
fn code_lengths(freq: &[u32], limit: usize) -> Vec<u8> {
    let mut used: Vec<usize> = (0..freq.len()).filter(|&s| freq[s] > 0).collect();
    let mut lengths = vec![0u8; freq.len()];
    if used.len() < 2 {
        for extra in [0, 1] {
            if used.len() < 2 && !used.contains(&extra) {
                used.push(extra);
            }
        }
        for &s in &used {
            lengths[s] = 1;
        }
        return lengths;
    }
    // Rarest first; ties by symbol, so the code depends only on the frequencies.
    used.sort_by_key(|&s| (freq[s], s));
    let n = used.len();
    // The two-queue Huffman construction over the sorted leaves: nodes 0..n are leaves, n.. internal.
    let mut weight: Vec<u64> = used.iter().map(|&s| u64::from(freq[s])).collect();
    let mut parent = vec![0usize; 2 * n - 1];
    let (mut leaf, mut inner) = (0, n);
    for node in n..2 * n - 1 {
        let mut pick = || {
            let take_leaf = leaf < n && (inner >= node || weight[leaf] <= weight[inner]);
            let at = if take_leaf { leaf } else { inner };
            if take_leaf {
                leaf += 1;
            } else {
                inner += 1;
            }
            at
        };
        let (a, b) = (pick(), pick());
        weight.push(weight[a] + weight[b]);
        parent[a] = node;
        parent[b] = node;
    }
    let root = 2 * n - 2;
    let mut depth = vec![0usize; 2 * n - 1];
    for node in (0..root).rev() {
        depth[node] = depth[parent[node]] + 1;
    }
    // Count codes per length, folding lengths over the limit into it, then restore the Kraft sum by lengthening
    // the longest codes below the limit (miniz's and zlib's fix-up).
    let mut count = vec![0usize; limit + 1];
    for &d in &depth[..n] {
        count[d.min(limit)] += 1;
    }
    let kraft = |count: &[usize]| -> usize { (1..=limit).map(|l| count[l] << (limit - l)).sum() };
    let mut total = kraft(&count);
    while total > 1 << limit {
        count[limit] -= 1;
        for l in (1..limit).rev() {
            if count[l] > 0 {
                count[l] -= 1;
                count[l + 1] += 2;
                break;
            }
        }
        total -= 1;
    }
    // The rarest symbols take the longest codes.
    let mut symbols = used.iter();
    for l in (1..=limit).rev() {
        for _ in 0..count[l] {
            if let Some(&s) = symbols.next() {
                lengths[s] = l as u8;
            }
        }
    }
    lengths
}

/// Canonical codes (RFC 1951, 3.2.2) for `lengths`, bit-reversed for deflate's least-significant-bit-first
/// packing: `(code, length)` per symbol.
fn canonical_codes(lengths: &[u8]) -> Vec<(u16, u8)> {
    let mut count = [0u16; MAX_BITS + 1];
    for &l in lengths {
        count[usize::from(l)] += 1;
    }
    count[0] = 0;
    let mut next = [0u16; MAX_BITS + 2];
    let mut code = 0u16;
    for bits in 1..=MAX_BITS {
        code = (code + count[bits - 1]) << 1;
        next[bits] = code;
    }
    lengths
        .iter()
        .map(|&l| {
            if l == 0 {
                return (0, 0);
            }
            let c = next[usize::from(l)];
            next[usize::from(l)] += 1;
            (c.reverse_bits() >> (16 - u16::from(l)), l)
        })
        .collect()
}

/// A dynamic block's header after its first three bits: the literal/length code lengths (and the one distance
/// code's), written with a code-length code built for them.
fn write_code_lengths(w: &mut BitWriter, lit_lengths: &[u8]) {
    let nlit = lit_lengths.iter().rposition(|&l| l > 0).map_or(257, |i| i + 1).max(257);
    let all: Vec<u8> = lit_lengths[..nlit].iter().copied().chain([1]).collect();
    let mut freq = [0u32; 19];
    for &l in &all {
        freq[usize::from(l)] += 1;
    }
    let cl_lengths = code_lengths(&freq, MAX_CODE_LENGTH_BITS);
    let cl_codes = canonical_codes(&cl_lengths);
    let nclen = CODE_LENGTH_ORDER.iter().rposition(|&s| cl_lengths[s] > 0).map_or(4, |i| i + 1).max(4);
    w.put((nlit - 257) as u64, 5);
    w.put(0, 5); // one distance code
    w.put((nclen - 4) as u64, 4);
    for &s in &CODE_LENGTH_ORDER[..nclen] {
        w.put(u64::from(cl_lengths[s]), 3);
    }
    for &l in &all {
        let (code, len) = cl_codes[usize::from(l)];
        w.put(u64::from(code), len);
    }
}

/// Deflate's bit packing, least significant bit first, into a buffer sized up front: whole bytes go out eight at a
/// time.
struct BitWriter {
    out: Vec<u8>,
    /// Bytes of `out` written.
    pos: usize,
    acc: u64,
    bits: u32,
}

impl BitWriter {
    fn with_capacity(bytes: usize) -> Self {
        BitWriter { out: vec![0; bytes + 8], pos: 0, acc: 0, bits: 0 }
    }

    /// Moves the whole bytes of the accumulator out, leaving fewer than eight bits.
    #[inline(always)]
    fn flush(&mut self) {
        if self.pos + 8 > self.out.len() {
            self.out.resize(self.out.len() * 2 + 8, 0);
        }
        self.out[self.pos..self.pos + 8].copy_from_slice(&self.acc.to_le_bytes());
        let whole = self.bits / 8;
        self.pos += whole as usize;
        self.acc = self.acc.checked_shr(whole * 8).unwrap_or(0);
        self.bits -= whole * 8;
    }

    /// The low `n` bits of `value` (at most 32, with no bits above them).
    #[inline(always)]
    fn put(&mut self, value: u64, n: u8) {
        debug_assert!(n <= 32 && value >> n == 0);
        self.acc |= value << self.bits;
        self.bits += u32::from(n);
        if self.bits >= 32 {
            self.flush();
        }
    }

    /// Up to 48 bits at once (four literals).
    #[inline(always)]
    fn put_wide(&mut self, value: u64, n: u32) {
        debug_assert!(n <= 48 && value >> n == 0);
        if self.bits > 16 {
            self.flush();
        }
        self.acc |= value << self.bits;
        self.bits += n;
        self.flush();
    }

    /// Pads with zero bits to the next byte boundary.
    fn align(&mut self) {
        self.bits = self.bits.div_ceil(8) * 8;
        self.flush();
    }

    fn bytes(&mut self, b: &[u8]) {
        debug_assert_eq!(self.bits, 0);
        for &x in b {
            self.put(u64::from(x), 8);
        }
    }

    /// Bytes written (after [`Self::align`]).
    fn len(&self) -> usize {
        self.pos
    }

    fn finish(mut self) -> Vec<u8> {
        debug_assert_eq!(self.bits, 0);
        self.out.truncate(self.pos);
        self.out
    }
}

/// The Adler-32 of two byte strings one after the other, from theirs and the second's length (zlib's
/// `adler32_combine`).
fn adler32_combine(first: u32, second: u32, second_len: usize) -> u32 {
    let rem = second_len as u64 % ADLER_BASE;
    let (a1, b1) = (u64::from(first & 0xffff), u64::from(first >> 16));
    let (a2, b2) = (u64::from(second & 0xffff), u64::from(second >> 16));
    let a = (a1 + a2 + ADLER_BASE - 1) % ADLER_BASE;
    let b = (rem * a1 % ADLER_BASE + b1 + b2 + ADLER_BASE - rem) % ADLER_BASE;
    ((b << 16) | a) as u32
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;

    fn inflate(zlib: &[u8]) -> Vec<u8> {
        let mut out = Vec::new();
        flate2::read::ZlibDecoder::new(zlib)
            .read_to_end(&mut out)
            .expect("a valid zlib stream with its checksum");
        out
    }

    fn sub_filtered(data: &[u8], width: usize) -> Vec<u8> {
        // The filter written out longhand, as PNG's specification states it.
        let stride = width * 3;
        let mut out = Vec::new();
        for row in data.chunks(stride) {
            out.push(1);
            for (i, &x) in row.iter().enumerate() {
                out.push(if i < 3 { x } else { x.wrapping_sub(row[i - 3]) });
            }
        }
        out
    }

    fn noise(len: usize, seed: u64) -> Vec<u8> {
        let mut s = seed;
        (0..len)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                (s >> 24) as u8
            })
            .collect()
    }

    /// Noise, flat areas (long zero runs after filtering), short zero runs and gradients, row by row.
    fn mixed(width: usize, height: usize) -> Vec<u8> {
        let n = noise(width * height * 3, 7);
        (0..height)
            .flat_map(|y| (0..width * 3).map(move |x| (x, y)))
            .map(|(x, y)| match y % 5 {
                0 => n[y * width * 3 + x],
                1 => 40,
                2 => (x / 3) as u8,
                3 => (n[y * width * 3 + x] % 4).wrapping_add((x / 3) as u8),
                _ => {
                    if (x / 3) % 7 < 5 {
                        0
                    } else {
                        n[y * width * 3 + x]
                    }
                }
            })
            .collect()
    }

    #[test]
    fn strips_inflate_to_the_filtered_rows_with_the_stream_checksum() {
        for (w, h) in [(1, 1), (3, 5), (2, 40), (64, 64), (100, 37), (512, 512), (600, 17)] {
            let halves: Vec<u8> =
                noise(w * h * 3 / 2, 2).into_iter().chain(mixed(w, h)).take(w * h * 3).collect();
            for data in [noise(w * h * 3, 1), vec![0; w * h * 3], vec![200; w * h * 3], mixed(w, h), halves] {
                let want = sub_filtered(&data, w);
                for strips in [Some(1), Some(2), Some(3), Some(8), None] {
                    let got = inflate(&zlib_image_data(&data, w, strips));
                    assert!(got == want, "{w}x{h}, {strips:?} strips: inflated bytes differ");
                }
            }
        }
    }

    #[test]
    fn noise_is_stored_and_smooth_rows_are_huffman_coded() {
        let (w, h) = (64, 32);
        let btype = |data: &[u8]| (deflate_strip(data, w * 3, true).deflated[0] >> 1) & 3;
        assert_eq!(btype(&noise(w * h * 3, 4)), 0, "noise: stored");
        assert_eq!(btype(&mixed(w, h)), 2, "mixed rows: dynamic Huffman");
        // Sampled rows smooth, the others noise: every literal keeps a code, so the block still decodes.
        let striped: Vec<u8> = (0..h)
            .flat_map(|y| if y % SAMPLED_ROW == 0 { vec![7; w * 3] } else { noise(w * 3, y as u64 + 1) })
            .collect();
        assert_eq!(btype(&striped), 2);
        assert_eq!(inflate(&zlib_image_data(&striped, w, Some(1))), sub_filtered(&striped, w));
    }

    #[test]
    fn an_empty_image_is_a_valid_empty_stream() {
        assert!(inflate(&zlib_image_data(&[], 0, None)).is_empty());
    }

    #[test]
    fn flat_and_noise_like_rows_compress_as_expected() {
        let (w, h) = (512, 512);
        let flat = zlib_image_data(&vec![90; w * h * 3], w, Some(4));
        assert!(flat.len() < 10_000, "a flat image is runs of zeros: {} bytes", flat.len());
        // Noise cannot shrink; the Huffman code must not inflate it by more than its headers and a bit per byte.
        let raw = w * h * 3 + h;
        let noisy = zlib_image_data(&noise(w * h * 3, 3), w, Some(4));
        assert!(noisy.len() < raw + raw / 8, "noise grew from {raw} to {} bytes", noisy.len());
    }

    #[test]
    fn code_lengths_respect_the_limit_and_fill_the_code_space() {
        // Fibonacci frequencies make the deepest unlimited tree.
        let mut fib = vec![1u32, 1];
        while fib.len() < 30 {
            let n = fib[fib.len() - 1] + fib[fib.len() - 2];
            fib.push(n);
        }
        for (freq, limit) in
            [(fib.clone(), 15), (fib[..19].to_vec(), 7), (vec![5, 0, 0, 1], 15), (vec![0, 3], 7)]
        {
            let lengths = code_lengths(&freq, limit);
            assert!(lengths.iter().all(|&l| usize::from(l) <= limit));
            assert!(
                freq.iter().zip(&lengths).all(|(&f, &l)| f == 0 || l > 0),
                "every used symbol has a code"
            );
            let kraft: f64 = lengths.iter().filter(|&&l| l > 0).map(|&l| 0.5f64.powi(i32::from(l))).sum();
            assert!((kraft - 1.0).abs() < 1e-12, "{freq:?}: Kraft sum {kraft}");
        }
    }

    #[test]
    fn adler_of_parts_combines_to_the_whole() {
        let data = noise(200_000, 9);
        let adler = |d: &[u8]| {
            let mut a = simd_adler32::Adler32::new();
            a.write(d);
            a.finish()
        };
        for cut in [0, 1, 5552, 65521, 131_042, 199_999, 200_000] {
            let (x, y) = data.split_at(cut);
            assert_eq!(adler32_combine(adler(x), adler(y), y.len()), adler(&data), "cut at {cut}");
        }
    }
}
