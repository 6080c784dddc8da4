//! The reports' rendering, against fixed inputs.

use super::*;

fn stats(pairs: &[(&str, u64)]) -> StatsReply {
    StatsReply {
        entries: pairs.iter().map(|(k, v)| (k.to_string(), *v)).collect(),
    }
}

#[test]
fn tier_rows_only_for_reported_keys() {
    let s = stats(&[
        ("uptime_ms", 5),
        ("host_bytes_used", 10),
        ("host_bytes_capacity", 100),
        ("host_extents_used", 1),
        ("bytes_touched_total", 7),
    ]);
    let t = Tiers::from_stats(&s);
    assert_eq!(
        t.tiers,
        vec![TierRow {
            tier: "host".into(),
            bytes_used: Some(10),
            bytes_capacity: Some(100),
            extents_used: Some(1),
        }]
    );
    // A daemon that adds an NVMe tier gets a second row, host still first.
    let s = stats(&[
        ("nvme_bytes_capacity", 1 << 30),
        ("host_bytes_used", 0),
        ("nvme_bytes_used", 4096),
    ]);
    let t = Tiers::from_stats(&s);
    let names: Vec<_> = t.tiers.iter().map(|r| r.tier.as_str()).collect();
    assert_eq!(names, ["host", "nvme"]);
    assert_eq!(t.tiers[1].bytes_used, Some(4096));
    assert_eq!(t.tiers[1].extents_used, None);
    assert!(t.render().contains("1.0 GiB"));
    assert!(t.nvme_links.is_empty() && !t.render().contains("NVMe devices"));
    assert_eq!(Tiers::from_stats(&stats(&[])).tiers, vec![]);
}

#[test]
fn nvme_links_from_stats_in_device_order() {
    let s = stats(&[
        ("nvme_bytes_used", 0),
        ("nvme_dev1_read_bytes_per_s", 2_000_000_000),
        ("nvme_dev0_read_bytes_per_s", 1_395_864_371),
        ("nvme_dev0_read_latency_ns", 85_000),
        ("nvme_dev0_write_bytes_per_s", 0),
        ("nvme_dev0_write_latency_ns", 0),
        ("nvme_dev1_read_latency_ns", 1_500_000),
        // A gap ends the list: dev3 without dev2 is not shown.
        ("nvme_dev3_read_bytes_per_s", 1),
    ]);
    let links = NvmeLink::from_stats(&s);
    assert_eq!(links.len(), 2);
    assert_eq!(
        links[0],
        NvmeLink {
            device: 0,
            read_bytes_per_s: 1_395_864_371,
            read_latency_ns: 85_000,
            write_bytes_per_s: 0,
            write_latency_ns: 0,
        }
    );
    assert_eq!(
        links[0].render(),
        "read 1.3 GiB/s (85 us), write not measured yet"
    );
    assert_eq!(links[1].write_bytes_per_s, 0, "missing keys read as 0");
    let t = Tiers::from_stats(&s);
    let out = t.render();
    assert!(
        out.contains("NVMe devices") && out.contains("  dev1  read 1.9 GiB/s (1.5 ms)"),
        "{out}"
    );
    assert!(NvmeLink::from_stats(&stats(&[("sessions", 1)])).is_empty());
    let unresolved = NvmeLink {
        write_bytes_per_s: 1 << 30,
        ..links[0].clone()
    };
    assert!(
        unresolved
            .render()
            .ends_with("write 1.0 GiB/s (latency not resolved)"),
        "{}",
        unresolved.render()
    );
}

#[test]
fn stats_render_sorted_with_human_bytes() {
    let s = Stats::from_stats(&stats(&[("sessions", 2), ("host_bytes_used", 3 << 20)]));
    assert_eq!(
        s.render(),
        "host_bytes_used  3145728 (3.0 MiB)\nsessions         2\n"
    );
}

/// STATE names every tier holding the session's bytes, the remote tier's included.
#[test]
fn state_names_every_tier_holding_the_session() {
    let at = |host_bytes, nvme_bytes, remote_bytes, pinned| {
        Session(SessionInfo {
            host_bytes,
            nvme_bytes,
            remote_bytes,
            pinned,
            ..at_info()
        })
        .state_cell()
    };
    assert_eq!(at(1, 0, 0, false), "ram");
    assert_eq!(at(1, 1, 0, true), "ram+nvme pinned");
    assert_eq!(at(0, 0, 1, false), "remote");
    assert_eq!(at(1, 0, 1, false), "ram+remote");
    assert_eq!(at(0, 1, 1, false), "nvme+remote");
    assert_eq!(at(0, 0, 0, false), "-");
    let info = Session(SessionInfo {
        remote_bytes: 4096,
        ..at_info()
    });
    assert!(
        info.render(0).contains("remote bytes:"),
        "{}",
        info.render(0)
    );
}

fn at_info() -> SessionInfo {
    SessionInfo {
        session: 1,
        owner_uid: 0,
        label: String::new(),
        geometry: kvtier_protocol::Geometry::new(1, 1, 1, 8, kvtier_protocol::DType::Bf16, 16),
        policy: kvtier_protocol::Policy::default(),
        tokens_min: 1,
        tokens_max: 1,
        blocks: 1,
        host_bytes: 0,
        nvme_bytes: 0,
        remote_bytes: 0,
        pinned: false,
        damaged: false,
        created_unix_ms: 0,
        last_access_unix_ms: 0,
    }
}
