//! The real `tierbench` binary with `--spawn` against a real `tierd` (both built with
//! `cargo build`, or named by `KVTIER_TEST_TIERBENCH` and `KVTIER_TEST_TIERD`): small
//! geometry, few steps, JSON checked.

use std::process::Command;

use kvtier_tests::bins;
use serde_json::Value;

#[test]
fn spawn_small_matrix_writes_json_and_skips_what_does_not_fit() {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("out.json");
    let o = Command::new(bins::tierbench())
        .arg("--spawn")
        .arg("--tierd")
        .arg(bins::tierd())
        .args([
            "--small",
            "--sessions",
            "1,3",
            "--contexts",
            "128,100000000",
        ])
        .args([
            "--steps",
            "5",
            "--max-seconds",
            "60",
            "--rtt-requests",
            "50",
        ])
        .args(["--host-budget-mib", "32", "--json"])
        .arg(&json)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert!(
        o.status.success(),
        "stdout: {stdout}\nstderr: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(stdout.contains("machine: ") && stdout.contains("command: "));
    assert!(stdout.contains("tierd stopped: exit status: 0"), "{stdout}");

    let v: Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    assert!(v["server"].as_str().unwrap().starts_with("tierd "));
    assert_eq!(v["geometry"]["layers"], 1);
    assert_eq!(v["geometry"]["head_dim"], 8);
    let cells = v["cells"].as_array().unwrap();
    assert_eq!(cells.len(), 4);
    for c in cells {
        let sessions = c["sessions"].as_u64().unwrap();
        if c["context"] == 128 {
            assert!(c["skipped"].is_null(), "{c}");
            // L=1: one request per step per session, every step completed.
            assert_eq!(c["steps_completed"], 5 * sessions, "{c}");
            assert_eq!(c["layer_decodes"], 5 * sessions, "{c}");
            let l = &c["latency"];
            let (p50, p99, max) = (
                l["p50_us"].as_f64().unwrap(),
                l["p99_us"].as_f64().unwrap(),
                l["max_us"].as_f64().unwrap(),
            );
            assert!(0.0 < p50 && p50 <= p99 && p99 <= max, "{c}");
            assert!(c["tokens_per_s"].as_f64().unwrap() > 0.0);
        } else {
            // 100M tokens cannot fit 32 MiB: reported as skipped, never run.
            assert!(c["skipped"].as_str().unwrap().contains("needs"), "{c}");
            assert_eq!(c["layer_decodes"], 0);
            assert!(c["latency"].is_null());
        }
    }
    assert_eq!(v["rtt"]["requests"], 50);
    assert_eq!(v["rtt"]["target_p50_us"], 50.0);
    assert!(v["rtt"]["latency"]["p50_us"].as_f64().unwrap() > 0.0);
}
