//! `cargo xtask k8s`: the Kubernetes manifests (`deploy/kubernetes`) and the container build file
//! (`deploy/docker/Dockerfile`) checked offline, as CI does: no cluster, kubectl or Docker daemon here.
//!
//! 1. `deploy/lint/k8s_check.py` renders the base kustomization and the autoscale overlay (the subset of kustomize
//!    they use) and validates every resource with kubernetes-validate's strict schemas for each pinned Kubernetes
//!    version; CRDs (KEDA's ScaledObject) against the schemas in `deploy/lint/schemas`.
//! 2. Every hive container's command line goes through the real `hive config` (same flags as `serve`), with its
//!    environment and stand-ins for the downward API and the Secret: a misspelt flag fails here.
//! 3. checkov (frameworks kubernetes and dockerfile) on the rendered manifests and the Dockerfile, and hadolint on
//!    the Dockerfile: any failure fails, except the checks in `deploy/lint/skips.txt`, each with a justification.
//! 4. A self-check: the same tools on the deliberately broken files in `deploy/lint/broken` must reject each for
//!    the reason it was broken, so a validator that silently passes everything fails the task.
//!
//! The tools live in a venv outside the clone (`~/.cache/sdhive/k8s-venv-<key>`, keyed by
//! `deploy/lint/requirements.txt` and the Python version), made on first use and reused after.

use crate::util::{cargo, target_dir, workspace_root};
use anyhow::{bail, Context, Result};
use serde_json::Value;
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::Instant;

/// Oldest and newest Kubernetes the manifests must be valid for (kubernetes-validate 1.37 ships 1.25–1.37).
const K8S_VERSIONS: [&str; 2] = ["1.33.0", "1.37.0"];
const REQUIREMENTS: &str = "deploy/lint/requirements.txt";
const SKIPS: &str = "deploy/lint/skips.txt";
const CHECKER: &str = "deploy/lint/k8s_check.py";
const MANIFESTS: &str = "deploy/kubernetes";
const OVERLAYS: [&str; 1] = ["overlays/autoscale"];
/// Manifests outside every kustomization that are validated all the same.
const EXTRAS: [&str; 1] = ["secret.example.yaml"];
const DOCKERFILE: &str = "deploy/docker/Dockerfile";
const BROKEN: &str = "deploy/lint/broken";

pub fn run() -> Result<()> {
    let started = Instant::now();
    let root = workspace_root();
    let skips = Skips::parse(&read(&root.join(SKIPS))?).with_context(|| format!("in {SKIPS}"))?;
    let venv = Venv::ensure(&root)?;
    let installed = started.elapsed();

    let out = target_dir().join("k8s-rendered");
    if out.exists() {
        std::fs::remove_dir_all(&out).with_context(|| format!("removing {}", out.display()))?;
    }
    let mut args = vec![CHECKER.to_string(), "check".into(), MANIFESTS.into(), "--out".into()];
    args.push(out.to_string_lossy().into_owned());
    for overlay in OVERLAYS {
        args.extend(["--overlay".into(), overlay.into()]);
    }
    for extra in EXTRAS {
        args.extend(["--extra".into(), extra.into()]);
    }
    args.extend(version_args());
    let validated = venv.run(&root, "python", &args)?;
    echo(&validated);
    if !validated.status.success() {
        bail!("the Kubernetes manifests did not validate (errors above)");
    }

    let mut rendered: Vec<PathBuf> = vec![out.join("base.yaml")];
    rendered
        .extend(OVERLAYS.iter().map(|o| out.join(format!("{}.yaml", o.trim_matches('/').replace('/', "-")))));
    // The very build `cargo xtask webui` makes (same packages, so the same features, and the profile of the
    // end-to-end tests): in CI it is already done.
    cargo(&root, &["build", "--quiet", "-p", "sdhive-hive", "-p", "sd-worker-cpu", "--profile", "test"])?;
    let hive = target_dir().join("debug").join("hive");
    let mut args = vec![CHECKER.to_string(), "commands".into(), "--hive".into()];
    args.push(hive.to_string_lossy().into_owned());
    args.extend(rendered.iter().map(|p| p.to_string_lossy().into_owned()));
    let commands = venv.run(&root, "python", &args)?;
    echo(&commands);
    if !commands.status.success() {
        bail!("the hive refused a container's command line (above)");
    }

    let mut scanned = rendered;
    scanned.push(root.join(DOCKERFILE));
    let report = checkov(&venv, &root, &scanned)?;
    report.require_frameworks(&["kubernetes", "dockerfile"])?;
    let failed = skips.filter_checkov(&report, true)?;
    if !failed.is_empty() {
        for f in &failed {
            eprintln!("checkov: {} {} — {} ({})", f.id, f.name, f.resource, f.file);
        }
        bail!(
            "checkov: {} failed checks (fix them, or skip one in {SKIPS} with a justification)",
            failed.len()
        );
    }
    eprintln!(
        "xtask: checkov passed ({} checks passed, skipped: {})",
        report.passed,
        skips.checkov().join(" ")
    );

    let hado = hadolint(&venv, &root, &root.join(DOCKERFILE), &skips)?;
    echo(&hado);
    if !hado.status.success() {
        bail!("hadolint failed on {DOCKERFILE} (findings above)");
    }
    eprintln!("xtask: hadolint passed ({DOCKERFILE})");

    self_check(&root, &venv, &skips, &hive)?;
    eprintln!(
        "xtask: k8s checks passed in {:.1} s (of which {:.1} s for the venv)",
        started.elapsed().as_secs_f64(),
        installed.as_secs_f64()
    );
    Ok(())
}

