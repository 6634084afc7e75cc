//! The deployment files: the systemd unit, the Dockerfile and the Kubernetes manifests are
//! checked with the tools their platforms use, offline.
#![allow(clippy::disallowed_methods)] // a real-world client: real clocks, real randomness

use crate::common::fleet::BIN;
use crate::repo;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use timeoutd::config::Config;

/// The value of `Key=` in a unit file, as a duration in seconds.
fn unit_seconds(unit: &str, key: &str) -> Duration {
    let value = unit
        .lines()
        .find_map(|l| l.strip_prefix(key)?.strip_prefix('='))
        .unwrap_or_else(|| panic!("{key} missing from the unit"));
    humantime::parse_duration(value.trim()).unwrap()
}

#[test]
fn systemd_unit_verifies_and_outlasts_the_drain() {
    let unit = std::fs::read_to_string(repo("systemd/timeoutd.service")).unwrap();
    // verify checks that ExecStart exists: point it at the binary just built.
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("timeoutd.service");
    std::fs::write(&path, unit.replace("/usr/local/bin/timeoutd", BIN)).unwrap();
    let out = Command::new("systemd-analyze")
        .arg("verify")
        .arg(&path)
        .output()
        .expect("systemd-analyze (Debian package systemd)");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(stderr.trim().is_empty(), "warnings: {stderr}");

    let out = Command::new("systemd-analyze")
        .args(["security", "--offline=yes", "--no-pager"])
        .arg(&path)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    let exposure: f64 = text
        .lines()
        .find_map(|l| l.split_once("Overall exposure level for timeoutd.service: "))
        .and_then(|(_, rest)| rest.split_whitespace().next()?.parse().ok())
        .unwrap_or_else(|| panic!("no exposure level in: {text}"));
    assert!(exposure <= 2.0, "exposure {exposure}: {text}");

    // systemd must not kill a drain that timeoutd itself bounds.
    let d = Config::default().dispatch;
    let drain = d.shutdown_timeout + timeoutd::service::shutdown::GRACE;
    assert!(unit_seconds(&unit, "TimeoutStopSec") > drain);
    // The watchdog must allow the three poll intervals that /healthz allows.
    assert!(unit_seconds(&unit, "WatchdogSec") > d.poll_interval * 3);
    assert!(unit.contains("Type=notify"));
    assert!(unit.contains("RestartPreventExitStatus=2"));
}

/// A tool that scripts/install-validators.sh installs into .tools/venv/bin.
fn tool(name: &str) -> PathBuf {
    let path = repo(".tools/venv/bin").join(name);
    assert!(
        path.is_file(),
        "{} is missing: run scripts/install-validators.sh",
        path.display()
    );
    path
}

/// The Dockerfile's instructions as (KEYWORD, arguments), continuation lines joined.
fn dockerfile_instructions(text: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut pending = String::new();
    for line in text.lines() {
        let line = line.trim();
        if line.starts_with('#') || (line.is_empty() && pending.is_empty()) {
            continue;
        }
        match line.strip_suffix('\\') {
            Some(start) => {
                pending.push_str(start);
                pending.push(' ');
            }
            None => {
                pending.push_str(line);
                let (keyword, args) = pending.split_once(' ').unwrap_or((&pending, ""));
                let args = args.split_whitespace().collect::<Vec<_>>().join(" ");
                out.push((keyword.to_uppercase(), args));
                pending.clear();
            }
        }
    }
    out
}

/// The numeric user of the Dockerfile's last USER instruction.
fn dockerfile_uid() -> u32 {
    let text = std::fs::read_to_string(repo("Dockerfile")).unwrap();
    let user = dockerfile_instructions(&text)
        .into_iter()
        .rfind(|(k, _)| k == "USER")
        .expect("the Dockerfile has no USER")
        .1;
    let uid = user.split(':').next().unwrap();
    uid.parse()
        .unwrap_or_else(|_| panic!("USER {user} is not numeric: Kubernetes cannot check it"))
}

