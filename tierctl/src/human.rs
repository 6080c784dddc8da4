//! Human-readable rendering: byte sizes, durations, aligned tables.

use std::time::Duration;

/// IEC byte size with one decimal above 1 KiB: `512 B`, `1.5 GiB`.
pub fn bytes(n: u64) -> String {
    const UNITS: [&str; 6] = ["KiB", "MiB", "GiB", "TiB", "PiB", "EiB"];
    if n < 1024 {
        return format!("{n} B");
    }
    let mut v = n as f64 / 1024.0;
    let mut unit = 0;
    // Round before choosing the unit so 1023.96 KiB prints as 1.0 MiB, not 1024.0 KiB.
    while (v * 10.0).round() / 10.0 >= 1024.0 && unit + 1 < UNITS.len() {
        v /= 1024.0;
        unit += 1;
    }
    format!("{v:.1} {}", UNITS[unit])
}

/// Compact duration: `850ms`, `42s`, `5m12s`, `3h04m`, `2d05h`.
pub fn duration(d: Duration) -> String {
    let ms = d.as_millis();
    if ms < 1000 {
        return format!("{ms}ms");
    }
    let s = d.as_secs();
    match s {
        0..60 => format!("{s}s"),
        60..3600 => format!("{}m{:02}s", s / 60, s % 60),
        3600..86400 => format!("{}h{:02}m", s / 3600, s % 3600 / 60),
        _ => format!("{}d{:02}h", s / 86400, s % 86400 / 3600),
    }
}

/// How long ago `unix_ms` was, relative to `now_unix_ms`; `-` for 0 (never) and `0ms` for
/// a timestamp in the future (clock skew between daemon and CLI is not an error).
pub fn age(unix_ms: u64, now_unix_ms: u64) -> String {
    if unix_ms == 0 {
        return "-".into();
    }
    duration(Duration::from_millis(now_unix_ms.saturating_sub(unix_ms)))
}

/// `used / capacity (p%)`, or just `used` when the capacity is unknown or zero.
pub fn usage(used: u64, capacity: Option<u64>) -> String {
    match capacity {
        Some(cap) if cap > 0 => format!(
            "{} / {} ({:.1}%)",
            bytes(used),
            bytes(cap),
            used as f64 * 100.0 / cap as f64
        ),
        Some(cap) => format!("{} / {}", bytes(used), bytes(cap)),
        None => bytes(used),
    }
}

/// A transfer rate in IEC units: `512 B/s`, `1.3 GiB/s`.
pub fn rate(bytes_per_s: u64) -> String {
    format!("{}/s", bytes(bytes_per_s))
}

/// A latency given in ns: `850 ns`, `85 us`, `1.2 ms`, `2.0 s`.
pub fn latency_ns(ns: u64) -> String {
    match ns {
        0..1_000 => format!("{ns} ns"),
        1_000..1_000_000 => format!("{} us", ns / 1_000),
        1_000_000..1_000_000_000 => format!("{:.1} ms", ns as f64 / 1e6),
        _ => format!("{:.1} s", ns as f64 / 1e9),
    }
}

/// Parse a timeout such as `5s`, `250ms`, `1.5s`, `2m` or a bare number of seconds.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    parse_span(s).and_then(|d| {
        if d.is_zero() {
            Err(format!(
                "timeout `{}` must be above 0 and at most a day",
                s.trim()
            ))
        } else {
            Ok(d)
        }
    })
}

/// [`parse_duration`], 0 allowed (a sampling interval that takes no second sample).
pub fn parse_interval(s: &str) -> Result<Duration, String> {
    parse_span(s)
}

/// A duration of at most a day.
fn parse_span(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    let split = s
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    let value: f64 = num
        .parse()
        .map_err(|_| format!("`{s}` is not a duration (examples: 5s, 250ms, 2m)"))?;
    let scale = match unit.trim() {
        "" | "s" => 1.0,
        "ms" => 1e-3,
        "m" | "min" => 60.0,
        other => return Err(format!("unknown unit `{other}` in `{s}` (use ms, s or m)")),
    };
    let secs = value * scale;
    if !secs.is_finite() || secs > 86_400.0 {
        return Err(format!("`{s}` must be at most a day"));
    }
    Ok(Duration::from_secs_f64(secs))
}

/// Column alignment in a [`Table`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Align {
    Left,
    Right,
}

/// A plain-text table with a header row and columns padded to their widest cell.
#[derive(Debug)]
pub struct Table {
    headers: Vec<&'static str>,
    align: Vec<Align>,
    rows: Vec<Vec<String>>,
}