/// Each broken file must be rejected, for the reason it was broken.
fn self_check(root: &Path, venv: &Venv, skips: &Skips, hive: &Path) -> Result<()> {
    let broken = root.join(BROKEN);
    let args = [CHECKER, "commands", "--hive"].map(String::from).into_iter().chain([
        hive.to_string_lossy().into_owned(),
        broken.join("bad-command.yaml").to_string_lossy().into_owned(),
    ]);
    let out = venv.run(root, "python", &args.collect::<Vec<_>>())?;
    let text = String::from_utf8_lossy(&out.stdout);
    if out.status.success() || !text.contains("unexpected argument '--no-such-flag'") {
        bail!("self-check: the command-line check did not reject bad-command.yaml's --no-such-flag:\n{text}");
    }

    let schema_cases = [
        ("invalid-type.yaml", "spec.replicas: 'two' is not of type 'integer'"),
        ("misspelt-field.yaml", "('limit' was unexpected)"),
        ("invalid-scaledobject.yaml", "'threshold' is a required property"),
        ("invalid-scaledobject.yaml", "('minReplicas' was unexpected)"),
    ];
    let mut args = vec![CHECKER.to_string(), "files".into()];
    let files: BTreeSet<&str> = schema_cases.iter().map(|(f, _)| *f).collect();
    args.extend(files.iter().map(|f| broken.join(f).to_string_lossy().into_owned()));
    args.extend(version_args());
    let out = venv.run(root, "python", &args)?;
    let text = String::from_utf8_lossy(&out.stdout);
    if out.status.success() {
        bail!("self-check: the schema validation accepted the broken manifests in {BROKEN}:\n{text}");
    }
    for (file, reason) in schema_cases {
        if !text.lines().any(|l| l.starts_with("ERROR") && l.contains(file) && l.contains(reason)) {
            bail!("self-check: the schema validation did not reject {file} for {reason:?}; it said:\n{text}");
        }
    }

    let pod = broken.join("insecure-pod.yaml");
    let dockerfile = broken.join("Dockerfile");
    let report = checkov(venv, root, &[pod, dockerfile.clone()])?;
    let failed: BTreeSet<String> = skips.filter_checkov(&report, false)?.into_iter().map(|f| f.id).collect();
    // Privileged, no CPU/memory limits, a `latest` image; the Dockerfile's `latest` base and root user.
    for id in ["CKV_K8S_16", "CKV_K8S_11", "CKV_K8S_13", "CKV_K8S_14", "CKV_DOCKER_7", "CKV_DOCKER_8"] {
        if !failed.contains(id) {
            bail!("self-check: checkov did not fail {id} on the broken files in {BROKEN} (it failed {failed:?})");
        }
    }

    let hado = hadolint(venv, root, &dockerfile, skips)?;
    let said = String::from_utf8_lossy(&hado.stdout);
    if hado.status.success() || !said.contains("DL3007") || !said.contains("DL3002") {
        bail!(
            "self-check: hadolint did not fail the broken Dockerfile on DL3007 and DL3002; it said:\n{said}"
        );
    }
    eprintln!("xtask: self-check: every validator rejects its broken file in {BROKEN}");
    Ok(())
}

fn version_args() -> Vec<String> {
    K8S_VERSIONS.iter().flat_map(|v| ["-k".to_string(), (*v).to_string()]).collect()
}