#[test]
fn dockerfile_passes_hadolint() {
    // A clean environment and directory: no HADOLINT_* variables, no user or project
    // hadolint config that could switch rules off.
    let dir = tempfile::tempdir().unwrap();
    let out = Command::new(tool("hadolint"))
        .env_clear()
        .current_dir(dir.path())
        .arg("--no-color")
        .arg(repo("Dockerfile"))
        .output()
        .unwrap();
    let text =
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "hadolint failed:\n{text}");
    assert!(text.trim().is_empty(), "hadolint findings:\n{text}");

    let text = std::fs::read_to_string(repo("Dockerfile")).unwrap();
    let instructions = dockerfile_instructions(&text);
    let args = |keyword: &str| -> Vec<&str> {
        instructions
            .iter()
            .filter(|(k, _)| k == keyword)
            .map(|(_, a)| a.as_str())
            .collect()
    };
    assert_eq!(args("ENTRYPOINT"), [r#"["timeoutd", "run"]"#]);
    let healthcheck = args("HEALTHCHECK");
    assert!(
        healthcheck.len() == 1 && healthcheck[0].ends_with(r#"CMD ["timeoutd", "health"]"#),
        "HEALTHCHECK must run `timeoutd health` in exec form (no shell in the image): {healthcheck:?}"
    );
    assert_eq!(args("EXPOSE"), ["9464"]);
    assert_eq!(args("STOPSIGNAL"), ["SIGTERM"]);
    // The image names its build: the OCI labels come from build args, and the commit reaches
    // the binary (build.rs reads TIMEOUTD_GIT_REVISION; .git is not in the build context).
    let labels = args("LABEL").join(" ");
    for (label, arg) in [
        ("revision", "REVISION"),
        ("version", "VERSION"),
        ("source", "SOURCE"),
    ] {
        assert!(
            labels.contains(&format!("org.opencontainers.image.{label}=\"${{{arg}}}\"")),
            "no OCI {label} label from the {arg} build arg: {labels}"
        );
        assert!(
            args("ARG").iter().any(|a| a.starts_with(arg)),
            "no ARG {arg}"
        );
    }
    assert!(
        args("ENV").contains(&"TIMEOUTD_GIT_REVISION=${REVISION}"),
        "the build stage must hand REVISION to build.rs"
    );
    assert!(
        args("COPY").iter().any(|c| c.contains("build.rs")),
        "build.rs must be copied into the build stage"
    );
    assert_ne!(dockerfile_uid(), 0, "the image must not run as root");
    let froms = args("FROM");
    assert!(
        froms.first().is_some_and(|f| f.starts_with("rust:1.95")),
        "the build stage must use the project's toolchain, 1.95: {froms:?}"
    );
    assert!(
        text.contains("/usr/local/bin/timeoutd") && text.contains("/etc/timeoutd/timeoutd.toml"),
        "the binary must be on PATH and the config at the daemon's system path"
    );
}

/// Runs scripts/validate-kubernetes.py on the paths; its exit status and output.
fn validate_kubernetes(paths: &[&Path]) -> (bool, String) {
    let out = Command::new(tool("python"))
        .arg(repo("scripts/validate-kubernetes.py"))
        .args(paths)
        .output()
        .unwrap();
    let text =
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    (out.status.success(), text)
}

const MANIFESTS: &[&str] = &[
    "cli-job.example.yaml",
    "configmap.yaml",
    "deployment.yaml",
    "kustomization.yaml",
    "pdb.yaml",
    "prometheusrule.yaml",
    "secret.example.yaml",
    "service.yaml",
    "servicemonitor.yaml",
];

#[test]
fn kubernetes_manifests_validate_offline() {
    let dir = repo("config/kubernetes");
    let mut files: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    files.sort();
    assert_eq!(
        files, MANIFESTS,
        "config/kubernetes changed: update MANIFESTS"
    );

    let (ok, text) = validate_kubernetes(&[&dir]);
    assert!(ok, "config/kubernetes does not validate:\n{text}");
    assert!(
        text.contains(&format!("ok: {} document(s), strict", MANIFESTS.len())),
        "not every manifest was checked:\n{text}"
    );

    // The validator must reject what a cluster would: a copy of the directory per mistake.
    let broken = [
        // (file, replace, with, what the validator must say)
        (
            "deployment.yaml",
            "readinessProbe:",
            "readinesProbe:",
            "'readinesProbe' was unexpected",
        ),
        (
            "deployment.yaml",
            "replicas: 3",
            "replicas: \"3\"",
            "spec.replicas",
        ),
        (
            "deployment.yaml",
            "kind: Deployment",
            "kind: Deploymnet",
            "Couldn't find schema for kind Deploymnet",
        ),
        (
            "servicemonitor.yaml",
            "scrapeTimeout:",
            "scrapeTimout:",
            "scrapeTimout: Extra inputs are not permitted",
        ),
        (
            "servicemonitor.yaml",
            "interval: 15s",
            "interval: 15 seconds",
            "spec.endpoints.0.interval",
        ),
        (
            "pdb.yaml",
            "  name: timeoutd",
            "  name: timeoutd\n  name: again",
            "duplicate key 'name'",
        ),
        (
            "prometheusrule.yaml",
            "- alert: TimeoutdAbsent",
            "- alrt: TimeoutdAbsent",
            "alrt: Extra inputs are not permitted",
        ),
        (
            "kustomization.yaml",
            "- pdb.yaml",
            "- pdbs.yaml",
            "pdbs.yaml does not exist",
        ),
    ];
    let tmp = tempfile::tempdir().unwrap();
    let mut copies = Vec::new();
    for (i, (file, from, to, _)) in broken.iter().enumerate() {
        let copy = tmp.path().join(format!("broken{i}"));
        std::fs::create_dir(&copy).unwrap();
        for name in MANIFESTS {
            let text = std::fs::read_to_string(dir.join(name)).unwrap();
            let text = if name == file {
                assert!(text.contains(from), "{file} no longer contains {from:?}");
                text.replacen(from, to, 1)
            } else {
                text
            };
            std::fs::write(copy.join(name), text).unwrap();
        }
        copies.push(copy);
    }
    let paths: Vec<&Path> = copies.iter().map(|p| p.as_path()).collect();
    let (ok, text) = validate_kubernetes(&paths);
    assert!(!ok, "the validator accepted broken manifests:\n{text}");
    for ((file, _, to, message), copy) in broken.iter().zip(&copies) {
        let expected = format!("{}: ", copy.join(file).display());
        assert!(
            text.lines()
                .any(|l| l.starts_with(&expected) && l.contains(message)),
            "{file} with {to:?} was not rejected with {message:?}:\n{text}"
        );
    }
}

/// The parts of the manifests the tests below read; serde ignores the rest (the validator
/// above checks all of it against the schemas).
mod k8s {
    use std::collections::BTreeMap;

    use serde::Deserialize;

    pub type Labels = BTreeMap<String, String>;

    #[derive(Deserialize)]
    pub struct Meta {
        pub name: String,
        #[serde(default)]
        pub labels: Labels,
    }

    #[derive(Deserialize)]
    #[serde(rename_all = "camelCase")]
    pub struct Selector {
        pub match_labels: Labels,
    }

    #[derive(Deserialize)]
    pub struct Deployment {
        pub metadata: Meta,
        pub spec: DeploymentSpec,
    }

    #[derive(Deserialize)]
    pub struct DeploymentSpec {
        pub replicas: u32,
        pub selector: Selector,
        pub template: PodTemplate,
    }

    #[derive(Deserialize)]
    pub struct PodTemplate {
        pub metadata: TemplateMeta,
        pub spec: PodSpec,
    }

    /// A pod template's metadata has no name.
    #[derive(Deserialize)]
    pub struct TemplateMeta {
        pub labels: Labels,
    }

    #[derive(Deserialize)]
    #[serde(rename_all = "camelCase")]
    pub struct PodSpec {
        pub termination_grace_period_seconds: u64,
        pub security_context: PodSecurityContext,
        pub containers: Vec<Container>,
        pub volumes: Vec<Volume>,
    }

    #[derive(Deserialize)]
    #[serde(rename_all = "camelCase")]
    pub struct PodSecurityContext {
        pub run_as_non_root: bool,
        pub run_as_user: u32,
        pub run_as_group: u32,
    }

    #[derive(Deserialize)]
    #[serde(rename_all = "camelCase")]
    pub struct Container {
        pub args: Vec<String>,
        pub ports: Vec<ContainerPort>,
        pub env: Vec<EnvVar>,
        pub volume_mounts: Vec<VolumeMount>,
        pub startup_probe: Option<Probe>,
        pub liveness_probe: Probe,
        pub readiness_probe: Probe,
    }

    #[derive(Deserialize)]
    #[serde(rename_all = "camelCase")]
    pub struct ContainerPort {
        pub name: String,
        pub container_port: u16,
    }

    #[derive(Deserialize)]
    #[serde(rename_all = "camelCase")]
    pub struct EnvVar {
        pub name: String,
        pub value: Option<String>,
        pub value_from: Option<EnvSource>,
    }

    #[derive(Deserialize)]
    #[serde(rename_all = "camelCase")]
    pub struct EnvSource {
        pub secret_key_ref: KeyRef,
    }

    #[derive(Deserialize)]
    pub struct KeyRef {
        pub name: String,
        pub key: String,
    }

    #[derive(Deserialize)]
    #[serde(rename_all = "camelCase")]
    pub struct VolumeMount {
        pub name: String,
        pub mount_path: String,
    }

    #[derive(Deserialize)]
    #[serde(rename_all = "camelCase")]
    pub struct Volume {
        pub name: String,
        pub config_map: NameRef,
    }

    #[derive(Deserialize)]
    pub struct NameRef {
        pub name: String,
    }

    #[derive(Deserialize)]
    #[serde(rename_all = "camelCase")]
    pub struct Probe {
        pub http_get: HttpGet,
        pub period_seconds: u64,
        pub failure_threshold: u64,
    }

    #[derive(Deserialize)]
    pub struct HttpGet {
        pub path: String,
        pub port: String,
    }

    #[derive(Deserialize)]
    pub struct ConfigMap {
        pub metadata: Meta,
        pub data: BTreeMap<String, String>,
    }

    #[derive(Deserialize)]
    #[serde(rename_all = "camelCase")]
    pub struct Secret {
        pub metadata: Meta,
        pub string_data: BTreeMap<String, String>,
    }

    #[derive(Deserialize)]
    pub struct Service {
        pub metadata: Meta,
        pub spec: ServiceSpec,
    }

    #[derive(Deserialize)]
    pub struct ServiceSpec {
        pub selector: Labels,
        pub ports: Vec<ServicePort>,
    }

    #[derive(Deserialize)]
    #[serde(rename_all = "camelCase")]
    pub struct ServicePort {
        pub name: String,
        pub port: u16,
        pub target_port: String,
    }

    #[derive(Deserialize)]
    pub struct Pdb {
        pub spec: PdbSpec,
    }

    #[derive(Deserialize)]
    #[serde(rename_all = "camelCase")]
    pub struct PdbSpec {
        pub max_unavailable: Option<u32>,
        pub min_available: Option<u32>,
        pub selector: Selector,
    }

    #[derive(Deserialize)]
    pub struct ServiceMonitor {
        pub spec: ServiceMonitorSpec,
    }

    #[derive(Deserialize)]
    pub struct ServiceMonitorSpec {
        pub selector: Selector,
        pub endpoints: Vec<Endpoint>,
    }

    #[derive(Deserialize)]
    pub struct Endpoint {
        pub port: String,
        pub path: String,
    }
}

fn manifest<T: serde::de::DeserializeOwned>(name: &str) -> T {
    let path = repo("config/kubernetes").join(name);
    let text = std::fs::read_to_string(&path).unwrap();
    serde_saphyr::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// The ConfigMap's timeoutd.toml.
fn configmap_toml() -> String {
    let cm: k8s::ConfigMap = manifest("configmap.yaml");
    cm.data
        .get("timeoutd.toml")
        .expect("the ConfigMap has no timeoutd.toml")
        .clone()
}

#[test]
fn kubernetes_grace_and_probes_match_the_daemon() {
    let deployment: k8s::Deployment = manifest("deployment.yaml");
    let pod = &deployment.spec.template.spec;
    assert_eq!(deployment.spec.replicas, 3);
    let [container] = pod.containers.as_slice() else {
        panic!("one container expected");
    };

    // Kubernetes must not SIGKILL a drain that timeoutd itself bounds.
    let config = Config::from_toml(&configmap_toml())
        .unwrap_or_else(|e| panic!("the ConfigMap's timeoutd.toml: {e}"));
    let drain = config.dispatch.shutdown_timeout + timeoutd::service::shutdown::GRACE;
    let grace = Duration::from_secs(pod.termination_grace_period_seconds);
    assert!(
        grace > drain,
        "terminationGracePeriodSeconds {grace:?} <= drain {drain:?}"
    );
    let defaults = Config::default().dispatch;
    assert!(grace > defaults.shutdown_timeout + timeoutd::service::shutdown::GRACE);

    // Probes: liveness and startup on /healthz, readiness on /readyz, on the metrics port,
    // which is the port the ConfigMap's [http] listen binds.
    let startup = container.startup_probe.as_ref();
    assert_eq!(container.liveness_probe.http_get.path, "/healthz");
    assert_eq!(container.readiness_probe.http_get.path, "/readyz");
    assert!(startup.is_none_or(|p| p.http_get.path == "/healthz"));
    let probes = [&container.liveness_probe, &container.readiness_probe]
        .into_iter()
        .chain(startup);
    for probe in probes {
        assert_eq!(probe.http_get.port, "metrics");
    }
    let metrics = container
        .ports
        .iter()
        .find(|p| p.name == "metrics")
        .expect("no container port named metrics");
    assert_eq!(metrics.container_port, config.http.listen.port());
    assert!(
        config.http.listen.ip().is_unspecified(),
        "probes come from the node: listen on all addresses"
    );
    // /healthz turns 503 after three poll intervals without progress; liveness must not
    // restart a pod faster than that.
    let live = &container.liveness_probe;
    assert!(
        Duration::from_secs(live.period_seconds * live.failure_threshold)
            > config.dispatch.poll_interval * 3
    );

    // The ConfigMap is config/timeoutd.toml with JSON logs, nothing else.
    let mut local =
        Config::from_toml(&std::fs::read_to_string(repo("config/timeoutd.toml")).unwrap()).unwrap();
    local.log.format = timeoutd::config::LogFormat::Json;
    assert_eq!(
        config, local,
        "the ConfigMap's timeoutd.toml differs from config/timeoutd.toml"
    );

    // The pod runs as the image's user.
    let security = &pod.security_context;
    assert!(security.run_as_non_root);
    assert_eq!(security.run_as_user, dockerfile_uid());
    assert_eq!(security.run_as_group, dockerfile_uid());
}

#[test]
fn kubernetes_manifests_are_wired_together() {
    let deployment: k8s::Deployment = manifest("deployment.yaml");
    let cm: k8s::ConfigMap = manifest("configmap.yaml");
    let secret: k8s::Secret = manifest("secret.example.yaml");
    let service: k8s::Service = manifest("service.yaml");
    let pdb: k8s::Pdb = manifest("pdb.yaml");
    let monitor: k8s::ServiceMonitor = manifest("servicemonitor.yaml");
    let pod = &deployment.spec.template.spec;
    let container = &pod.containers[0];
    let pod_labels = &deployment.spec.template.metadata.labels;
    let selects = |selector: &k8s::Labels, labels: &k8s::Labels| {
        !selector.is_empty() && selector.iter().all(|(k, v)| labels.get(k) == Some(v))
    };
    let name = "app.kubernetes.io/name";
    for labels in [
        &deployment.metadata.labels,
        pod_labels,
        &service.metadata.labels,
        &cm.metadata.labels,
    ] {
        assert_eq!(labels.get(name).map(String::as_str), Some("timeoutd"));
    }
    assert!(selects(&deployment.spec.selector.match_labels, pod_labels));
    assert!(
        selects(&service.spec.selector, pod_labels),
        "the Service selects no pod"
    );
    assert!(
        selects(&pdb.spec.selector.match_labels, pod_labels),
        "the PDB selects no pod"
    );
    assert!(
        selects(
            &monitor.spec.selector.match_labels,
            &service.metadata.labels
        ),
        "the ServiceMonitor selects no Service"
    );

    // With three replicas a drain leaves at least two.
    let replicas = deployment.spec.replicas;
    let left = match (pdb.spec.max_unavailable, pdb.spec.min_available) {
        (Some(max), None) => replicas - max,
        (None, Some(min)) => min,
        _ => panic!("the PDB needs one of maxUnavailable and minAvailable"),
    };
    assert!(left >= 2, "a drain may leave {left} replicas");

    // Scraping: ServiceMonitor -> Service port metrics -> container port metrics -> /metrics.
    let [port] = service.spec.ports.as_slice() else {
        panic!("one Service port expected");
    };
    assert_eq!(
        (port.name.as_str(), port.target_port.as_str()),
        ("metrics", "metrics")
    );
    assert_eq!(port.port, 9464);
    assert!(container.ports.iter().any(|p| p.name == port.target_port));
    assert!(
        monitor
            .spec
            .endpoints
            .iter()
            .all(|e| e.port == "metrics" && e.path == "/metrics")
    );

    // The config file: the ConfigMap mounted where --config points.
    let volume = pod
        .volumes
        .iter()
        .find(|v| v.config_map.name == cm.metadata.name)
        .expect("the ConfigMap is not mounted");
    let mount = container
        .volume_mounts
        .iter()
        .find(|m| m.name == volume.name)
        .expect("the config volume is not mounted");
    let file = format!("{}/timeoutd.toml", mount.mount_path);
    assert_eq!(container.args, ["--config", file.as_str()]);
    assert_eq!(file, timeoutd::config::SYSTEM_CONFIG_PATH);

    // The environment: every TIMEOUTD_* name is one timeoutd reads, the URIs come from the
    // Secret (keys the example has), and the daemon accepts the result.
    let dir = tempfile::tempdir().unwrap();
    let config_path = dir.path().join("timeoutd.toml");
    std::fs::write(&config_path, configmap_toml()).unwrap();
    let mut cmd = Command::new(BIN);
    cmd.env_clear()
        .arg("--config")
        .arg(&config_path)
        .arg("check-config");
    for var in &container.env {
        let value = match (&var.value, &var.value_from) {
            (Some(v), None) => v.clone(),
            (None, Some(from)) => {
                let key_ref = &from.secret_key_ref;
                assert_eq!(
                    key_ref.name, secret.metadata.name,
                    "{} reads another Secret",
                    var.name
                );
                secret
                    .string_data
                    .get(&key_ref.key)
                    .unwrap_or_else(|| panic!("the Secret example has no key {}", key_ref.key))
                    .clone()
            }
            _ => panic!("{}: one of value and valueFrom", var.name),
        };
        cmd.env(&var.name, value);
    }
    for uri in ["TIMEOUTD_MONGODB__URI", "TIMEOUTD_RABBITMQ__URI"] {
        assert!(
            container
                .env
                .iter()
                .any(|v| v.name == uri && v.value_from.is_some()),
            "{uri} must come from the Secret"
        );
    }
    let out = cmd.output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "check-config with the pod's environment: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains("@mongodb:27017"),
        "the Secret's MongoDB URI was not used:\n{stdout}"
    );
    assert!(
        stdout.contains("@rabbitmq:5672"),
        "the Secret's RabbitMQ URI was not used:\n{stdout}"
    );
    assert!(
        !stdout.contains("CHANGE-ME:CHANGE-ME"),
        "check-config showed a password:\n{stdout}"
    );
}