impl Table {
    pub fn new(columns: &[(&'static str, Align)]) -> Self {
        Self {
            headers: columns.iter().map(|c| c.0).collect(),
            align: columns.iter().map(|c| c.1).collect(),
            rows: Vec::new(),
        }
    }

    /// Add a row; it must have one cell per column.
    pub fn row(&mut self, cells: Vec<String>) {
        assert_eq!(cells.len(), self.headers.len(), "table row width");
        self.rows.push(cells);
    }

    pub fn render(&self) -> String {
        let mut width: Vec<usize> = self.headers.iter().map(|h| h.chars().count()).collect();
        for r in &self.rows {
            for (w, c) in width.iter_mut().zip(r) {
                *w = (*w).max(c.chars().count());
            }
        }
        let mut out = String::new();
        let headers: Vec<String> = self.headers.iter().map(|h| h.to_string()).collect();
        for r in std::iter::once(&headers).chain(&self.rows) {
            let mut line = String::new();
            for (i, cell) in r.iter().enumerate() {
                if i > 0 {
                    line.push_str("  ");
                }
                let pad = width[i] - cell.chars().count();
                match self.align[i] {
                    Align::Left => {
                        line.push_str(cell);
                        line.extend(std::iter::repeat_n(' ', pad));
                    }
                    Align::Right => {
                        line.extend(std::iter::repeat_n(' ', pad));
                        line.push_str(cell);
                    }
                }
            }
            out.push_str(line.trim_end());
            out.push('\n');
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_sizes() {
        assert_eq!(bytes(0), "0 B");
        assert_eq!(bytes(1023), "1023 B");
        assert_eq!(bytes(1024), "1.0 KiB");
        assert_eq!(bytes(1536 << 20), "1.5 GiB");
        assert_eq!(bytes(64 << 20), "64.0 MiB");
        assert_eq!(bytes((1 << 20) - 1), "1.0 MiB");
        assert_eq!(bytes(u64::MAX), "16.0 EiB");
    }

    #[test]
    fn durations_and_ages() {
        assert_eq!(duration(Duration::from_millis(850)), "850ms");
        assert_eq!(duration(Duration::from_secs(42)), "42s");
        assert_eq!(duration(Duration::from_secs(312)), "5m12s");
        assert_eq!(
            duration(Duration::from_secs(3 * 3600 + 4 * 60 + 59)),
            "3h04m"
        );
        assert_eq!(duration(Duration::from_secs(2 * 86400 + 5 * 3600)), "2d05h");
        assert_eq!(age(0, 5000), "-");
        assert_eq!(age(1000, 4000), "3s");
        assert_eq!(age(9000, 4000), "0ms");
    }

    #[test]
    fn rates_and_latencies() {
        assert_eq!(rate(1_395_864_371), "1.3 GiB/s");
        assert_eq!(rate(100), "100 B/s");
        assert_eq!(latency_ns(850), "850 ns");
        assert_eq!(latency_ns(85_400), "85 us");
        assert_eq!(latency_ns(1_250_000), "1.2 ms");
        assert_eq!(latency_ns(2_000_000_000), "2.0 s");
    }

    #[test]
    fn usage_lines() {
        assert_eq!(
            usage(16 << 20, Some(64 << 20)),
            "16.0 MiB / 64.0 MiB (25.0%)"
        );
        assert_eq!(usage(0, Some(0)), "0 B / 0 B");
        assert_eq!(usage(2048, None), "2.0 KiB");
    }

    #[test]
    fn timeouts_parse_and_bad_ones_are_rejected() {
        assert_eq!(parse_duration("5s"), Ok(Duration::from_secs(5)));
        assert_eq!(parse_duration("250ms"), Ok(Duration::from_millis(250)));
        assert_eq!(parse_duration("1.5"), Ok(Duration::from_millis(1500)));
        assert_eq!(parse_duration("2m"), Ok(Duration::from_secs(120)));
        for bad in [
            "", "s", "0", "0ms", "-1s", "5h", "abc", "1e9", "2 days", "100000",
        ] {
            assert!(parse_duration(bad).is_err(), "{bad:?} accepted");
        }
    }

    #[test]
    fn table_aligns_columns() {
        let mut t = Table::new(&[("ID", Align::Right), ("LABEL", Align::Left)]);
        t.row(vec!["7".into(), "chat".into()]);
        t.row(vec!["1234".into(), "-".into()]);
        assert_eq!(t.render(), "  ID  LABEL\n   7  chat\n1234  -\n");
    }
}
