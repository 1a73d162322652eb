//! Random input never panics the native job parser: seeded random JSON values and raw bytes go through the
//! body parser and validation directly (many iterations) and over HTTP (fewer), where every answer must be a
//! client error or an accepted job — never a 5xx or a dropped connection.

mod common;

use sdhive_engine::{Control, Engine, EngineError, EngineInfo, GenerateOutput, GenerateRequest, Progress};
use sdhive_protocol::JobRequest;
use sdhive_server::extract::parse_json;
use sdhive_server::validation::build_request;
use sdhive_server::{EngineLoader, ServerConfig};
use serde_json::{json, Map, Value};

/// xorshift64*: deterministic, so a failure reproduces from its seed.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }

    fn pick<'a, T>(&mut self, items: &'a [T]) -> &'a T {
        &items[self.below(items.len() as u64) as usize]
    }
}

const FIELDS: [&str; 16] = [
    "prompt",
    "negative_prompt",
    "steps",
    "cfg_scale",
    "width",
    "height",
    "seed",
    "n",
    "sampler",
    "scheduler",
    "clip_skip",
    "init_image",
    "strength",
    "mask",
    "preview_every",
    "bogus",
];

fn random_string(rng: &mut Rng) -> String {
    match rng.below(6) {
        0 => String::new(),
        1 => rng
            .pick(&["Euler a", "DPM++ 2M Karras", "karras", "Automatic", "heun", "data:image/png;base64,"])
            .to_string(),
        2 => {
            "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8BQDwAEhQGAhKmMIQAAAABJRU5ErkJggg=="
                .into()
        }
        3 => "🐱(word:1.3) BREAK [x]".repeat(rng.below(4) as usize),
        _ => (0..rng.below(40)).map(|_| char::from_u32(rng.below(0x3000) as u32).unwrap_or('?')).collect(),
    }
}

fn random_number(rng: &mut Rng) -> Value {
    match rng.below(8) {
        0 => json!(0),
        1 => json!(-1),
        2 => json!(rng.below(200)),
        3 => json!(u64::MAX),
        4 => json!(i64::MIN),
        5 => json!(1e300),
        6 => json!(-0.5),
        _ => json!((rng.below(1_000_000) as f64) / 1000.0),
    }
}

fn random_value(rng: &mut Rng, depth: u32) -> Value {
    match rng.below(if depth == 0 { 4 } else { 6 }) {
        0 => Value::Null,
        1 => json!(rng.below(2) == 0),
        2 => random_number(rng),
        3 => Value::String(random_string(rng)),
        4 => Value::Array((0..rng.below(4)).map(|_| random_value(rng, depth - 1)).collect()),
        _ => random_object(rng, depth - 1),
    }
}

/// Mostly the request's own field names, with plausible and implausible values.
fn random_object(rng: &mut Rng, depth: u32) -> Value {
    let mut map = Map::new();
    for _ in 0..rng.below(8) {
        let key = if rng.below(10) == 0 { random_string(rng) } else { rng.pick(&FIELDS).to_string() };
        let value = match rng.below(3) {
            0 => random_number(rng),
            1 => Value::String(random_string(rng)),
            _ => random_value(rng, depth),
        };
        map.insert(key, value);
    }
    Value::Object(map)
}

fn random_bytes(rng: &mut Rng) -> Vec<u8> {
    let len = rng.below(300) as usize;
    let mut bytes: Vec<u8> = (0..len).map(|_| rng.below(256) as u8).collect();
    if rng.below(2) == 0 && !bytes.is_empty() {
        bytes[0] = b'{';
    }
    bytes
}

#[test]
fn parser_and_validation_never_panic() {
    let limits = sdhive_engine::Limits::default();
    for seed in 1..=4000u64 {
        let mut rng = Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1);
        let body = if seed % 4 == 0 {
            random_bytes(&mut rng)
        } else {
            serde_json::to_vec(&random_object(&mut rng, 2)).unwrap()
        };
        if let Ok(req) = parse_json::<JobRequest>(&body) {
            let _ = build_request(&req, &limits, 1 << 20);
        }
    }
}

/// Finishes every job at once with no images, so accepted fuzz jobs cost nothing.
struct NullEngine;

impl Engine for NullEngine {
    fn info(&self) -> EngineInfo {
        EngineInfo {
            engine: "null".into(),
            backend: "cpu".into(),
            device: "none".into(),
            dtype: "f32".into(),
            model: "null".into(),
            family: "sd1".into(),
            native_width: 64,
            native_height: 64,
            samplers: vec![],
            supports_img2img: true,
            supports_inpaint: true,
            memory: None,
            text_widths: Vec::new(),
            preview: Default::default(),
        }
    }

    fn generate(
        &mut self,
        _req: &GenerateRequest,
        _progress: &mut dyn FnMut(&Progress) -> Control,
    ) -> Result<GenerateOutput, EngineError> {
        Ok(GenerateOutput { images: vec![] })
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_answers_random_bodies_with_client_errors() {
    let loader: EngineLoader = Box::new(|| Ok(Box::new(NullEngine) as Box<dyn Engine>));
    let server =
        common::start_with(ServerConfig { max_body_bytes: 4096, ..common::config() }, loader, None).await;
    for seed in 1..=300u64 {
        let mut rng = Rng(seed.wrapping_mul(0xd134_2543_de82_ef95) | 1);
        let body = if seed % 3 == 0 {
            random_bytes(&mut rng)
        } else {
            serde_json::to_vec(&random_object(&mut rng, 2)).unwrap()
        };
        let r = server
            .client
            .post(server.url("/v1/jobs"))
            .header("content-type", "application/json")
            .body(body.clone())
            .send()
            .await
            .unwrap_or_else(|e| panic!("seed {seed}: connection failed: {e}"));
        let status = r.status().as_u16();
        assert!(
            matches!(status, 202 | 400 | 413 | 429),
            "seed {seed}: {status} for {}",
            String::from_utf8_lossy(&body)
        );
        if status != 202 {
            let error: Value =
                r.json().await.unwrap_or_else(|e| panic!("seed {seed}: error body not JSON: {e}"));
            assert!(error["error"]["message"].is_string(), "seed {seed}: {error}");
        }
    }
    assert_eq!(server.get("/ready").await.status(), 200);
    server.shutdown().await.unwrap();
}
