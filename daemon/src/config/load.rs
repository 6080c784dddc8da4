//! Loading a configuration: the layers (defaults, file, environment, `--set`) merged as TOML
//! trees, old field names, and validation of the whole.

use std::path::{Path, PathBuf};

use super::*;

/// Why a configuration was refused.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("reading config file {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("config file {path}: {message}")]
    Parse { path: PathBuf, message: String },
    #[error("{origin}: {message}")]
    Override { origin: String, message: String },
    #[error("invalid configuration: {field}: {reason}")]
    Invalid { field: &'static str, reason: String },
}

/// The tree as a typed config (the error message names the field).
fn typed(tree: &toml::Table) -> Result<Config, String> {
    tree.clone()
        .try_into()
        .map_err(|e: toml::de::Error| e.to_string().trim().replace('\n', " "))
}

/// Settings read under an old name too: (section, old field, field). A config file, variable
/// or `--set` written for an older tierd keeps working.
const RENAMED: [(&str, &str, &str); 2] = [
    ("host", "frame_bytes", "max_run_bytes"),
    ("nvme", "engine", "driver"),
];

/// `field` of `section` under its current name.
fn current_name<'a>(section: &str, field: &'a str) -> &'a str {
    RENAMED
        .iter()
        .find(|(s, old, _)| *s == section && *old == field)
        .map_or(field, |(_, _, new)| new)
}

/// Renames old fields of a parsed file to their current names (the current name wins if a
/// file has both).
fn rename_old_fields(file: &mut toml::Table) {
    for (section, old, new) in RENAMED {
        if let Some(toml::Value::Table(t)) = file.get_mut(section) {
            if let Some(v) = t.remove(old) {
                t.entry(new).or_insert(v);
            }
        }
    }
}

const SECTIONS: [&str; 10] = [
    "server",
    "host",
    "admission",
    "quota",
    "auth",
    "backend",
    "nvme",
    "remote",
    "log",
    "metrics",
];

