use sdhive_schedulers::*;
#[test]
fn dbg() {
    let cfg = SchedulerConfig::from_json_str(r#"{"beta_start":0.00085,"beta_end":0.012,"beta_schedule":"scaled_linear","rescale_betas_zero_snr":true}"#).unwrap();
    let ac = alphas_cumprod(SamplerKind::Ddim, &cfg).unwrap();
    let s: Vec<String> = ac.iter().map(|v| format!("{:e}", v)).collect();
    std::fs::write("/tmp/dbg/ac.txt", s.join("\n")).unwrap();
}
