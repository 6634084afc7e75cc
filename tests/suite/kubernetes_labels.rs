//! Many fleets side by side in Kubernetes: every manifest carries the recommended
//! `app.kubernetes.io/*` labels, and every selector picks one fleet's dispatchers by the
//! labels that do not change on an upgrade (name, instance, component), never by version, so
//! that neither another fleet's pods nor a one-shot CLI Job is selected.
#![allow(clippy::disallowed_methods)] // a real-world client: real clocks, real randomness

use crate::repo;
use std::collections::BTreeMap;

use serde_json::Value;

const RECOMMENDED: [&str; 6] = [
    "name",
    "instance",
    "version",
    "component",
    "part-of",
    "managed-by",
];
const SELECTED_BY: [&str; 3] = ["name", "instance", "component"];

/// Every manifest of config/kubernetes but the Kustomization, by file name.
fn manifests() -> BTreeMap<String, Value> {
    let dir = repo("config/kubernetes");
    std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .filter(|n| n.ends_with(".yaml") && n != "kustomization.yaml")
        .map(|n| {
            let text = std::fs::read_to_string(dir.join(&n)).unwrap();
            let doc: Value = serde_saphyr::from_str(&text).unwrap_or_else(|e| panic!("{n}: {e}"));
            (n, doc)
        })
        .collect()
}

fn labels(v: &Value) -> BTreeMap<String, String> {
    v.as_object()
        .into_iter()
        .flatten()
        .map(|(k, v)| (k.clone(), v.as_str().unwrap_or_default().to_string()))
        .collect()
}

fn key(short: &str) -> String {
    format!("app.kubernetes.io/{short}")
}

#[test]
fn every_manifest_and_pod_carries_the_recommended_labels() {
    let all = manifests();
    assert!(all.len() >= 7, "{:?}", all.keys());
    for (file, doc) in &all {
        let mut sets = vec![("metadata", labels(&doc["metadata"]["labels"]))];
        if !doc["spec"]["template"].is_null() {
            sets.push((
                "pod template",
                labels(&doc["spec"]["template"]["metadata"]["labels"]),
            ));
        }
        for (where_, set) in sets {
            for short in RECOMMENDED {
                assert!(
                    set.get(&key(short)).is_some_and(|v| !v.is_empty()),
                    "{file} {where_}: no {}",
                    key(short)
                );
            }
            assert_eq!(set[&key("name")], "timeoutd", "{file}");
            assert_eq!(set[&key("instance")], "timeoutd", "{file}");
            assert_eq!(set[&key("part-of")], "timeoutd", "{file}");
            assert_eq!(
                set[&key("version")],
                env!("CARGO_PKG_VERSION"),
                "{file}: the version label follows Cargo.toml"
            );
        }
    }
    // The image the Deployment runs is the version its labels name.
    let image = all["deployment.yaml"]["spec"]["template"]["spec"]["containers"][0]["image"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    assert_eq!(image, format!("timeoutd:{}", env!("CARGO_PKG_VERSION")));
}

#[test]
fn every_selector_picks_one_fleets_dispatchers_by_stable_labels() {
    let all = manifests();
    let deployment = &all["deployment.yaml"];
    let pods = labels(&deployment["spec"]["template"]["metadata"]["labels"]);
    let mut selectors = vec![
        (
            "Deployment",
            labels(&deployment["spec"]["selector"]["matchLabels"]),
        ),
        ("Service", labels(&all["service.yaml"]["spec"]["selector"])),
        (
            "PodDisruptionBudget",
            labels(&all["pdb.yaml"]["spec"]["selector"]["matchLabels"]),
        ),
    ];
    for c in deployment["spec"]["template"]["spec"]["topologySpreadConstraints"]
        .as_array()
        .expect("topologySpreadConstraints")
    {
        selectors.push((
            "topologySpreadConstraint",
            labels(&c["labelSelector"]["matchLabels"]),
        ));
    }
    for (what, selector) in &selectors {
        let keys: Vec<&str> = selector.keys().map(String::as_str).collect();
        let mut want: Vec<String> = SELECTED_BY.iter().map(|s| key(s)).collect();
        want.sort();
        assert_eq!(keys, want, "{what} selects by {keys:?}");
        for (k, v) in selector {
            assert_eq!(pods.get(k), Some(v), "{what}: {k} does not match the pods");
        }
    }
    // The ServiceMonitor selects the Service the same way.
    let monitor = labels(&all["servicemonitor.yaml"]["spec"]["selector"]["matchLabels"]);
    let service = labels(&all["service.yaml"]["metadata"]["labels"]);
    assert_eq!(monitor.len(), SELECTED_BY.len(), "{monitor:?}");
    for (k, v) in &monitor {
        assert_eq!(service.get(k), Some(v), "ServiceMonitor: {k}");
    }
    // A one-shot CLI Job of the same fleet is selected by none of them.
    let job = &all["cli-job.example.yaml"];
    let job_pods = labels(&job["spec"]["template"]["metadata"]["labels"]);
    for (what, selector) in &selectors {
        assert!(
            !selector.iter().all(|(k, v)| job_pods.get(k) == Some(v)),
            "{what} selects the CLI Job's pod"
        );
    }
}