impl Config {
    /// Defaults, overlaid with `file` (if any), then `TIERD_*` variables from `env`, then the
    /// `section.field=value` pairs of `overrides`; validated.
    pub fn load(
        file: Option<&Path>,
        env: impl IntoIterator<Item = (String, String)>,
        overrides: &[(String, String)],
    ) -> Result<Config, ConfigError> {
        let mut tree = toml::Table::try_from(Config::default()).expect("defaults serialize");
        if let Some(path) = file {
            let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
                path: path.into(),
                source,
            })?;
            let mut parsed: toml::Table =
                text.parse()
                    .map_err(|e: toml::de::Error| ConfigError::Parse {
                        path: path.into(),
                        message: e.to_string(),
                    })?;
            rename_old_fields(&mut parsed);
            merge(&mut tree, parsed);
            typed(&tree).map_err(|message| ConfigError::Parse {
                path: path.into(),
                message,
            })?;
        }
        for (key, value) in env {
            let Some(rest) = key.strip_prefix("TIERD_") else {
                continue;
            };
            let rest = rest.to_ascii_lowercase();
            let Some(section) = SECTIONS.iter().find(|s| rest.starts_with(&format!("{s}_"))) else {
                continue;
            };
            let field = &rest[section.len() + 1..];
            set(&mut tree, section, field, &value)
                .and_then(|()| typed(&tree))
                .map_err(|message| ConfigError::Override {
                    origin: format!("environment variable {key}"),
                    message,
                })?;
        }
        for (key, value) in overrides {
            let (section, field) = key.split_once('.').ok_or_else(|| ConfigError::Override {
                origin: format!("--set {key}"),
                message: "expected section.field=value".into(),
            })?;
            set(&mut tree, section, field, value)
                .and_then(|()| typed(&tree))
                .map_err(|message| ConfigError::Override {
                    origin: format!("--set {key}"),
                    message,
                })?;
        }
        // Each layer was converted as it was applied, so an error names its source.
        let cfg = typed(&tree).map_err(|message| ConfigError::Parse {
            path: PathBuf::from("<defaults>"),
            message,
        })?;
        cfg.validate()?;
        Ok(cfg)
    }

    pub fn validate(&self) -> Result<(), ConfigError> {
        fn bad(field: &'static str, reason: String) -> Result<(), ConfigError> {
            Err(ConfigError::Invalid { field, reason })
        }
        let run = self.host.max_run_bytes.0;
        if run == 0 || !run.is_multiple_of(4096) {
            return bad(
                "host.max_run_bytes",
                format!("must be a positive multiple of 4096, got {run}"),
            );
        }
        if self.host.capacity.0 < run {
            return bad(
                "host.capacity",
                format!(
                    "must hold at least one run of host.max_run_bytes {}, got {}",
                    self.host.max_run_bytes, self.host.capacity
                ),
            );
        }
        for (field, v) in [
            ("quota.host_share_per_uid", self.quota.host_share_per_uid),
            ("quota.nvme_share_per_uid", self.quota.nvme_share_per_uid),
        ] {
            if !(v > 0.0 && v <= 1.0) {
                return bad(field, format!("must be in (0, 1], got {v}"));
            }
        }
        if self.remote.enabled {
            if self.remote.seeds.is_empty() {
                return bad(
                    "remote.seeds",
                    "must name at least one cluster node when remote.enabled".into(),
                );
            }
            if self.remote.claim_ttl_ms < 300 {
                return bad(
                    "remote.claim_ttl_ms",
                    format!("must be at least 300, got {}", self.remote.claim_ttl_ms),
                );
            }
            if self.remote.node.contains(char::is_whitespace) {
                return bad(
                    "remote.node",
                    format!("must not contain spaces, got {:?}", self.remote.node),
                );
            }
        }
        let mfb = self.server.max_frame_bytes.0;
        if !(4096..=(1 << 30)).contains(&mfb) {
            return bad(
                "server.max_frame_bytes",
                format!(
                    "must be between 4KiB and 1GiB, got {}",
                    self.server.max_frame_bytes
                ),
            );
        }
        if self.server.socket_mode > 0o777 {
            return bad(
                "server.socket_mode",
                format!(
                    "must be permission bits (at most 0o777), got {:o}",
                    self.server.socket_mode
                ),
            );
        }
        if self.server.socket_path.as_os_str().is_empty() {
            return bad("server.socket_path", "must not be empty".into());
        }
        // sun_path holds 108 bytes including the terminating NUL.
        if self.server.socket_path.as_os_str().len() > 107 {
            return bad(
                "server.socket_path",
                format!(
                    "{} is longer than the 107 bytes a Unix socket path may have",
                    self.server.socket_path.display()
                ),
            );
        }
        for (field, v) in [
            ("server.max_connections", self.server.max_connections),
            ("admission.max_sessions", self.admission.max_sessions),
            (
                "admission.max_concurrent_requests",
                self.admission.max_concurrent_requests,
            ),
        ] {
            if v == 0 {
                return bad(field, "must be at least 1".into());
            }
        }
        if self.server.admin_connections >= self.server.max_connections {
            return bad(
                "server.admin_connections",
                format!(
                    "must leave other users a slot: below server.max_connections ({})",
                    self.server.max_connections
                ),
            );
        }
        let n = &self.nvme;
        if !(n.low_water > 0.0 && n.low_water < n.high_water && n.high_water <= 1.0) {
            // Name the value that is out of its range (high_water's is (0, 1]).
            let field = if n.high_water > 0.0 && n.high_water <= 1.0 {
                "nvme.low_water"
            } else {
                "nvme.high_water"
            };
            return bad(
                field,
                format!(
                    "need 0 < low_water < high_water <= 1, got low {} high {}",
                    n.low_water, n.high_water
                ),
            );
        }
        if n.enabled {
            // A page of the largest run: header block + run.
            let page = run + 4096;
            if n.devices.is_empty() && n.capacity.0 < page {
                return bad(
                    "nvme.capacity",
                    format!(
                        "must hold at least one page ({page} bytes), got {}",
                        n.capacity
                    ),
                );
            }
            if n.devices.iter().any(|d| d.capacity.0 < page) {
                return bad(
                    "nvme.devices",
                    format!("every device must hold at least one page ({page} bytes)"),
                );
            }
            if n.queue_depth == 0 || n.queue_depth > 4096 {
                return bad(
                    "nvme.queue_depth",
                    format!("must be in 1..=4096, got {}", n.queue_depth),
                );
            }
            let most = kvtier_storage::nvme::store::MAX_WORKERS;
            if n.workers > most {
                return bad(
                    "nvme.workers",
                    format!("must be in 0..={most} (0: one per core), got {}", n.workers),
                );
            }
        }
        let c = &self.backend.cuda;
        for (field, v) in [
            ("backend.cuda.max_backends", c.max_backends as u64),
            ("backend.cuda.max_sessions", c.max_sessions as u64),
            ("backend.cuda.lanes", c.lanes as u64),
            ("backend.cuda.max_blocks", c.max_blocks as u64),
            ("backend.cuda.max_batch", c.max_batch as u64),
            ("backend.cuda.register_chunk", c.register_chunk.0),
        ] {
            if v == 0 {
                return bad(field, "must be at least 1".into());
            }
        }
        if c.lanes > c.max_sessions {
            return bad(
                "backend.cuda.lanes",
                format!(
                    "must be at most backend.cuda.max_sessions ({}): each lane holds at least one \
                     session slot, got {}",
                    c.max_sessions, c.lanes
                ),
            );
        }
        if let Some(addr) = self.metrics.listen {
            if !addr.ip().is_loopback() && !self.metrics.allow_remote {
                return bad(
                    "metrics.listen",
                    format!(
                        "{addr} is not a loopback address; the endpoint has no authentication, \
                         so set metrics.allow_remote = true to expose it"
                    ),
                );
            }
        }
        if !["error", "warn", "info", "debug", "trace"].contains(&self.log.level.as_str()) {
            return bad(
                "log.level",
                format!(
                    "must be one of error, warn, info, debug, trace; got {:?}",
                    self.log.level
                ),
            );
        }
        Ok(())
    }
}

