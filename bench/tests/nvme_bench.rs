//! The real `nvme_bench` binary on a small session in temporary directories: the mixed
//! RAM + two-link decode section runs both striping modes over real page files and checks
//! itself (both modes must promote the same keep-sets; it panics otherwise).

use std::process::Command;

#[test]
fn mixed_decode_section_runs_both_striping_modes() {
    let slow = tempfile::tempdir().unwrap();
    let fast = tempfile::tempdir().unwrap();
    let o = Command::new(env!("CARGO_BIN_EXE_nvme_bench"))
        .args(["--tokens", "4096", "--only", "mixed", "--mixed-steps", "2"])
        .arg("--dir")
        .arg(slow.path())
        .arg("--fast-dir")
        .arg(fast.path().join("link"))
        .args(["--workers", "2", "--cold-frac", "0.5"])
        .output()
        .expect("run nvme_bench");
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(
        o.status.success(),
        "nvme_bench failed: {}\n{out}",
        String::from_utf8_lossy(&o.stderr)
    );
    let rows: Vec<Vec<&str>> = out
        .lines()
        .map(|l| l.split_whitespace().collect::<Vec<_>>())
        .filter(|w| w.len() == 9 && (w[0] == "proportional" || w[0] == "uniform"))
        .collect();
    assert_eq!(rows.len(), 2, "one row per mode:\n{out}");
    for w in &rows {
        let mb: f64 = w[1].parse::<f64>().unwrap() + w[2].parse::<f64>().unwrap();
        assert!(
            mb > 0.0,
            "{}: the keep-set read something from NVMe:\n{out}",
            w[0]
        );
    }
    assert!(out.contains("proportional fetch vs uniform"), "{out}");
}