fn checkov(venv: &Venv, root: &Path, files: &[PathBuf]) -> Result<CheckovReport> {
    // --skip-download: no network for policy metadata (none here; CI must not depend on it). Skips are applied
    // by `Skips`, so that a skip that no longer matches a failure is noticed.
    let mut args: Vec<String> = ["--framework", "kubernetes", "dockerfile", "--compact", "--skip-download"]
        .into_iter()
        .chain(["--output", "json"])
        .map(String::from)
        .collect();
    for f in files {
        args.extend(["--file".into(), f.to_string_lossy().into_owned()]);
    }
    let out = venv.run(root, "checkov", &args)?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    // Exit status 1 means "failed checks" as well as a crash: the JSON tells them apart.
    CheckovReport::parse(&stdout).with_context(|| {
        format!("checkov ({}) gave no report; it said:\n{}", out.status, String::from_utf8_lossy(&out.stderr))
    })
}

fn hadolint(venv: &Venv, root: &Path, dockerfile: &Path, skips: &Skips) -> Result<Output> {
    let mut args = vec!["--no-color".to_string()];
    for id in skips.hadolint() {
        args.extend(["--ignore".into(), id.into()]);
    }
    args.push(dockerfile.to_string_lossy().into_owned());
    venv.run(root, "hadolint", &args)
}

fn echo(out: &Output) {
    eprint!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
}

fn read(path: &Path) -> Result<String> {
    std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))
}

/// The tools' virtual environment: `~/.cache/sdhive/k8s-venv-<key>`, the key a hash of the pinned requirements
/// and the interpreter's version, so a changed pin or Python makes a new one. A venv counts only once its
/// install finished (a marker file); a half-made one is replaced.
struct Venv {
    dir: PathBuf,
}

impl Venv {
    fn ensure(root: &Path) -> Result<Venv> {
        let python =
            std::env::var("SDHIVE_PYTHON").ok().filter(|p| !p.is_empty()).unwrap_or_else(|| "python3".into());
        let version = Command::new(&python)
            .args(["-c", "import sys; print(sys.version)"])
            .output()
            .with_context(|| format!("running {python}: cargo xtask k8s needs Python 3 with venv"))?;
        if !version.status.success() {
            bail!("{python} -c 'import sys' failed: {}", String::from_utf8_lossy(&version.stderr));
        }
        let requirements = read(&root.join(REQUIREMENTS))?;
        let key = fnv1a(&[requirements.as_bytes(), &version.stdout]);
        let home = std::env::var_os("HOME").filter(|h| !h.is_empty()).context("HOME is not set")?;
        let cache = Path::new(&home).join(".cache/sdhive");
        let dir = cache.join(format!("k8s-venv-{key:016x}"));
        let marker = dir.join("sdhive-installed");
        if marker.is_file() {
            eprintln!("xtask: reusing the venv {}", dir.display());
            return Ok(Venv { dir });
        }
        remove_venvs(&cache)?;
        let started = Instant::now();
        let run = |cmd: &mut Command, what: &str| -> Result<()> {
            let status = cmd.status().with_context(|| format!("starting {what}"))?;
            if !status.success() {
                bail!("{what} failed ({status})");
            }
            Ok(())
        };
        run(
            Command::new(&python).args(["-m", "venv", "--clear"]).arg(&dir),
            &format!("{python} -m venv {} (on Debian: apt-get install python3-venv)", dir.display()),
        )?;
        run(
            Command::new(dir.join("bin/python"))
                .args(["-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--requirement"])
                .arg(root.join(REQUIREMENTS)),
            &format!("pip install of {REQUIREMENTS}"),
        )?;
        std::fs::write(&marker, &requirements).with_context(|| format!("writing {}", marker.display()))?;
        eprintln!("xtask: made the venv {} in {:.1} s", dir.display(), started.elapsed().as_secs_f64());
        Ok(Venv { dir })
    }

    /// Runs the venv's `tool` in `root`, capturing its output.
    fn run(&self, root: &Path, tool: &str, args: &[String]) -> Result<Output> {
        let exe = self.dir.join("bin").join(tool);
        eprintln!("xtask: {tool} {}", args.join(" "));
        Command::new(&exe)
            .args(args)
            .current_dir(root)
            .output()
            .with_context(|| format!("running {}", exe.display()))
    }
}

/// Earlier venvs (other pins) are 300 MB each, and a half-made one is remade: none is kept.
fn remove_venvs(cache: &Path) -> Result<()> {
    let Ok(entries) = std::fs::read_dir(cache) else { return Ok(()) };
    for entry in entries.flatten() {
        let path = entry.path();
        if entry.file_name().to_string_lossy().starts_with("k8s-venv-") && path.is_dir() {
            std::fs::remove_dir_all(&path).with_context(|| format!("removing {}", path.display()))?;
        }
    }
    Ok(())
}

