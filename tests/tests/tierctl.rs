//! The real `tierctl` binary against a real `tierd` process started by the test (both built
//! with `cargo build`, or named by `KVTIER_TEST_TIERCTL` and `KVTIER_TEST_TIERD`). Sessions
//! are created with the protocol client; tierctl's output is checked against what the client
//! created.

use std::os::unix::fs::PermissionsExt;
use std::process::{Command, Output};

use kvtier_protocol::client::Client;
use kvtier_protocol::{DType, Geometry, Policy, PROTOCOL_VERSION};
use kvtier_tests::uid::{as_nobody, euid, is_root, reachable_copy};
use kvtier_tests::{bins, Tierd};
use serde_json::Value;

/// A tierd on the CPU backend with a 64 MiB host tier and a 32 MiB NVMe tier in its private
/// directory, plus `extra` arguments.
fn start(extra: &[&str]) -> Tierd {
    Tierd::builder(bins::tierd())
        .backend("cpu")
        .nvme_capacity("32MiB")
        .args(extra)
        .start()
}

fn client(d: &Tierd) -> Client {
    d.client_as("tierctl-test")
}

fn ctl(d: &Tierd, args: &[&str]) -> Output {
    run(Command::new(bins::tierctl()), d, args)
}

/// tierctl as `nobody`, from a copy it can reach wherever the checkout sits.
fn ctl_as_nobody(d: &Tierd, args: &[&str]) -> Output {
    let exe = reachable_copy(bins::tierctl());
    let mut cmd = Command::new(exe.path());
    as_nobody(&mut cmd);
    run(cmd, d, args)
}

fn run(mut tierctl: Command, d: &Tierd, args: &[&str]) -> Output {
    tierctl.arg("--socket").arg(d.path()).args(args);
    tierctl.output().expect("run tierctl")
}

