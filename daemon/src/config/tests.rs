//! Config layering (defaults, file, environment, flags) and validation messages.

use super::*;

fn load(
    toml_text: &str,
    env: &[(&str, &str)],
    sets: &[(&str, &str)],
) -> Result<Config, ConfigError> {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tierd.toml");
    std::fs::write(&path, toml_text).unwrap();
    Config::load(
        Some(&path),
        env.iter().map(|(k, v)| (k.to_string(), v.to_string())),
        &sets
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect::<Vec<_>>(),
    )
}

/// The message of a configuration that must not load.
fn load_err(toml_text: &str, env: &[(&str, &str)], sets: &[(&str, &str)]) -> String {
    load(toml_text, env, sets).unwrap_err().to_string()
}

#[test]
fn layering_is_defaults_then_file_then_env_then_cli() {
    let cfg = load(
        "[host]\ncapacity = \"2GiB\"\nframe_bytes = 131072\n[admission]\nmax_sessions = 7\n",
        &[
            ("TIERD_HOST_CAPACITY", "3GiB"),
            ("TIERD_LOG_LEVEL", "debug"),
            ("OTHER", "x"),
        ],
        &[
            ("host.capacity", "\"4GiB\""),
            ("server.socket_mode", "0o600"),
        ],
    )
    .unwrap();
    assert_eq!(
        cfg.host.capacity,
        ByteSize(4 << 30),
        "CLI beats env beats file"
    );
    assert_eq!(
        cfg.host.max_run_bytes,
        ByteSize(128 << 10),
        "file beats defaults (under the old name, frame_bytes)"
    );
    assert_eq!(cfg.admission.max_sessions, 7);
    assert_eq!(cfg.log.level, "debug");
    assert_eq!(cfg.server.socket_mode, 0o600);
    assert_eq!(
        cfg.server.max_frame_bytes,
        ByteSize(16 << 20),
        "default kept"
    );
}

#[test]
fn errors_name_the_field() {
    let none: &[(&str, &str)] = &[];
    for (toml_text, env, sets, named) in [
        (
            "[host]\nmax_run_bytes = 1000\n",
            none,
            none,
            "host.max_run_bytes",
        ),
        ("[host]\ncapacity = \"1KiB\"\n", none, none, "host.capacity"),
        ("[host]\ncapacity = \"12 parsecs\"\n", none, none, "parsecs"),
        ("[hots]\ncapacity = 1\n", none, none, "hots"),
        ("[host]\ncapacty = 1\n", none, none, "capacty"),
        ("[nvme]\nworkers = 65\n", none, none, "nvme.workers"),
        ("", &[("TIERD_LOG_LEVEL", "loud")], none, "log.level"),
        ("", none, &[("nonsense", "1")], "section.field"),
        (
            "",
            none,
            &[("admission.max_sessions", "0")],
            "admission.max_sessions",
        ),
        ("", none, &[("nvme.low_water", "0.95")], "nvme.low_water"),
        ("", none, &[("nvme.high_water", "1.5")], "nvme.high_water"),
        (
            "",
            none,
            &[("server.admin_connections", "2000")],
            "server.admin_connections",
        ),
    ] {
        let e = load_err(toml_text, env, sets);
        assert!(e.contains(named), "{e}");
    }
}

#[test]
fn cuda_section_layers_and_validates() {
    let cfg = load(
        "[backend.cuda]\nmax_sessions = 4\n",
        &[("TIERD_BACKEND_CUDA_MAX_BLOCKS", "1024")],
        &[
            ("backend.cuda.max_batch", "2"),
            ("backend.cuda.launch", "\"fused\""),
        ],
    )
    .unwrap();
    let s = &cfg.backend.cuda;
    assert_eq!((s.max_sessions, s.max_blocks, s.max_batch), (4, 1024, 2));
    assert_eq!(s.launch, super::LaunchSetting::Fused);
    assert_eq!(s.max_backends, 2, "default kept");
    let e = load_err("[backend.cuda]\nlaunch = \"sometimes\"\n", &[], &[]);
    assert!(e.contains("sometimes") || e.contains("launch"), "{e}");
    let e = load_err("[backend.cuda]\nmax_batch = 0\n", &[], &[]);
    assert!(e.contains("backend.cuda.max_batch"), "{e}");
    let e = load_err("[backend.cuda]\nmax_batchez = 1\n", &[], &[]);
    assert!(e.contains("max_batchez"), "{e}");
    assert_eq!(s.lanes, 1, "default kept");
    let e = load_err("[backend.cuda]\nlanes = 0\n", &[], &[]);
    assert!(
        e.contains("backend.cuda.lanes") && e.contains("at least 1"),
        "{e}"
    );
    let e = load_err("[backend.cuda]\nmax_sessions = 2\nlanes = 3\n", &[], &[]);
    assert!(
        e.contains("backend.cuda.lanes") && e.contains("at most"),
        "{e}"
    );
}