fn fnv1a(parts: &[&[u8]]) -> u64 {
    parts
        .iter()
        .flat_map(|p| p.iter())
        .fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ u64::from(*b)).wrapping_mul(0x100_0000_01b3))
}

/// `deploy/lint/skips.txt`: `ID justification` per line; `CKV…` ids are checkov's, `DL…`/`SC…` hadolint's.
#[derive(Debug)]
struct Skips {
    ids: Vec<String>,
}

impl Skips {
    fn parse(text: &str) -> Result<Skips> {
        let mut ids = Vec::new();
        for (n, line) in text.lines().enumerate() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let (id, why) = line.split_once(char::is_whitespace).unwrap_or((line, ""));
            let known = Self::is_checkov(id) || Self::is_hadolint(id);
            if !known {
                bail!(
                    "line {}: {id:?} is neither a checkov (CKV_…) nor a hadolint (DL…, SC…) check id",
                    n + 1
                );
            }
            if why.split_whitespace().count() < 3 {
                bail!("line {}: skipping {id} needs a one-line justification after the id", n + 1);
            }
            if ids.iter().any(|i| i == id) {
                bail!("line {}: {id} is listed twice", n + 1);
            }
            ids.push(id.to_string());
        }
        Ok(Skips { ids })
    }

    fn is_checkov(id: &str) -> bool {
        let rest = id.strip_prefix("CKV_").or_else(|| id.strip_prefix("CKV2_"));
        rest.is_some_and(|r| {
            r.contains('_') && r.chars().all(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_')
        })
    }

    fn is_hadolint(id: &str) -> bool {
        let digits = id.strip_prefix("DL").or_else(|| id.strip_prefix("SC"));
        digits.is_some_and(|d| d.len() == 4 && d.chars().all(|c| c.is_ascii_digit()))
    }

    fn checkov(&self) -> Vec<&str> {
        self.ids.iter().map(String::as_str).filter(|i| Self::is_checkov(i)).collect()
    }

    fn hadolint(&self) -> Vec<&str> {
        self.ids.iter().map(String::as_str).filter(|i| Self::is_hadolint(i)).collect()
    }

    /// The failures not skipped. With `all_used`, an error when a checkov skip matches no failure: the check
    /// passes now, and the skip would only hide a future regression.
    fn filter_checkov(&self, report: &CheckovReport, all_used: bool) -> Result<Vec<Finding>> {
        let unused: Vec<&str> =
            self.checkov().into_iter().filter(|id| !report.failed.iter().any(|f| f.id == *id)).collect();
        if all_used && !unused.is_empty() {
            bail!("{SKIPS} skips {unused:?}, which no longer fail: remove them");
        }
        Ok(report.failed.iter().filter(|f| !self.ids.contains(&f.id)).cloned().collect())
    }
}

#[derive(Debug, Clone)]
struct Finding {
    id: String,
    name: String,
    file: String,
    resource: String,
}

/// What matters of checkov's `--output json`: one report per framework (a list, or one object when a single
/// framework ran).
#[derive(Debug)]
struct CheckovReport {
    failed: Vec<Finding>,
    passed: u64,
    /// Frameworks that scanned at least one resource.
    frameworks: BTreeSet<String>,
}

impl CheckovReport {
    fn parse(json: &str) -> Result<CheckovReport> {
        let value: Value = serde_json::from_str(json.trim()).context("checkov's output is not JSON")?;
        let reports = match value {
            Value::Array(list) => list,
            one @ Value::Object(_) => vec![one],
            other => bail!("checkov's JSON is neither a report nor a list of them: {other}"),
        };
        let mut report = CheckovReport { failed: Vec::new(), passed: 0, frameworks: BTreeSet::new() };
        for r in &reports {
            let framework = r["check_type"].as_str().context("a checkov report without check_type")?;
            let summary = &r["summary"];
            let parsing_errors = summary["parsing_errors"].as_u64().unwrap_or(0);
            if parsing_errors > 0 {
                bail!(
                    "checkov could not parse {parsing_errors} {framework} files: {}",
                    r["results"]["parsing_errors"]
                );
            }
            report.passed += summary["passed"].as_u64().unwrap_or(0);
            if summary["resource_count"].as_u64().unwrap_or(0) > 0 {
                report.frameworks.insert(framework.to_string());
            }
            let failed = r["results"]["failed_checks"].as_array().map(Vec::as_slice).unwrap_or_default();
            for f in failed {
                let text = |k: &str| f[k].as_str().unwrap_or("?").to_string();
                report.failed.push(Finding {
                    id: text("check_id"),
                    name: text("check_name"),
                    file: text("file_path"),
                    resource: text("resource"),
                });
            }
        }
        Ok(report)
    }