fn ok(o: &Output) -> String {
    assert_eq!(
        o.status.code(),
        Some(0),
        "stderr: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8(o.stdout.clone()).unwrap()
}

fn json(o: &Output) -> Value {
    serde_json::from_str(&ok(o)).expect("valid JSON")
}

fn err(o: &Output, code: i32) -> String {
    let e = String::from_utf8_lossy(&o.stderr).into_owned();
    let out = String::from_utf8_lossy(&o.stdout);
    assert_eq!(o.status.code(), Some(code), "stderr: {e}\nstdout: {out}");
    e
}

const GEOM: Geometry = Geometry {
    layers: 2,
    q_heads: 4,
    kv_heads: 2,
    head_dim: 16,
    dtype: DType::Bf16,
    block_tokens: 16,
};

/// Bytes of one (layer, block) run of GEOM.
const RUN_BYTES: u64 = 2 * 2 * 16 * 16 * 2;

/// The CLI's size format for the sizes these tests produce (KiB and MiB with one decimal).
fn human_bytes(n: u64) -> String {
    if n < 1 << 20 {
        format!("{:.1} KiB", n as f64 / 1024.0)
    } else {
        format!("{:.1} MiB", n as f64 / (1 << 20) as f64)
    }
}

/// Create a session of `tokens` tokens (bf16 ones, inline append) and return its id.
fn session(c: &mut Client, label: &str, tokens: u32) -> u64 {
    let policy = Policy::bound(1, 2, 3);
    let id = c.create_session(GEOM, policy, label).unwrap();
    let len = GEOM.append_payload_bytes(tokens).unwrap() as usize;
    // bf16 1.0 = 0x3F80.
    let payload: Vec<u8> = [0x80u8, 0x3F].repeat(len / 2);
    assert_eq!(
        c.append_kv(id, 0, tokens, &payload).unwrap(),
        u64::from(tokens)
    );
    id
}

#[test]
fn sessions_info_stats_tier_close() {
    let d = start(&[]);
    let uid = euid();
    let mut c = client(&d);

    let out = ok(&ctl(&d, &["sessions"]));
    assert_eq!(out, "no sessions\n");

    let a = session(&mut c, "alpha", 40);
    let b = session(&mut c, "", 16);

    // sessions --json: both, sorted by id, values as created.
    let v = json(&ctl(&d, &["--json", "sessions"]));
    let list = v["sessions"].as_array().unwrap();
    assert_eq!(list.len(), 2);
    assert!(
        list[0]["id"].as_u64() < list[1]["id"].as_u64(),
        "sorted by id"
    );
    let s = list.iter().find(|s| s["id"] == a).unwrap();
    assert_eq!(s["id"], a);
    assert_eq!(s["owner_uid"], uid);
    assert_eq!(s["label"], "alpha");
    assert_eq!(s["geometry"]["layers"], 2);
    assert_eq!(s["geometry"]["q_heads"], 4);
    assert_eq!(s["geometry"]["kv_heads"], 2);
    assert_eq!(s["geometry"]["head_dim"], 16);
    assert_eq!(s["geometry"]["dtype"], "bf16");
    assert_eq!(s["geometry"]["block_tokens"], 16);
    assert_eq!(s["policy"]["top_k"], 3);
    assert_eq!(s["tokens_min"], 40);
    assert_eq!(s["tokens_max"], 40);
    // 40 tokens at B=16: 3 blocks per layer, 2 layers.
    assert_eq!(s["blocks"], 6);
    // Host bytes count each run's extent: its size rounded up to 4 KiB.
    let frame = RUN_BYTES.next_multiple_of(4096);
    assert_eq!(s["host_bytes"], 6 * frame);
    assert_eq!(s["nvme_bytes"], 0);
    assert_eq!(s["pinned"], false);
    assert!(s["last_access_unix_ms"].as_u64().unwrap() >= s["created_unix_ms"].as_u64().unwrap());
    let sb = list.iter().find(|s| s["id"] == b).unwrap();
    assert_eq!(sb["tokens_max"], 16);
    assert_eq!(sb["blocks"], 2);

    // Human table: a header and one aligned row per session (ids are random: rows are found
    // by their id).
    let out = ok(&ctl(&d, &["sessions"]));
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines.len(), 3, "{out}");
    assert!(lines[0].contains("L/Hq/Hkv/D/dtype/B") && lines[0].contains("LAST ACCESS"));
    let row = |id: &Value| {
        let id = id.to_string();
        *lines[1..]
            .iter()
            .find(|l| l.split_whitespace().next() == Some(id.as_str()))
            .unwrap()
    };
    let (ra, rb) = (row(&a.into()), row(&b.into()));
    assert!(
        ra.contains("alpha") && ra.contains("2/4/2/16/bf16/16"),
        "{out}"
    );
    assert!(ra.contains(&human_bytes(6 * frame)), "{out}");
    assert!(rb.contains(" - "), "empty label shows as -: {out}");

    // session info, JSON and human.
    let v = json(&ctl(&d, &["--json", "session", "info", &a.to_string()]));
    assert_eq!(v["id"], a);
    assert_eq!(v["tokens_max"], 40);
    assert_eq!(v["policy"]["local_blocks"], 2);
    let out = ok(&ctl(&d, &["session", "info", &a.to_string()]));
    assert!(out.contains("label:") && out.contains("alpha"), "{out}");
    assert!(out.contains("sink 1, local 2, top-k 3"), "{out}");
    // `session <ID>` is the same as `session info <ID>` (but for the clock).
    let timeless = |s: &str| -> Vec<String> {
        s.lines()
            .filter(|l| !l.ends_with(" ago"))
            .map(String::from)
            .collect()
    };
    let short = ok(&ctl(&d, &["session", &a.to_string()]));
    assert_eq!(timeless(&short), timeless(&out));

    // stats and status agree with what we did.
    let v = json(&ctl(&d, &["--json", "stats"]));
    let st = &v["stats"];
    assert_eq!(st["sessions"], 2);
    assert_eq!(st["append_tokens_total"], 56);
    assert_eq!(st["host_bytes_used"], 8 * frame);
    assert_eq!(st["host_bytes_capacity"], 64u64 << 20);
    let v = json(&ctl(&d, &["--json", "status"]));
    assert_eq!(v["server_name"], "tierd");
    assert_eq!(v["protocol_version"], PROTOCOL_VERSION);
    assert_eq!(v["sessions"], 2);
    assert_eq!(v["host_bytes_used"], 8 * frame);
    // Nothing freed yet: the free space is one range after the runs (or one per segment).
    let largest = v["host_largest_free_bytes"].as_u64().unwrap();
    assert!(largest > 0 && largest <= (64 << 20) - 8 * frame, "{v}");
    assert!(v["host_free_ranges"].as_u64().unwrap() >= 1, "{v}");
    assert!(v["nvme_largest_free_bytes"].as_u64().unwrap() > 0, "{v}");
    assert!(v["uptime_ms"].as_u64().is_some());
    assert_eq!(v["ready"], true);
    assert!(v["nvme_bytes_capacity"].as_u64().unwrap() > 0, "{v}");
    let rates = &v["rates"];
    assert!(rates["interval_ms"].as_u64().unwrap() >= 400, "{v}");
    assert_eq!(
        rates["append_tokens_per_s"], 0.0,
        "nothing appended while sampling"
    );
    // --interval 0: one STATS and no rates (no wait for a second sample).
    let v = json(&ctl(&d, &["--json", "status", "--interval", "0"]));
    assert!(v["rates"].is_null() && v["sessions"] == 2, "{v}");
    let out = ok(&ctl(&d, &["status"]));
    assert!(out.contains("tierd") && out.contains("64.0 MiB"), "{out}");
    assert!(out.contains("largest free extent"), "{out}");
    assert!(
        out.contains("ready:") && out.contains("yes") && out.contains("rates:"),
        "{out}"
    );

    // tier: the host row and the NVMe row, as the daemon reports them.
    let v = json(&ctl(&d, &["--json", "tier"]));
    let tiers = v["tiers"].as_array().unwrap();
    assert_eq!(tiers.len(), 2, "{v}");
    assert_eq!(tiers[0]["tier"], "host");
    assert_eq!(tiers[0]["bytes_used"], 8 * frame);
    assert_eq!(tiers[0]["bytes_capacity"], 64u64 << 20);
    assert_eq!(tiers[1]["tier"], "nvme");
    // The daemon reserves a little of the page file; the row carries exactly what STATS says.
    let nvme_cap = tiers[1]["bytes_capacity"].as_u64().unwrap();
    assert!((31u64 << 20..=32 << 20).contains(&nvme_cap), "{v}");
    let st = json(&ctl(&d, &["--json", "stats"]));
    assert_eq!(st["stats"]["nvme_bytes_capacity"], nvme_cap);
    let out = ok(&ctl(&d, &["tier"]));
    assert!(
        out.contains("host") && out.contains("nvme") && out.contains("32.0 MiB"),
        "{out}"
    );

    // demote / promote / pin / unpin on b (16 tokens: one block in each of 2 layers).
    let bs = b.to_string();
    let v = json(&ctl(&d, &["--json", "demote", &bs]));
    assert_eq!(
        (v["action"].as_str(), v["blocks"].as_u64()),
        (Some("demoted"), Some(2))
    );
    let v = json(&ctl(&d, &["--json", "session", "info", &bs]));
    assert_eq!(v["host_bytes"], 0, "{v}");
    assert!(v["nvme_bytes"].as_u64().unwrap() > 0, "{v}");
    // The sessions table says where it is now.
    let out = ok(&ctl(&d, &["sessions"]));
    let row = out
        .lines()
        .find(|l| l.trim_start().starts_with(&bs))
        .unwrap();
    assert!(row.contains(" nvme "), "STATE after DEMOTE: {out}");
    let out = ok(&ctl(&d, &["promote", &bs]));
    assert_eq!(
        out,
        format!("promoted session {b}: 2 blocks read into host RAM\n")
    );
    let v = json(&ctl(&d, &["--json", "session", "info", &bs]));
    assert_eq!(v["host_bytes"], 2 * frame, "{v}");
    // The page reads and writes behind demote/promote gave the one device its estimates.
    for cmd in ["tier", "status"] {
        let v = json(&ctl(&d, &["--json", cmd]));
        let links = v["nvme_links"].as_array().unwrap();
        assert_eq!(links.len(), 1, "{v}");
        assert!(links[0]["read_bytes_per_s"].as_u64().unwrap() > 0, "{v}");
        assert!(links[0]["write_bytes_per_s"].as_u64().unwrap() > 0, "{v}");
    }
    let out = ok(&ctl(&d, &["tier"]));
    assert!(out.contains("dev0  read ") && out.contains("/s ("), "{out}");
    let out = ok(&ctl(&d, &["status"]));
    assert!(out.contains("nvme dev0:"), "{out}");
    assert_eq!(ok(&ctl(&d, &["pin", &bs])), format!("pinned session {b}\n"));
    let out = ok(&ctl(&d, &["sessions"]));
    let row = out
        .lines()
        .find(|l| l.trim_start().starts_with(&bs))
        .unwrap();
    assert!(out.contains("STATE") && row.contains(" pinned "), "{out}");
    assert_eq!(
        json(&ctl(&d, &["--json", "session", "info", &bs]))["pinned"],
        true
    );
    let e = err(&ctl(&d, &["demote", &bs]), 6);
    assert!(e.contains("DEMOTE failed: FAILED_PRECONDITION"), "{e}");
    let v = json(&ctl(&d, &["--json", "unpin", &bs]));
    assert_eq!(v["pinned"], false);
    assert_eq!(
        json(&ctl(&d, &["--json", "session", "info", &bs]))["pinned"],
        false
    );
    let e = err(&ctl(&d, &["demote", "999999"]), 5);
    assert!(e.contains("session 999999 not found"), "{e}");

    // close: gone afterwards, and a second close is NOT_FOUND.
    assert_eq!(
        ok(&ctl(&d, &["close", &a.to_string()])),
        format!("closed session {a}\n")
    );
    let e = err(&ctl(&d, &["session", "info", &a.to_string()]), 5);
    assert!(e.contains(&format!("session {a} not found")), "{e}");
    let e = err(&ctl(&d, &["close", &a.to_string()]), 5);
    assert!(e.contains("NOT_FOUND"), "{e}");
    // Those NOT_FOUNDs answered the requests; none was the daemon's trouble.
    let out = ok(&ctl(&d, &["status"]));
    assert!(out.contains("(0 the daemon's"), "{out}");
    let v = json(&ctl(&d, &["--json", "sessions"]));
    assert_eq!(v["sessions"].as_array().unwrap().len(), 1);

    // evict (we started tierd ourselves; root is its default admin).
    if uid == 0 {
        let v = json(&ctl(&d, &["--json", "evict", &b.to_string()]));
        assert_eq!(v["session"], b);
        assert_eq!(v["action"], "evicted");
        let v = json(&ctl(&d, &["--json", "stats"]));
        assert_eq!(v["stats"]["sessions"], 0);
        assert_eq!(v["stats"]["host_bytes_used"], 0);
    }
    let e = err(&ctl(&d, &["session", "info", "999999"]), 5);
    assert!(e.contains("session 999999 not found"), "{e}");
}

