//! The worker set for Envoy: with `--eds-file PATH` the sidecar writes the current members as an
//! EDS resource (a `DiscoveryResponse` holding one `ClusterLoadAssignment`), which Envoy reads
//! through a filesystem `path_config_source` that watches the file's directory. So the
//! `override_host` cluster of the workers (`envoy/render.py --sidecar`) follows membership, and
//! a retry can go to any worker the filter ranked, with no Envoy restart.
//!
//! Written atomically (a temporary file in the same directory, then a rename), as Envoy's
//! watched-directory source expects: Envoy never reads a half-written file. A starting sidecar
//! writes nothing until its membership sources name a worker (`reconcile` in main.rs): a
//! restart must not empty the cluster Envoy is routing with.

use crate::membership::WorkerSpec;
use serde_json::json;
use std::path::Path;

/// The EDS resource for `workers`, version `version`.
pub fn resource(cluster: &str, version: u64, workers: &[&WorkerSpec]) -> serde_json::Value {
    let endpoints: Vec<serde_json::Value> = workers
        .iter()
        .map(|w| {
            json!({"endpoint": {"address": {"socket_address": {
                "address": w.addr.ip().to_string(),
                "port_value": w.addr.port(),
            }}}})
        })
        .collect();
    json!({
        "version_info": version.to_string(),
        "resources": [{
            "@type": "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment",
            "cluster_name": cluster,
            "endpoints": [{"lb_endpoints": endpoints}],
        }],
    })
}

/// Writes the resource to `path` atomically.
pub fn write(
    path: &Path,
    cluster: &str,
    version: u64,
    workers: &[&WorkerSpec],
) -> Result<(), String> {
    let text = serde_json::to_vec_pretty(&resource(cluster, version, workers))
        .map_err(|e| format!("eds: {e}"))?;
    let name = path
        .file_name()
        .ok_or_else(|| format!("eds: {} has no file name", path.display()))?;
    let tmp = path.with_file_name(format!(".{}.tmp", name.to_string_lossy()));
    std::fs::write(&tmp, text).map_err(|e| format!("eds: {}: {e}", tmp.display()))?;
    std::fs::rename(&tmp, path).map_err(|e| format!("eds: {}: {e}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_resource_lists_every_worker_address() {
        let a = WorkerSpec {
            name: "a".into(),
            addr: "10.0.0.1:8000".parse().unwrap(),
            events: None,
            replay: None,
        };
        let b = WorkerSpec {
            name: "b".into(),
            addr: "[::1]:9000".parse().unwrap(),
            events: None,
            replay: None,
        };
        let r = resource("mmrouter_workers", 3, &[&a, &b]);
        assert_eq!(r["version_info"], "3");
        let lb = &r["resources"][0]["endpoints"][0]["lb_endpoints"];
        assert_eq!(
            lb[0]["endpoint"]["address"]["socket_address"]["address"],
            "10.0.0.1"
        );
        assert_eq!(
            lb[1]["endpoint"]["address"]["socket_address"]["address"],
            "::1"
        );
        assert_eq!(
            lb[1]["endpoint"]["address"]["socket_address"]["port_value"],
            9000
        );
        let dir = std::env::temp_dir().join(format!("eds-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("workers.json");
        write(&path, "mmrouter_workers", 1, &[&a]).unwrap();
        let back: serde_json::Value =
            serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
        assert_eq!(back["resources"][0]["cluster_name"], "mmrouter_workers");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