#[test]
fn metrics_are_off_by_default_and_loopback_unless_allowed() {
    let cfg = load("", &[], &[]).unwrap();
    assert_eq!(cfg.metrics.listen, None);
    assert_eq!(cfg.log.format, LogFormat::Auto);
    let cfg = load("", &[("TIERD_METRICS_LISTEN", "127.0.0.1:9464")], &[]).unwrap();
    assert_eq!(cfg.metrics.listen, Some("127.0.0.1:9464".parse().unwrap()));
    let cfg = load("[metrics]\nlisten = \"[::1]:9464\"\n", &[], &[]).unwrap();
    assert!(cfg.metrics.listen.unwrap().ip().is_loopback());
    let e = load_err("[metrics]\nlisten = \"0.0.0.0:9464\"\n", &[], &[]);
    assert!(
        e.contains("metrics.listen") && e.contains("allow_remote"),
        "{e}"
    );
    let cfg = load(
        "[metrics]\nlisten = \"0.0.0.0:9464\"\nallow_remote = true\n",
        &[],
        &[],
    )
    .unwrap();
    assert!(cfg.metrics.allow_remote);
    let e = load_err("[metrics]\nlisten = \"localhost\"\n", &[], &[]);
    assert!(e.contains("metrics") || e.contains("listen"), "{e}");
    let e = load_err("[log]\nformat = \"xml\"\n", &[], &[]);
    assert!(e.contains("xml"), "{e}");
}

#[test]
fn sizes_parse_and_print() {
    assert_eq!("256KiB".parse::<ByteSize>().unwrap(), ByteSize(256 << 10));
    assert_eq!(" 8 GiB ".parse::<ByteSize>().unwrap(), ByteSize(8 << 30));
    assert_eq!("4096".parse::<ByteSize>().unwrap(), ByteSize(4096));
    assert!("1.5GiB".parse::<ByteSize>().is_err());
    assert_eq!(ByteSize(3 << 30).to_string(), "3GiB");
    assert_eq!(ByteSize(1000).to_string(), "1000");
}

#[test]
fn the_shipped_production_config_is_valid() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs/tierd.toml");
    let cfg = Config::load(Some(&path), std::iter::empty(), &[]).unwrap();
    assert_eq!(
        cfg.server.socket_path,
        PathBuf::from("/run/kvtier/tierd.sock")
    );
    assert!(cfg.host.lock_memory, "production locks the host tier");
    // Journald's format under the unit (stderr is the journal), text on a terminal.
    assert_eq!(cfg.log.format, LogFormat::Auto);
    assert_eq!(cfg.metrics.listen, None, "metrics are opt-in");
}

/// Every setting tierd has is written out in the shipped config, which is where operators
/// read what they can set (README: "configs/tierd.toml documents every setting").
#[test]
fn the_shipped_production_config_names_every_setting() {
    fn paths(t: &toml::Table, prefix: &str, out: &mut Vec<String>) {
        for (k, v) in t {
            match v {
                toml::Value::Table(sub) => paths(sub, &format!("{prefix}{k}."), out),
                _ => out.push(format!("{prefix}{k}")),
            }
        }
    }
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs/tierd.toml");
    let shipped: toml::Table = std::fs::read_to_string(path).unwrap().parse().unwrap();
    let (mut have, mut all) = (vec![], vec![]);
    paths(&shipped, "", &mut have);
    // Settings that default to none (server.socket_group, metrics.listen) serialize to nothing.
    paths(
        &toml::Table::try_from(Config::default()).unwrap(),
        "",
        &mut all,
    );
    let missing: Vec<&String> = all.iter().filter(|k| !have.contains(k)).collect();
    assert!(missing.is_empty(), "configs/tierd.toml lacks {missing:?}");
}

#[test]
fn errors_name_the_source_of_the_bad_value() {
    let none: &[(&str, &str)] = &[];
    let e = load_err("", &[("TIERD_HOST_CAPACITY", "1EiB")], none);
    assert!(
        e.starts_with("environment variable TIERD_HOST_CAPACITY: ") && e.contains("host.capacity"),
        "{e}"
    );
    let e = load_err("", none, &[("host.capacity", "\"7XB\"")]);
    assert!(e.starts_with("--set host.capacity: "), "{e}");
    assert!(!e.contains('\n'), "one line: {e}");
    let e = load_err("[host]\ncapacity = \"7XB\"\n", none, none);
    assert!(
        e.starts_with("config file ") && e.contains("tierd.toml"),
        "{e}"
    );
}

#[test]
fn socket_mode_prints_in_octal_and_reads_back() {
    let text = toml::to_string(&Config::default()).unwrap();
    assert!(text.contains("socket_mode = \"0o660\""), "{text}");
    let cfg = load(&text, &[], &[]).unwrap();
    assert_eq!(cfg, Config::default());
    for given in ["0o640", "\"0o640\"", "\"640\"", "416"] {
        let cfg = load("", &[], &[("server.socket_mode", given)]).unwrap();
        assert_eq!(cfg.server.socket_mode, 0o640, "{given}");
    }
    let e = load_err("", &[], &[("server.socket_mode", "\"rw\"")]);
    assert!(e.contains("octal mode"), "{e}");
}

#[test]
fn the_io_driver_loads_under_its_old_name_too() {
    let cfg = load("[nvme]\nengine = \"pread\"\n", &[], &[]).unwrap();
    assert_eq!(
        cfg.nvme.driver,
        IoDriverKind::Pread,
        "nvme.engine, the old name"
    );
    let cfg = load(
        "",
        &[("TIERD_NVME_ENGINE", "uring")],
        &[("nvme.engine", "\"pread\"")],
    )
    .unwrap();
    assert_eq!(
        cfg.nvme.driver,
        IoDriverKind::Pread,
        "--set nvme.engine, the old name"
    );
    let cfg = load("", &[("TIERD_NVME_DRIVER", "uring")], &[]).unwrap();
    assert_eq!(cfg.nvme.driver, IoDriverKind::Uring);
}