    /// A file checkov did not recognise is scanned by no framework and passes silently: refuse that.
    fn require_frameworks(&self, frameworks: &[&str]) -> Result<()> {
        for f in frameworks {
            if !self.frameworks.contains(*f) {
                bail!(
                    "checkov scanned no {f} resource: the files were not recognised ({:?} did)",
                    self.frameworks
                );
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_repositorys_skip_list_parses_and_every_entry_is_justified() {
        let skips = Skips::parse(&read(&workspace_root().join(SKIPS)).unwrap()).unwrap();
        assert!(!skips.checkov().is_empty());
        assert_eq!(skips.hadolint(), ["DL3008"]);
    }

    #[test]
    fn a_skip_without_justification_or_with_an_unknown_id_is_refused() {
        let err = Skips::parse("# c\nCKV_K8S_43\n").unwrap_err().to_string();
        assert!(err.contains("line 2") && err.contains("justification"), "{err}");
        let err = Skips::parse("CKV_K8S_43 ok\n").unwrap_err().to_string();
        assert!(err.contains("justification"), "{err}");
        let err = Skips::parse("K8S_43 because it is fine here\n").unwrap_err().to_string();
        assert!(err.contains("neither a checkov"), "{err}");
        let err = Skips::parse("DL3008 a b c\nDL3008 a b c\n").unwrap_err().to_string();
        assert!(err.contains("twice"), "{err}");
        let ok = Skips::parse("CKV2_K8S_6 no policy here yet\nSC2086 word splitting is intended\n").unwrap();
        assert_eq!((ok.checkov(), ok.hadolint()), (vec!["CKV2_K8S_6"], vec!["SC2086"]));
    }

    fn report(failed: &[(&str, &str)]) -> String {
        let checks: Vec<Value> = failed
            .iter()
            .map(|(id, file)| serde_json::json!({"check_id": id, "check_name": "n", "file_path": file, "resource": "r"}))
            .collect();
        serde_json::json!([
            {"check_type": "kubernetes", "summary": {"passed": 5, "failed": checks.len(), "parsing_errors": 0,
             "resource_count": 3}, "results": {"failed_checks": checks}},
            {"check_type": "dockerfile", "summary": {"passed": 2, "failed": 0, "parsing_errors": 0,
             "resource_count": 1}, "results": {"failed_checks": []}}
        ])
        .to_string()
    }

    #[test]
    fn checkov_failures_are_filtered_by_the_skips_and_stale_skips_are_refused() {
        let skips = Skips::parse("CKV_K8S_43 no published image to take a digest of\n").unwrap();
        let r =
            CheckovReport::parse(&report(&[("CKV_K8S_43", "/a.yaml"), ("CKV_K8S_16", "/a.yaml")])).unwrap();
        assert_eq!(r.passed, 7);
        r.require_frameworks(&["kubernetes", "dockerfile"]).unwrap();
        let left: Vec<String> = skips.filter_checkov(&r, true).unwrap().into_iter().map(|f| f.id).collect();
        assert_eq!(left, ["CKV_K8S_16"]);
        let clean = CheckovReport::parse(&report(&[])).unwrap();
        let err = skips.filter_checkov(&clean, true).unwrap_err().to_string();
        assert!(err.contains("no longer fail") && err.contains("CKV_K8S_43"), "{err}");
    }

    #[test]
    fn a_checkov_run_that_scanned_nothing_or_crashed_is_an_error() {
        let single = r#"{"check_type": "kubernetes", "summary": {"passed": 0, "failed": 0, "parsing_errors": 0,
                        "resource_count": 0}, "results": {"failed_checks": []}}"#;
        let r = CheckovReport::parse(single).unwrap();
        assert!(r.require_frameworks(&["kubernetes"]).unwrap_err().to_string().contains("no kubernetes"));
        assert!(CheckovReport::parse("Traceback (most recent call last):").is_err());
        let unparsed = r#"{"check_type": "kubernetes", "summary": {"parsing_errors": 1},
                           "results": {"parsing_errors": ["/x.yaml"]}}"#;
        assert!(CheckovReport::parse(unparsed).unwrap_err().to_string().contains("could not parse"));
    }
}
