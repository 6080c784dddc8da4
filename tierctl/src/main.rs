//! `tierctl` binary: parse the command line, run one command, map failures to exit codes.

use std::io::Write;
use std::process::ExitCode;

use clap::Parser;
use tierctl::{run, Cli, JsonError};

fn main() -> ExitCode {
    let cli = Cli::parse();
    let stdout = std::io::stdout();
    let mut out = stdout.lock();
    match run(&cli, &mut out) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            if cli.json {
                // Scripts reading stdout get the failure as JSON too; the exit code still
                // tells success apart.
                if let Ok(s) = serde_json::to_string(&JsonError::from(&e)) {
                    let _ = writeln!(out, "{s}");
                }
            }
            let _ = out.flush();
            eprintln!("tierctl: {e}");
            ExitCode::from(u8::try_from(e.exit_code()).unwrap_or(1))
        }
    }
}