/// Permission failures need a second uid: only when the tests run as root (as CI does),
/// tierctl is run as `nobody`.
#[test]
fn permission_denied_for_another_uid() {
    if !is_root() {
        eprintln!("not root: cannot run tierctl as another uid, test not applicable");
        return;
    }
    let d = start(&["--set", "server.socket_mode=0o666"]);
    let mut c = client(&d);
    let id = session(&mut c, "root's", 16);

    // With the socket's directory at 0700, nobody cannot reach the socket at all.
    std::fs::set_permissions(d.dir(), std::fs::Permissions::from_mode(0o700)).unwrap();
    let e = err(&ctl_as_nobody(&d, &["status"]), 4);
    assert!(e.contains("permission denied connecting to"), "{e}");

    // Open the directory: nobody connects, but the daemon refuses root's session and EVICT.
    std::fs::set_permissions(d.dir(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let o = ctl_as_nobody(&d, &["--json", "sessions"]);
    let v: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(
        v["sessions"].as_array().unwrap().len(),
        0,
        "nobody sees only own"
    );
    // Another uid's session reads as missing (ids cannot be probed).
    let e = err(&ctl_as_nobody(&d, &["session", "info", &id.to_string()]), 5);
    assert!(e.contains("not found"), "{e}");
    let e = err(&ctl_as_nobody(&d, &["close", &id.to_string()]), 5);
    assert!(e.contains("not found"), "{e}");
    let o = ctl_as_nobody(&d, &["--json", "evict", &id.to_string()]);
    let e = err(&o, 4);
    assert!(e.contains("EVICT needs an admin"), "{e}");
    let v: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["error"]["kind"], "PERMISSION_DENIED");
    // Still there for its owner.
    assert_eq!(c.session_info(id).unwrap().tokens_max, 16);
}

/// `tierctl session offload`: refused without the remote tier; with it (a real Redis
/// Cluster), the session moves to the cluster and another node resumes it with its tokens.
#[test]
fn session_offload_moves_a_session_to_another_node() {
    let d = start(&[]);
    let mut c = client(&d);
    let id = session(&mut c, "local", 20);
    let e = err(&ctl(&d, &["session", "offload", &id.to_string()]), 6);
    assert!(
        e.contains("OFFLOAD failed: FAILED_PRECONDITION") && e.contains("remote.enabled"),
        "{e}"
    );

    let Some(cluster) = kvtier_tests::redis::RedisCluster::start(3, 1) else {
        return;
    };
    let node = |name: &str| {
        start(&[
            "--set",
            "remote.enabled=true",
            "--set",
            &cluster.seeds_setting(),
            "--set",
            &format!("remote.node=\"{name}\""),
        ])
    };
    let (a, b) = (node("node-a"), node("node-b"));
    let id = session(&mut client(&a), "moving", 40);
    let ids = id.to_string();
    assert_eq!(
        ok(&ctl(&a, &["session", "offload", &ids])),
        format!("offloaded session {id}: 6 blocks written to the remote tier\n")
    );
    let e = err(&ctl(&a, &["session", "info", &ids]), 5);
    assert!(e.contains("not found"), "{e}");
    // A request that may wait resumes it on B (from its block summaries: PROMOTE then reads
    // its 6 blocks from the cluster); tierctl then shows it there, and where its bytes are.
    assert_eq!(client(&b).promote(id).unwrap(), 6);
    let v = json(&ctl(&b, &["--json", "session", "info", &ids]));
    assert_eq!(v["tokens_max"], 40, "{v}");
    assert!(v["remote_bytes"].as_u64().unwrap() > 0, "{v}");
    let table = ok(&ctl(&b, &["sessions"]));
    assert!(table.contains("ram+remote"), "{table}");
    let v = json(&ctl(&b, &["--json", "stats"]));
    assert_eq!(v["stats"]["remote_resumes_total"], 1, "{v}");
    // A is told where it is now.
    let e = err(&ctl(&a, &["session", "offload", &ids]), 6);
    assert!(
        e.contains(&format!(
            "session {id} is owned by node node-b (OWNED_ELSEWHERE)"
        )),
        "{e}"
    );
    let v = json(&ctl(&b, &["--json", "session", "offload", &ids]));
    assert_eq!(v["action"], "offloaded");
    assert_eq!(v["blocks"], 0, "nothing new to write: {v}");
}