/// Overlays `src` onto `dst`, table by table.
fn merge(dst: &mut toml::Table, src: toml::Table) {
    for (k, v) in src {
        match (dst.get_mut(&k), v) {
            (Some(toml::Value::Table(d)), toml::Value::Table(s)) => merge(d, s),
            (_, v) => {
                dst.insert(k, v);
            }
        }
    }
}

/// Sets `section.field` from a string: parsed as a TOML value when it is one (numbers,
/// booleans, arrays), else taken as a string.
fn set(tree: &mut toml::Table, section: &str, field: &str, raw: &str) -> Result<(), String> {
    if !SECTIONS.contains(&section) {
        return Err(format!(
            "unknown section {section:?} (one of {})",
            SECTIONS.join(", ")
        ));
    }
    let value = format!("v = {raw}")
        .parse::<toml::Table>()
        .ok()
        .and_then(|mut t| t.remove("v"))
        .unwrap_or_else(|| toml::Value::String(raw.to_string()));
    let mut table = tree
        .entry(section)
        .or_insert_with(|| toml::Value::Table(Default::default()));
    // `backend.cuda.max_sessions`: walk sub-tables; `TIERD_BACKEND_CUDA_MAX_SESSIONS` names
    // the same field when its first word is a sub-table.
    let mut field = current_name(section, field).to_string();
    loop {
        let toml::Value::Table(t) = table else {
            return Err(format!("{section} is not a table"));
        };
        let sub = field
            .split_once(['.', '_'])
            .filter(|(head, _)| matches!(t.get(*head), Some(toml::Value::Table(_))))
            .map(|(head, rest)| (head.to_string(), rest.to_string()));
        match sub {
            Some((head, rest)) => {
                table = t.get_mut(&head).expect("checked above");
                field = rest;
            }
            None => {
                t.insert(field, value);
                return Ok(());
            }
        }
    }
}
