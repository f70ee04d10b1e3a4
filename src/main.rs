//! The `kvferry` command (docs/design.md §6).

use std::io::{IsTerminal, Read, Write};
use std::process::ExitCode;

use clap::Parser;
use kvferry::cli::{Cli, Command, PayloadAction};
use kvferry::error::CliError;

fn main() -> ExitCode {
    let cli = Cli::parse();
    if let Err(msg) = init_tracing(cli.log.as_deref()) {
        eprintln!("kvferry: error: {msg}");
        return ExitCode::from(2);
    }
    let result = match cli.command {
        Command::Demo(args) => kvferry::demo::run(&args),
        Command::Serve(args) => kvferry::roles::serve(&args),
        Command::Load(args) => kvferry::roles::load(&args),
        Command::Bench(args) => kvferry::bench::run(&args),
        Command::Doctor(args) => kvferry::doctor::run(&args),
        Command::Checksum(args) => kvferry::spec::checksum_spec(&args.spec)
            .map_err(CliError::from)
            .and_then(|v| print_json(&v)),
        Command::Payload { action } => payload(action),
    };
    // The one place an error becomes text for the user.
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("kvferry: error: {e}");
            ExitCode::from(1)
        }
    }
}

/// Logs to stderr with the `--log` / KVFERRY_LOG filter (default `info`).
/// Errors: a filter that does not parse.
fn init_tracing(filter: Option<&str>) -> Result<(), CliError> {
    use tracing_subscriber::EnvFilter;
    let (filter, from) = match (filter, std::env::var("KVFERRY_LOG")) {
        (Some(f), _) => (f.to_string(), "--log"),
        (None, Ok(f)) => (f, "KVFERRY_LOG"),
        (None, Err(_)) => ("info".to_string(), "default"),
    };
    let env_filter = EnvFilter::try_new(&filter).map_err(|source| CliError::LogFilter {
        from,
        filter: filter.clone(),
        source,
    })?;
    let _ = tracing_subscriber::fmt()
        .with_env_filter(env_filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .try_init();
    Ok(())
}

fn print_json(v: &serde_json::Value) -> Result<(), CliError> {
    let mut out = std::io::stdout().lock();
    serde_json::to_writer_pretty(&mut out, v)?;
    writeln!(out).map_err(CliError::io("writing stdout"))
}

fn payload(action: PayloadAction) -> Result<(), CliError> {
    let mut input = String::new();
    std::io::stdin()
        .read_to_string(&mut input)
        .map_err(CliError::io("reading stdin"))?;
    match action {
        PayloadAction::Decode => {
            let payload = kvferry_checksum::payload::Payload::from_base64(&input)
                .map_err(kvferry::payload_json::PayloadJsonError::from)?;
            drop(input);
            // Streamed: a JSON tree of a large payload took ten times its size.
            let mut out = std::io::BufWriter::new(std::io::stdout().lock());
            kvferry::payload_json::write_json(&payload, &mut out)
                .map_err(CliError::io("writing stdout"))?;
            writeln!(out)
                .and_then(|_| out.flush())
                .map_err(CliError::io("writing stdout"))
        }
        PayloadAction::Encode => {
            let text = kvferry::payload_json::encode_from_json(&input)?;
            println!("{text}");
            Ok(())
        }
    }
}
